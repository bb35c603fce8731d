"""Each cycle: gloo all-reduce across every node's ranks, write the result, heartbeat.

With FAIL_RANK set, that global rank exits 5 in cycle 0 after the all-reduce.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient

client = RankMonitorClient()
client.init_workload_monitoring()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cycle = int(os.environ["FT_CYCLE"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"cycle_{cycle}_rank_{rank}.json").write_text(
    json.dumps({"sum": t.item(), "world": world, "restart_count":
                int(os.environ["TORCHELASTIC_RESTART_COUNT"])}))
client.send_heartbeat()
if cycle == 0 and str(rank) == os.environ.get("FAIL_RANK"):
    time.sleep(0.5)
    sys.exit(5)
for _ in range(10):
    time.sleep(0.05)
    client.send_heartbeat()
dist.barrier()
dist.destroy_process_group()
