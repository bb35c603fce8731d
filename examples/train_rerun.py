"""DDP training on CPU whose loss is validated by the rerun state machine.

Injects silent data corruption (a NaN loss) to show the whole flow under ft_launcher:

    ft_launcher --nproc-per-node 2 --max-restarts 2 examples/train_rerun.py --fault device

--fault device     NaN whenever --fault-rank runs on device --fault-device (a faulty device):
                   re-run in place reproduces it -> exit 16 -> the launcher rotates devices ->
                   the re-run from the checkpoint differs -> PERSISTENT_ERROR -> exit 17.
--fault data       NaN at --at on --fault-rank on any device (bad data): reproduced on the
                   other device too -> CORRECT_RESULT -> exit 17 (skipped on restart with
                   ft_launcher --ft-skip-bad-iterations).
--fault transient  NaN once: the re-run in place differs -> TRANSIENT_ERROR -> exit 17 ->
                   the launcher restarts in place and training goes on.

--snapshots (with ft_launcher --ft-snapshot-every N) keeps the state in the launcher's
in-memory snapshots instead of disk checkpoints: the step the machine must re-run is
resumed from the snapshot it asked for before exiting.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ft_agent import get_client
from ft_agent.rerun_host import default_tracker_file, setup_rerun_state_machine
from rerun import RerunDataIterator, RerunStateMachine, share_iterations_to_skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--at", type=int, default=5, help="step (1-based) of the injected NaN")
    p.add_argument("--fault", choices=["none", "device", "data", "transient"], default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-device", default="1")
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--snapshots", action="store_true",
                   help="in-memory snapshots (--ft-snapshot-every) instead of disk checkpoints")
    return p.parse_args()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def steps_to_skip(rank: int) -> set[int]:
    """Steps the tracker file says to skip, the same on every rank.

    Rank 0 reads the file and ``share_iterations_to_skip`` hands its list to the others
    (Megatron-LM reads it on every rank; ranks that disagree run mismatched collectives).
    """
    tracker = default_tracker_file()
    steps: list[int] = []
    if rank == 0 and tracker and Path(tracker).exists():
        steps = RerunStateMachine.get_skipped_iterations_from_tracker_file(tracker)
    return set(share_iterations_to_skip(steps))


def load(ckpt: Path, snapshots: bool) -> dict | None:
    """The state to resume: the snapshot the launcher chose, or the disk checkpoint."""
    if snapshots:
        restored = get_client().restore()
        return None if restored is None else restored[0]
    if ckpt.exists():
        return torch.load(ckpt, weights_only=False)  # our own file: plain data and tensors
    return None


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cycle = int(os.environ.get("FT_CYCLE", "0"))
    device = os.environ.get("FT_DEVICE_ID", "0")
    ckpt_dir = Path(os.environ.get("FT_RUN_DIR", ".")) / "ckpt_rerun"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / f"rank_{rank}.pt"

    machine = setup_rerun_state_machine("validate_results")
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    state = load(ckpt, args.snapshots)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if machine.validate_state_dict(state["rerun"]):
            machine.load_state_dict(state["rerun"])
    skip = steps_to_skip(rank)
    ddp = DistributedDataParallel(model) if world > 1 else model
    # The loader resumes at the first step not completed (Megatron: the consumed samples),
    # also when the machine re-runs that step from the checkpoint.
    data = RerunDataIterator(batch(s, rank) for s in itertools.count(start + 1))
    first_try: set[int] = set()

    def corrupt(step: int) -> bool:
        if rank != args.fault_rank or step != args.at:
            return False
        if args.fault == "device":
            return device == args.fault_device
        if args.fault == "transient":
            fresh = step not in first_try and cycle == 0
            first_try.add(step)
            return fresh
        return args.fault == "data"

    def save(step: int) -> None:
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                 "rerun": machine.state_dict(data, "torch")}
        if args.snapshots:
            # Written before returning: the machine may ask for this state just before an
            # exit (16 or 17), and the next cycle re-runs the step from it.
            get_client().snapshot(state, step, at_once=True)
            return
        torch.save(state, ckpt.with_suffix(".tmp"))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)

    losses = {}
    for step in range(start + 1, args.steps + 1):
        while machine.should_run_forward_backward(data):
            x, y = next(data)
            if step in skip:
                continue  # a skipped step only drains its data
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            if corrupt(step):
                loss = loss * float("nan")
            machine.validate_result(loss, torch.isnan, "loss is NaN", fatal=True)
            loss.backward()
            losses[step] = loss.item()
        save_now, stop, code = machine.should_checkpoint_and_exit()
        if save_now:
            save(step - 1)
        if stop:
            print(f"rank {rank} cycle {cycle} device {device}: exit {code} at step {step}",
                  flush=True)
            # Deliver the diagnosis and leave the process group before exiting: an exit
            # with a live gloo group can abort when a peer has already gone.
            get_client().shutdown_workload_monitoring()
            if world > 1:
                dist.destroy_process_group()
            sys.exit(code)
        if step not in skip:
            opt.step()
        if step % args.ckpt_every == 0:
            save(step)
        get_client().send_heartbeat()
    if rank == 0:
        (ckpt_dir / "result.json").write_text(json.dumps(
            {"cycle": cycle, "skipped": sorted(skip), "last_step": args.steps,
             "losses": losses}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
