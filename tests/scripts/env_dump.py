"""Writes the worker's environment to FT_RUN_DIR/env/cycle_<c>_rank_<r>.json, then exits.

Also records the worker's entry in FT_RUN_DIR/workers.json (waited for up to 10 s: the
launcher writes it once every worker of the cycle started) and whether RANK shows in its
/proc/self/environ (not for a warm worker, whose initial environment is the zygote's)."""

import json
import os
import sys
import time
from pathlib import Path

run_dir = Path(os.environ["FT_RUN_DIR"])
entry = None
deadline = time.monotonic() + 10
while entry is None and time.monotonic() < deadline:
    try:
        entry = json.loads((run_dir / "workers.json").read_text())["workers"].get(
            str(os.getpid()))
    except (OSError, ValueError):
        pass
    if entry is None:
        time.sleep(0.02)
proc_environ = Path("/proc/self/environ").read_bytes().split(b"\0")
out = run_dir / "env"
out.mkdir(exist_ok=True)
name = f"cycle_{os.environ['FT_CYCLE']}_rank_{os.environ['RANK']}.json"
(out / name).write_text(json.dumps({
    "env": dict(os.environ), "argv": sys.argv, "workers_json": entry,
    "rank_in_proc_environ": any(v.startswith(b"RANK=") for v in proc_environ)}))
print(f"rank {os.environ['RANK']} says hello", flush=True)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
