"""Fails every cycle after writing the checkpoint-iteration file argv[1] (atomically, as a
training saving a checkpoint would): 5 in cycle 0, then 5 again ("stall") or 5 + the cycle
("advance")."""

import os
import sys
from pathlib import Path

path, mode = Path(sys.argv[1]), sys.argv[2]
cycle = int(os.environ["FT_CYCLE"])
tmp = path.with_suffix(".tmp")
tmp.write_text(f"{5 + (cycle if mode == 'advance' else 0)}\n")
os.replace(tmp, path)
sys.exit(1)
