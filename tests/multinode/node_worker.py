"""Training loop for the multi-node tests: one gloo all-reduce per step, one line per step.

argv: OUT_DIR. Each step appends {"t", "node", "cycle", "rank", "world", "step", "sum"} to
OUT_DIR/steps.jsonl (one short write with O_APPEND: lines of several ranks never mix).
Rank 0 stops the job when OUT_DIR/stop exists; the decision travels in the all-reduce, so
every rank leaves at the same step. FAIL_RANK / FAIL_STEP: that global rank exits 5 at that
step, once per job (OUT_DIR/failed marks it done). STEP_S: pause per step (default 0.05 s).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient

out = Path(sys.argv[1])
client = RankMonitorClient()
client.init_workload_monitoring()
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
cycle = int(os.environ["FT_CYCLE"])
node = os.path.basename(os.environ["FT_RUN_DIR"])
step_s = float(os.environ.get("STEP_S", "0.05"))
fail = (os.environ.get("FAIL_RANK"), os.environ.get("FAIL_STEP", "10"))
fd = os.open(out / "steps.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
step = 0
while True:
    stop = 1.0 if rank == 0 and (out / "stop").exists() else 0.0
    t = torch.tensor([float(rank + 1), stop])
    dist.all_reduce(t)
    line = {"t": time.time(), "node": node, "cycle": cycle, "rank": rank, "world": world,
            "step": step, "sum": t[0].item()}
    os.write(fd, (json.dumps(line) + "\n").encode())
    client.send_heartbeat()
    if t[1].item() > 0:
        break
    if (str(rank), str(step)) == fail and world > 1 and not (out / "failed").exists():
        (out / "failed").touch()
        os._exit(5)  # sys.exit would tear the process group down mid-job: gloo aborts
    step += 1
    time.sleep(step_s)
dist.barrier()
dist.destroy_process_group()
