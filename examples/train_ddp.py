"""A small real DDP training (CPU and gloo, or GPUs and NCCL) that checkpoints and resumes.

Run it under ft_launcher (or torchrun, or plain python for one process):

    ft_launcher --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py --steps 300

With ``--device cuda`` each rank trains on ``cuda:LOCAL_RANK`` (the launcher's rotated
``CUDA_VISIBLE_DEVICES`` makes that the rank's GPU) and DDP runs over NCCL, also with one
rank, so NCCL is exercised on a single GPU.

Every rank sends a heartbeat per step through ft_agent (a no-op outside ft_launcher) and
offers a snapshot of its state every --snapshot-every steps (the launcher's frequency
decides which are taken; snapshots are on by default); rank 0 writes a checkpoint every
--ckpt-every steps. After a restart every rank resumes from the newest snapshot every rank
holds in memory, else from the checkpoint, so with snapshots off a crash loses at most
--ckpt-every steps. The data of step N is generated from a seed and N, so a resumed run
computes exactly what an uninterrupted one would.

SIGUSR1 (Slurm's ``--signal=B:USR1@N`` before a time limit, passed on by ft_launcher) makes
every rank stop at the same step, checkpoint and exit 0, so the job can be requeued.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ft_agent import RankMonitorClient


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="total training steps")
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint interval (steps)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory [FT_RUN_DIR/ckpt]")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--hang-at-step", type=int, default=None,
                   help="rank --hang-rank sleeps forever at this step (first cycle only)")
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="rank --hang-rank exits 3 at this step (first cycle only)")
    p.add_argument("--snapshot-every", type=int, default=1,
                   help="offer a snapshot every N steps (the launcher's frequency, by "
                        "default the one the ranks agree on, decides which are taken)")
    p.add_argument("--sections", action="store_true", help="time each step as a section")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo between ranks; cuda: cuda:LOCAL_RANK and NCCL, any world size")
    return p.parse_args()


def batch(step: int, seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + rank)
    x = torch.randn(32, 16, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.5
    return x, y


def hang_forever() -> None:
    """A named function so a stack dump shows where the rank hung."""
    while True:
        time.sleep(3600)


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cycle = int(os.environ.get("FT_CYCLE", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    ckpt_dir = Path(args.ckpt_dir or Path(os.environ.get("FT_RUN_DIR", ".")) / "ckpt")
    ckpt_path = ckpt_dir / "ckpt.pt"

    stop_requested = []
    # Installed first: SIGUSR1's default action would kill the rank.
    signal.signal(signal.SIGUSR1, lambda *_: stop_requested.append(True))

    ft = RankMonitorClient()
    ft.init_workload_monitoring()
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 or device.type == "cuda":
        dist.init_process_group(backend)
    print(f"rank {rank} cycle {cycle}: device {device} backend "
          f"{backend if dist.is_initialized() else 'none'} world {world}", flush=True)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = resume(ft, model, opt, ckpt_path, device, f"rank {rank} cycle {cycle}")
    ddp = DistributedDataParallel(model) if dist.is_initialized() else model

    loss = torch.tensor(0.0, device=device)
    for step in range(start + 1, args.steps + 1):
        if args.sections:
            ft.start_section("step")
        if cycle == 0 and rank == args.hang_rank and step == args.hang_at_step:
            hang_forever()
        if cycle == 0 and rank == args.hang_rank and step == args.fail_at_step:
            os._exit(3)
        x, y = (t.to(device) for t in batch(step, args.seed, rank))
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        if args.sections:
            ft.end_section("step")
        if step % args.snapshot_every == 0:  # copied to host memory, written in the background
            ft.snapshot({"model": model.state_dict(), "opt": opt.state_dict()}, step)
        ft.send_heartbeat()
        ft.report_progress(step)  # the launcher's goodput ledger counts steps from these
        print(f"rank {rank} cycle {cycle} step {step} loss {loss.item():.6f}", flush=True)
        stop = should_stop(bool(stop_requested), world, device)
        if step % args.ckpt_every == 0 or step == args.steps or stop:
            save_checkpoint(rank, step, model, opt, ckpt_dir, ckpt_path)
            if world > 1:
                dist.barrier()
            ft.report_checkpoint(step)  # saved: a restart resumes from here
        if stop:
            print(f"rank {rank} cycle {cycle}: SIGUSR1, checkpointed step {step}", flush=True)
            break
    else:
        if rank == 0:
            result = {"steps": args.steps, "final_loss": round(loss.item(), 6), "cycle": cycle}
            (ckpt_dir / "result.json").write_text(json.dumps(result))
    ft.shutdown_workload_monitoring()
    if dist.is_initialized():
        dist.destroy_process_group()


def resume(ft: RankMonitorClient, model: nn.Module, opt: torch.optim.Optimizer,
           ckpt_path: Path, device: torch.device, who: str) -> int:
    """Load the newest state: the in-memory snapshot every rank holds, else the disk
    checkpoint, else nothing; the step to continue after."""
    restored = ft.restore()
    if restored is not None:
        state, step = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        print(f"{who}: resumed from snapshot step {step}", flush=True)
        return step
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=True, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        print(f"{who}: resumed from step {state['step']}", flush=True)
        return state["step"]
    return 0


def should_stop(requested: bool, world: int, device: torch.device) -> bool:
    """True on every rank once any rank got SIGUSR1, so all stop at the same step."""
    if world == 1:
        return requested
    flag = torch.tensor([1.0 if requested else 0.0], device=device)  # NCCL: a CUDA tensor
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def save_checkpoint(rank: int, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    ckpt_dir: Path, ckpt_path: Path) -> None:
    if rank != 0:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, ckpt_path)  # a crash mid-save never leaves a torn checkpoint
    (ckpt_dir / "iteration").write_text(str(step))


if __name__ == "__main__":
    main()
