"""A small synchronous job whose compute runs on the GPU, timed with device=True sections.

Each step, the ranks in turn: ``client.section("compute", device=True)`` around
``--matmuls`` matrix products on this rank's GPU (at least enough for ``BASE_DEVICE_S``; rank
``--slow-rank`` does ``--factor`` times as many); then a gloo all-reduce of a CPU flag. The
kernels are only queued inside the section, so its wall time is the same on every rank; its
device time is not. Stops after --steps.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient

# A fast rank's kernels take at least this long per section, so they outlast the section's
# 5 ms of host work on any GPU and its device time is the kernels' (an H200 runs the default
# 8 products of 2048 in ~2 ms).
BASE_DEVICE_S = 0.02


def _matmuls_for(a: torch.Tensor, seconds: float) -> int:
    """How many of the step's products take ``seconds`` on this GPU."""
    x = (a @ a).tanh_()
    torch.cuda.synchronize(a.device)
    start = time.perf_counter()
    for _ in range(4):
        x = (x @ a).tanh_()
    torch.cuda.synchronize(a.device)
    return math.ceil(seconds / max((time.perf_counter() - start) / 4, 1e-6))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--matmuls", type=int, default=8)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--factor", type=int, default=2)
    args = p.parse_args()
    client = RankMonitorClient()
    client.init_workload_monitoring()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                          % torch.cuda.device_count())
    a = torch.randn(args.size, args.size, device=device)
    base = torch.tensor([max(args.matmuls, _matmuls_for(a, BASE_DEVICE_S))])
    dist.all_reduce(base, op=dist.ReduceOp.MAX)  # the same base on every rank
    n = int(base) * (args.factor if rank == args.slow_rank else 1)
    flag = torch.zeros(1)
    for _ in range(args.steps):
        # The ranks take turns: on a GPU they share, one rank's events would otherwise also
        # span the other's kernels (time-slicing), which blurs the 2x between them.
        for turn in range(dist.get_world_size()):
            if turn == rank:
                with client.section("compute", device=True):
                    x = a
                    for _ in range(n):
                        x = (x @ a).tanh_()
                    # Host work of a fixed length: the wall times of the ranks' sections are
                    # alike (queuing 2x the kernels costs microseconds); the device time is not.
                    time.sleep(0.005)
                torch.cuda.current_stream(device).synchronize()  # the step's end
            dist.barrier()
        dist.all_reduce(flag)
        client.send_heartbeat()
    dist.barrier()
    dist.destroy_process_group()
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
