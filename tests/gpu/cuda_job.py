"""A small CUDA training job for the GPU tests, run under ft_launcher (one rank per GPU).

Each step runs a small model on ``cuda:0`` (the launcher's ``CUDA_VISIBLE_DEVICES`` makes
that the rank's device), synchronises, heartbeats and prints one line the tests parse:

    CUDA_STEP cycle=C step=S t=<time.time() after the step> pid=P

With ``--nccl`` the model is wrapped in DistributedDataParallel over an NCCL process group
(any world size, 1 included), so every step all-reduces gradients through NCCL and DDP
imports torch._dynamo, as real jobs do. ``--hang-in-kernel-at STEP`` makes the first cycle
launch a CUDA kernel that spins for ``--hang-seconds`` at that step and wait for it: the
rank is then stuck inside the kernel, with its Python stack in ``hang_in_kernel``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ft_agent import RankMonitorClient


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="steps in the first cycle")
    p.add_argument("--steps-after-restart", type=int, default=3, help="steps in later cycles")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--nccl", action="store_true", help="DDP over an NCCL process group")
    p.add_argument("--hang-in-kernel-at", type=int, default=None)
    p.add_argument("--hang-seconds", type=float, default=600.0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run of the plumbing (gloo, the hang is a sleep)")
    return p.parse_args()


def cycles_per_second() -> float:
    """GPU clock cycles per second, measured with a short torch.cuda._sleep."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


def hang_in_kernel(seconds: float, cycle: int, device: torch.device) -> None:
    """A named function so the stack dump shows where the rank hung: the kernel spins on
    the GPU while the host thread waits for it in torch.cuda.synchronize()."""
    spin = int(cycles_per_second() * seconds) if device.type == "cuda" else 0
    print(f"HANG_IN_KERNEL cycle={cycle} t={time.time():.6f} pid={os.getpid()}", flush=True)
    if device.type != "cuda":
        time.sleep(seconds)
        return
    torch.cuda._sleep(spin)
    torch.cuda.synchronize()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    cycle = int(os.environ.get("FT_CYCLE", "0"))
    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    device = torch.device(args.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model: nn.Module = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)
    if args.nccl and device.type == "cuda":
        dist.init_process_group("nccl", timeout=timedelta(seconds=300), device_id=device)
        model = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    elif args.nccl:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = args.steps if cycle == 0 else args.steps_after_restart
    for step in range(1, steps + 1):
        if cycle == 0 and step == args.hang_in_kernel_at:
            hang_in_kernel(args.hang_seconds, cycle, device)
        x = torch.randn(64, 256, device=device)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sync(device)
        print(f"CUDA_STEP cycle={cycle} step={step} t={time.time():.6f} pid={os.getpid()}",
              flush=True)
        ft.send_heartbeat()
        if args.step_time:
            time.sleep(args.step_time)
    ft.shutdown_workload_monitoring()
    if args.nccl:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
