"""Writes the worker's environment to FT_RUN_DIR/env/cycle_<c>_rank_<r>.json, then exits."""

import json
import os
import sys
from pathlib import Path

out = Path(os.environ["FT_RUN_DIR"]) / "env"
out.mkdir(exist_ok=True)
name = f"cycle_{os.environ['FT_CYCLE']}_rank_{os.environ['RANK']}.json"
(out / name).write_text(json.dumps({"env": dict(os.environ), "argv": sys.argv}))
print(f"rank {os.environ['RANK']} says hello", flush=True)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
