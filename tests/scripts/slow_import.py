"""A module whose import takes minutes (a preload that hangs on a slow file system):
tests/test_warm_restart.py preloads it to stop a launcher whose first cycle waits for it."""

import time

time.sleep(300)
