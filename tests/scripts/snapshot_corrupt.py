"""Runs examples/train_ddp.py with its arguments; in cycle 0, rank 1 corrupts every snapshot
it holds at step $CORRUPT_AT (one byte of tensor data flipped; the commit records stay as
they are, as after a bit flip in memory) and exits 3. The next cycle must reject those
copies and resume from the disk checkpoint."""

import os
import runpy
import sys
from pathlib import Path

from ft_agent import RankMonitorClient

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")
CORRUPT_AT = int(os.environ.get("CORRUPT_AT", "0"))
snapshot = RankMonitorClient.snapshot


def corrupting_snapshot(self, state, iteration):
    status = snapshot(self, state, iteration)
    if (os.environ.get("FT_CYCLE") == "0" and os.environ.get("RANK") == "1"
            and iteration == CORRUPT_AT):
        self._snapshots.store.wait()
        for path in Path(os.environ["FT_SNAPSHOT_DIR"]).glob("slot_*.bin"):
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([byte ^ 0xFF]))
        print(f"rank 1: corrupted the snapshots at step {iteration}", flush=True)
        os._exit(3)
    return status


RankMonitorClient.snapshot = corrupting_snapshot
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
