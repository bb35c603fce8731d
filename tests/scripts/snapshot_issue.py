"""The issue's training: each rank's state is one 50 MB tensor; a step is --step-s of sleep
and an update of the tensor, the ranks kept in step by an all-reduce; after each step the
state goes to ``client.snapshot`` (the launcher's default frequency decides which are
taken) and ``client.restore()`` runs at start.

In cycle 0, rank 1 SIGKILLs itself during the first write that a ``snapshot()`` call at or
after --kill-at starts: the write's background thread is stopped at its checksums, after the
copy and before the commit record (a kill after the call returns can land after that 10 ms
commit, the main thread held off by a busy machine). Cycle 0 runs on past --steps until then
(up to 4 x --kill-at steps): on a loaded machine the default frequency can space the
snapshots so widely that none starts between --kill-at and --steps. Each rank prints every
snapshot it started ("started N") and where it resumed from.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient
from ft_agent import snapshot as store


def kill_during_the_next_write() -> threading.Event:
    """Arm the kill: the next write's checksums (its background thread) wait until the
    returned event is set, once the main thread has printed that the write started, then
    SIGKILL the process. A test hook on the store's private checksum name."""
    assert hasattr(store, "crc32"), "the store no longer checksums through ft_agent.snapshot.crc32"
    printed = threading.Event()

    def checksum_then_die(*args, **kwargs):
        printed.wait(30)
        os.kill(os.getpid(), signal.SIGKILL)

    store.crc32 = checksum_then_die
    return printed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--kill-at", type=int, default=40)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    cycle = int(os.environ.get("FT_CYCLE", "0"))
    dist.init_process_group("gloo")
    client = RankMonitorClient()
    client.init_workload_monitoring()
    state = torch.zeros(args.mb * 2**20 // 4)
    start = 0
    restored = client.restore()
    if restored is not None:
        state, start = restored[0]["w"], restored[1]
        print(f"rank {rank} cycle {cycle}: resumed from snapshot step {start}", flush=True)
    flag = torch.zeros(1)
    last = args.steps if cycle > 0 else max(args.steps, 4 * args.kill_at)
    printed = None
    for step in range(start + 1, last + 1):
        time.sleep(args.step_s)
        state.fill_(float(step))  # the step's result: the state of step N holds N
        dist.all_reduce(flag)
        if cycle == 0 and rank == 1 and step >= args.kill_at and printed is None:
            printed = kill_during_the_next_write()
        status = client.snapshot({"w": state}, step)
        client.send_heartbeat()
        client.report_progress(step)
        if status is not None and status.started:
            print(f"rank {rank} cycle {cycle}: started {step}", flush=True)
            if printed is not None:
                printed.set()
                time.sleep(60)  # the write's thread kills the process
    client.shutdown_workload_monitoring()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
