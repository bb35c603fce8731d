"""straggler_train.py's loop with ``device=True`` sections, on a machine without a GPU.

MOCK: the CUDA event only (this machine has no GPU). Each fake event records the host's
monotonic time; rank ``--slow-rank``'s events report ``--factor`` times the elapsed time, as
a GPU running at 1/factor would, and the host work is the same on every rank, so only the
device times say which rank is slow. Everything else is real: the client, its frames, the
launcher's monitor and detector. Stops after ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from ft_agent import RankMonitorClient
from ft_agent.device_time import DeviceTimer


class FakeCudaEvent:
    """MOCK of torch.cuda.Event(enable_timing=True): completed at once."""

    def __init__(self, scale: float) -> None:
        self.scale, self.at = scale, 0.0

    def record(self) -> None:
        self.at = time.monotonic()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        return (end.at - self.at) * 1000.0 * self.scale


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--factor", type=float, default=3.0)
    args = p.parse_args()
    client = RankMonitorClient()
    client.init_workload_monitoring()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scale = args.factor if rank == args.slow_rank else 1.0
    client._device = DeviceTimer(new_event=lambda: FakeCudaEvent(scale))
    flag = torch.zeros(1)
    for _ in range(args.steps):
        with client.section("compute", device=True):
            time.sleep(0.02)  # the same on every rank: wall times say nothing
        dist.all_reduce(flag)
        client.send_heartbeat()
    dist.barrier()
    dist.destroy_process_group()
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
