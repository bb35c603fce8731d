"""One rank of a small CPU training job driven by the rerun state machine (test helper).

Run by tests/rerun/test_multiprocess.py with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
FT_DEVICE_ID in the environment; trains a tiny model with dropout on 2 microbatches per step,
averages gradients over gloo, checkpoints and exits with the code the machine asks for, and
writes what happened to --out as JSON.

Injections (--inject RANK:STEP:KIND:CHECK, repeatable) put a NaN into the checked value
(CHECK "loss" is validated fatally, "aux" not) on rank RANK at step STEP:
  transient  only on the first pass of the step in this process;
  device=ID  on every pass while FT_DEVICE_ID is ID (a faulty device);
  always     on every pass (the input itself gives NaN: a correct result).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import rerun  # noqa: E402
from rerun import RerunDataIterator, RerunMode, RerunStateMachine  # noqa: E402

MODES = {
    "validate": RerunMode.VALIDATE_RESULTS,
    "report": RerunMode.REPORT_DETERMINISM_STATS,
    "disabled": RerunMode.DISABLED,
}


class Loader:
    """Deterministic per-rank batches, positioned by an index saved in the checkpoint."""

    def __init__(self, rank: int, pos: int = 0) -> None:
        self.rank, self.pos = rank, pos

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + self.pos)
        self.pos += 1
        return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def parse_injections(specs: list[str]) -> list[tuple[int, int, str, str]]:
    out = []
    for spec in specs:
        rank, step, kind, check = spec.split(":")
        out.append((int(rank), int(step), kind, check))
    return out


def injected(injections, rank: int, step: int, check: str, pass_no: int) -> bool:
    for r, s, kind, c in injections:
        if (r, s, c) != (rank, step, check):
            continue
        if kind == "transient" and pass_no == 1:
            return True
        if kind == "always":
            return True
        if kind.startswith("device=") and os.environ.get("FT_DEVICE_ID") == kind[7:]:
            return True
    return False


def train(args, rank: int, world: int, mode: RerunMode, events: list) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker_file = os.path.join(args.ckpt, "tracker.jsonl") if args.ckpt else None
    rerun.destroy_rerun_state_machine()
    rerun.initialize_rerun_state_machine(mode=mode, result_rejected_tracker_filename=tracker_file)
    machine = rerun.get_rerun_state_machine()
    ckpt_path = os.path.join(args.ckpt, f"rank{rank}.pt") if args.ckpt else None
    completed, loader_pos = 0, 0
    if ckpt_path and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["rng"])
        completed, loader_pos = ck["completed"], ck["loader_pos"]
        if machine.validate_state_dict(ck["rerun"]):
            machine.load_state_dict(ck["rerun"])
    # Megatron-LM style: the loop tells the machine how many steps are done.
    machine.current_iteration = completed
    skip = []
    if args.skip_from_tracker and tracker_file:
        skip = RerunStateMachine.get_skipped_iterations_from_tracker_file(tracker_file)
    loader = Loader(rank, loader_pos)
    data = RerunDataIterator(loader)
    injections = parse_injections(args.inject)
    passes: dict[int, int] = defaultdict(int)
    losses: dict[int, list[float]] = defaultdict(list)
    first_step = completed + 1
    exit_code = 0
    for step in range(first_step, args.steps + 1):
        step_start = loader.pos  # where a resumed job's loader starts this step
        if step in skip:
            while machine.should_run_forward_backward(data):
                next(data), next(data)  # a dummy step: drain its microbatches
                passes[step] += 1
            continue
        while machine.should_run_forward_backward(data):
            passes[step] += 1
            opt.zero_grad()
            total = torch.zeros(())
            aux = torch.zeros(())
            for _ in range(2):
                x, y = next(data)
                x.add_(1.0)  # the model may edit its input in place; replay must not care
                out = torch.nn.functional.dropout(model(x), p=0.3, training=True)
                loss = torch.nn.functional.mse_loss(out, y) / 2
                if injected(injections, rank, step, "loss", passes[step]):
                    loss = loss * float("nan")
                loss.backward()
                total = total + loss.detach()
                aux = aux + out.detach().mean()
            if injected(injections, rank, step, "aux", passes[step]):
                aux = aux * float("nan")
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            losses[step].append(total.item())
            machine.validate_result(total, torch.isnan, "loss is NaN", fatal=True)
            machine.validate_result(aux, torch.isnan, "output is NaN", fatal=False)
        save, stop, code = machine.should_checkpoint_and_exit()
        if save:
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "rng": torch.get_rng_state(),
                    "completed": step - 1,
                    "loader_pos": step_start,
                    "rerun": machine.state_dict(data, "torch"),
                },
                ckpt_path,
            )
        if stop:
            exit_code = code
            break
        opt.step()
    return {
        "exit_code": exit_code,
        "first_step": first_step,
        "passes": passes,
        "losses": losses,
        "skip": skip,
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "stats": machine.last_stats_report,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mode", default="validate", choices=[*MODES, "determinism"])
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--skip-from-tracker", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    events: list = []
    rerun.add_diagnosis_listener(events.append)
    if args.mode == "determinism":
        # The same training three times: what the re-runs computed must be bit-identical.
        result = {m: train(args, rank, world, MODES[m], events) for m in MODES}
        exit_code = max(r["exit_code"] for r in result.values())
    else:
        result = train(args, rank, world, MODES[args.mode], events)
        exit_code = result["exit_code"]
    result = {"rank": rank, "events": events, "result": result}
    with open(args.out, "w") as f:
        json.dump(result, f)  # also proves the events are JSON-serialisable
    # Leave together, and without tearing gloo down: a peer whose process group is
    # destroyed while the other's closes its sockets can abort in C++ ("terminate called
    # without an active exception", exit -6) after the verdict was already given.
    dist.barrier()
    return exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
