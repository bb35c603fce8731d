"""A small synchronous gloo job for straggler tests: compute in a section, then a collective.

Each step: ``client.section(SECTION)`` around a fixed amount of pure-Python CPU work (the
same on every rank, so a rank is slow only when its process is) and then ``--sleep``
seconds (work that waits, as on a device: the same on every rank, costs no CPU, and is
hardly stretched by a busy machine), then a gloo all-reduce that also carries rank 0's stop
flag, so every rank leaves on the same step, then ``--idle`` seconds of sleep (data
loading, say; it also leaves CPU to others). Each rank appends ``step wall_time compute_s
work_cpu_s`` per step to OUT/cycle_<c>_rank_<r>.txt (the section's wall time, and the CPU
time of the work inside it, which the load on the machine does not stretch).

    straggler_train.py OUT [--work N] [--sleep S] [--seconds S] [--min-steps K] [--idle S]
                       [--section N]

Rank 0 stops the job once OUT/stop exists (a test writes it when it has seen enough) or
``--seconds`` passed since the process started, and at least ``--min-steps`` steps ran.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

START = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ft_agent import RankMonitorClient  # noqa: E402


def work(iterations: int) -> int:
    x = 0
    for i in range(iterations):
        x += i * i
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=int, default=700_000, help="loop iterations per step")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--min-steps", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="seconds slept inside the section, after the work")
    parser.add_argument("--idle", type=float, default=0.0)
    parser.add_argument("--section", default="compute")
    args = parser.parse_args()

    client = RankMonitorClient()
    client.init_workload_monitoring()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"cycle_{os.environ.get('FT_CYCLE', '0')}_rank_{rank}.txt", "w")
    torch.set_num_threads(1)
    flags = torch.zeros(2)
    step = 0
    while True:
        t0 = time.monotonic()
        with client.section(args.section):
            c0 = time.thread_time()
            work(args.work)
            work_cpu = time.thread_time() - c0
            if args.sleep:
                time.sleep(args.sleep)
        compute = time.monotonic() - t0
        done = step + 1 >= args.min_steps and (
            time.monotonic() - START >= args.seconds or (args.out / "stop").exists())
        flags[0], flags[1] = 1.0, float(rank == 0 and done)
        dist.all_reduce(flags)
        client.send_heartbeat()
        log.write(f"{step} {time.time():.6f} {compute:.6f} {work_cpu:.6f}\n")
        log.flush()
        step += 1
        if flags[1] > 0:
            break
        time.sleep(args.idle)
    dist.barrier()
    dist.destroy_process_group()
    log.close()
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
