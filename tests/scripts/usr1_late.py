"""Installs its SIGUSR1 handler late: only once FT_RUN_DIR/go exists (the test writes it).

Writes FT_RUN_DIR/started_<rank> at once; on SIGUSR1 prints "rank R: got SIGUSR1" and exits
0; exits 3 when no SIGUSR1 comes within 60 s of the handler, 4 when "go" never comes.
"""

import os
import signal
import sys
import time
from pathlib import Path

run = Path(os.environ["FT_RUN_DIR"])
rank = os.environ["RANK"]
(run / f"started_{rank}").write_text("")
deadline = time.monotonic() + 60
while not (run / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(4)
    time.sleep(0.02)
got = []
signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
print(f"rank {rank}: {'got SIGUSR1' if got else 'no SIGUSR1'}", flush=True)
sys.exit(0 if got else 3)
