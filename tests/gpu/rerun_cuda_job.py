"""The rerun state machine on a GPU under ft_launcher, with a "faulty" GPU (test helper).

The GPU the job first runs on is declared faulty (its UUID is written to
``FT_RUN_DIR/faulty_gpu`` by the first cycle): at step ``--at`` the loss computed there is
NaN. The machine re-runs the step in place (NaN again), checkpoints and exits 16. After the
launcher's restart the step is re-run from the checkpoint on whatever GPU the rotated
``CUDA_VISIBLE_DEVICES`` gives: another GPU computes a finite loss (PERSISTENT_ERROR, exit
17); the same GPU asks again for another device (16).

Each cycle appends one JSON line to ``FT_RUN_DIR/rerun_cuda.jsonl``: the cycle, the GPU UUID
the rerun machine identifies (``rerun.identity``), the UUID of every visible CUDA index in
order, CUDA_VISIBLE_DEVICES and FT_DEVICE_ID.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from ft_agent import get_client
from ft_agent.rerun_host import setup_rerun_state_machine
from rerun import RerunDataIterator
from rerun.identity import current_device_identity


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def uuid_of(index: int) -> str:
    text = str(torch.cuda.get_device_properties(index).uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run (the identity is then FT_DEVICE_ID)")
    args = p.parse_args()
    run_dir = Path(os.environ["FT_RUN_DIR"])
    cycle = int(os.environ.get("FT_CYCLE", "0"))

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # this rank's device: index 0 of its CUDA_VISIBLE_DEVICES
        torch.zeros(1, device="cuda")
    device = torch.device(args.device)
    here = current_device_identity()[1]
    with (run_dir / "rerun_cuda.jsonl").open("a") as f:
        f.write(json.dumps({
            "cycle": cycle, "uuid": here,
            "visible": [uuid_of(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ft_device_id": os.environ.get("FT_DEVICE_ID"),
        }) + "\n")
    faulty_file = run_dir / "faulty_gpu"
    if not faulty_file.exists():
        faulty_file.write_text(here)
    faulty = faulty_file.read_text().strip()

    machine = setup_rerun_state_machine("validate_results")
    torch.manual_seed(0)
    model = nn.Linear(8, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = run_dir / "rerun_cuda_ckpt.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)  # our own file: plain data and tensors
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if machine.validate_state_dict(state["rerun"]):
            machine.load_state_dict(state["rerun"])
    data = RerunDataIterator(batch(s) for s in itertools.count(start + 1))

    for step in range(start + 1, args.steps + 1):
        while machine.should_run_forward_backward(data):
            x, y = (t.to(device) for t in next(data))
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if step == args.at and current_device_identity()[1] == faulty:
                loss = loss * float("nan")  # the faulty GPU computes garbage
            machine.validate_result(loss, torch.isnan, "loss is NaN", fatal=True)
            loss.backward()
        save_now, stop, code = machine.should_checkpoint_and_exit()
        if save_now:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "step": step - 1, "rerun": machine.state_dict(data, "torch")},
                       ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
        if stop:
            print(f"cycle {cycle} on {here}: exit {code} at step {step}", flush=True)
            get_client().shutdown_workload_monitoring()  # delivers the diagnosis first
            sys.exit(code)
        opt.step()
        get_client().send_heartbeat()
    print(f"cycle {cycle} on {here}: finished", flush=True)


if __name__ == "__main__":
    main()
