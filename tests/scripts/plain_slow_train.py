"""A plain 2-rank gloo loop that times nothing through ft_agent (the throttle's case).

Each step: ``--work`` iterations of pure-Python CPU work (timed here with
time.perf_counter), ``--idle`` seconds of sleep, then a gloo all-reduce that also carries
rank 0's stop flag. Each rank appends ``step wall_time compute_s sleep_s allreduce_s`` per
step to OUT/cycle_<c>_rank_<r>.txt.

    plain_slow_train.py OUT [--work N] [--idle S] [--seconds S]

Rank 0 stops the job once OUT/stop exists or ``--seconds`` passed since the start.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

START = time.monotonic()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def work(iterations: int) -> int:
    x = 0
    for i in range(iterations):
        x += i * i
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=int, default=175_000)
    parser.add_argument("--idle", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"cycle_{os.environ.get('FT_CYCLE', '0')}_rank_{rank}.txt", "w")
    torch.set_num_threads(1)
    flags = torch.zeros(2)
    step = 0
    while True:
        t0 = time.perf_counter()
        work(args.work)
        t1 = time.perf_counter()
        if args.idle:
            time.sleep(args.idle)
        t2 = time.perf_counter()
        done = time.monotonic() - START >= args.seconds or (args.out / "stop").exists()
        flags[0], flags[1] = 1.0, float(rank == 0 and done)
        dist.all_reduce(flags)
        t3 = time.perf_counter()
        log.write(f"{step} {time.time():.6f} {t1 - t0:.6f} {t2 - t1:.6f} {t3 - t2:.6f}\n")
        log.flush()
        step += 1
        if flags[1] > 0:
            break
    dist.barrier()
    dist.destroy_process_group()
    log.close()


if __name__ == "__main__":
    main()
