"""Forms a gloo process group, all-reduces, and (rank 1) SIGKILLs itself until cycle N.

Proves that every new cycle's process group forms, however often the group is restarted.

    crash_loop.py N [--cold K]

In the first K cycles (default 0) rank 1 dies as soon as its all-reduce is done, before the
launcher has spare standbys ready as a rule, so the next cycle may start cold (fresh
interpreters). In the later cycles it dies only once the launcher has a spare standby for
every local rank (read from events.jsonl), so the next cycle is forked from them: warm.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def spares_ready(run_dir: Path, local_world: int) -> bool:
    """A ready standby not taken as a worker for every local rank (the latest per rank)."""
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
           if line.strip()]
    taken = {pid for e in evs if e["event"] == "workers_started" for pid in e["pids"]}
    latest = {e["local_rank"]: e["pid"] for e in evs if e["event"] == "standby_ready"}
    return len([pid for pid in latest.values() if pid not in taken]) >= local_world


parser = argparse.ArgumentParser()
parser.add_argument("crashes", type=int)
parser.add_argument("--cold", type=int, default=0)
args = parser.parse_args()
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
assert t.item() == sum(range(1, dist.get_world_size() + 1)), t
print(f"cycle {cycle} rank {dist.get_rank()} all_reduce ok", flush=True)
if cycle < args.crashes and dist.get_rank() == 1:
    if cycle >= args.cold:
        run_dir = Path(os.environ["FT_RUN_DIR"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        deadline = time.monotonic() + 60
        while not spares_ready(run_dir, local_world) and time.monotonic() < deadline:
            time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
