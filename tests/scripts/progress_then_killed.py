"""Steps, reports progress and a checkpoint, and in cycle 0 rank 0 SIGKILLs itself a known
time after its checkpoint. Every moment that matters is written down (unix time) in the
--marks file *before* the launcher can see it, so the test can check the ledger against it.

Rank 0 checkpoints at --ckpt-step (a file in FT_RUN_DIR: the resume point). Rank 1 steps to
--ckpt-step + 5 in cycle 0 and then idles, so the last step of the cycle is rank 0's.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

from ft_agent import RankMonitorClient

parser = argparse.ArgumentParser()
parser.add_argument("--marks", required=True)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--ckpt-step", type=int, default=20)
parser.add_argument("--kill-after", type=float, default=1.0)
parser.add_argument("--step-time", type=float, default=0.05)
args = parser.parse_args()

rank, cycle = int(os.environ["RANK"]), int(os.environ["FT_CYCLE"])
ckpt_file = Path(os.environ["FT_RUN_DIR"]) / "ckpt_step"
marks = open(args.marks, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)


def mark(what: str, **fields) -> float:
    t = time.time()
    marks.write(json.dumps({"what": what, "rank": rank, "cycle": cycle, "t": t, **fields}) + "\n")
    return t


client = RankMonitorClient()
client.init_workload_monitoring()
start = int(ckpt_file.read_text()) if ckpt_file.exists() else 0
ckpt_t = None
for step in range(start + 1, args.steps + 1):
    time.sleep(args.step_time)
    client.send_heartbeat()
    mark("step", iteration=step)
    client.report_progress(step)
    if cycle == 0 and rank == 1 and step >= args.ckpt_step + 5:
        while True:  # a bystander: keeps heartbeating, makes no more steps
            client.send_heartbeat()
            time.sleep(0.05)
    if rank == 0 and step == args.ckpt_step and cycle == 0:
        ckpt_file.write_text(str(step))
        ckpt_t = mark("checkpoint", iteration=step)
        client.report_checkpoint(step)
    if ckpt_t is not None and time.time() >= ckpt_t + args.kill_after:
        time.sleep(0.05)  # the last progress report leaves before the process dies
        mark("kill")
        os.kill(os.getpid(), signal.SIGKILL)
client.shutdown_workload_monitoring()
