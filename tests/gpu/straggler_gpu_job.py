"""A small synchronous job whose compute runs on the GPU, timed with device=True sections.

Each step: ``client.section("compute", device=True)`` around ``--matmuls`` matrix products
on this rank's GPU (rank ``--slow-rank`` does ``--factor`` times as many), then a gloo
all-reduce of a CPU flag. The kernels are only queued inside the section, so its wall time
is the same on every rank; its device time is not. Stops after --steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient


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
    n = args.matmuls * (args.factor if rank == args.slow_rank else 1)
    flag = torch.zeros(1)
    for _ in range(args.steps):
        with client.section("compute", device=True):
            x = a
            for _ in range(n):
                x = (x @ a).tanh_()
            # Host work of a fixed length: the wall times of the ranks' sections are alike
            # (queuing 2x the kernels costs microseconds), so only the device time differs.
            time.sleep(0.005)
        torch.cuda.current_stream(device).synchronize()  # the step's end (an optimizer's)
        dist.all_reduce(flag)
        client.send_heartbeat()
    dist.barrier()
    dist.destroy_process_group()
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
