"""A module that starts a thread when imported: forking a process that imported it is not
safe (tests/test_warm_restart.py preloads it to see the zygote fall back)."""

import threading
import time

_worker = threading.Thread(target=lambda: time.sleep(3600), daemon=True,
                           name="thread-on-import")
_worker.start()
