"""Cycle 0: rank 1 exits 5 once the launcher's zygote is ready (``zygote_ready`` in
events.jsonl) and a moment more, so that cycle 1 starts with a cycle store listening. Every
cycle: a gloo all-reduce, then the store settings this rank saw to OUT/cycle_<c>_rank_<r>.json.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
cycle = int(os.environ["FT_CYCLE"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"cycle_{cycle}_rank_{rank}.json").write_text(json.dumps({
    "sum": t.item(), "master_port": int(os.environ["MASTER_PORT"]),
    "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}))
if cycle == 0 and rank == 1:
    events = Path(os.environ["FT_RUN_DIR"]) / "events.jsonl"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and '"zygote_ready"' not in events.read_text():
        time.sleep(0.2)
    time.sleep(2.0)  # the zygote forks the spare store host once ready
    sys.exit(5)
dist.barrier()
dist.destroy_process_group()
