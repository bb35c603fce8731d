#!/usr/bin/env python
"""Per-iteration cost of the rerun state machine, against a bare loop and Megatron-Core's.

    python scripts/bench_rerun.py [--iters N] [--repeats R] [--megatron] [--json PATH]

Each implementation runs in its own process (ours with this Python; Megatron-Core 0.16.1 in
a private virtualenv under .bench/mcore-venv, created on first use) through the same loop:
a small MLP on CPU, one microbatch per step, loss validated with torch.isnan, inside a
1-process gloo group so the machine's all-reduce really runs. Every process also times the
bare loop, so each ratio compares numbers taken in the same process; the table reports
medians over the repeats, modes interleaved so machine noise hits them alike.

Megatron-Core asks CUDA for the device, its RNG state and an all-reduce tensor; on CPU those
are replaced by stand-ins (device 0, an empty RNG state, the same flags reduced on a CPU
tensor), as shared/PEERS.md describes.

Never run by the test suite beyond a tiny smoke run (--iters 5, without --megatron).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MCORE_VENV = ROOT / ".bench" / "mcore-venv"
MCORE_REQUIREMENTS = ["torch==2.13.0", "megatron-core==0.16.1"]
MODES = ["DISABLED", "VALIDATE_RESULTS", "REPORT_DETERMINISM_STATS"]


# ------------------------------------------------------------------------------ worker
def _init_world() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_megatron():
    """Import Megatron-Core's module and give it CPU stand-ins for what it asks of CUDA."""
    import torch
    import torch.distributed as dist
    from megatron.core import rerun_state_machine as mod

    torch.cuda.current_device = lambda: 0
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None

    def reduce_any(self, value):
        values = value if isinstance(value, list) else [value]
        flags = torch.tensor([int(v) for v in values], dtype=torch.int32)
        dist.all_reduce(flags)
        out = tuple(x > 0 for x in flags.tolist())
        return out if isinstance(value, list) else out[0]

    mod.RerunStateMachine._reduce_any = reduce_any
    return mod


def _load_ours():
    sys.path.insert(0, str(ROOT))
    import rerun.rerun_state_machine as mod

    return mod


class _Batches:
    """An endless stream of (x, y) batches made once (data loading is not what we time)."""

    def __init__(self, torch, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g))
                      for _ in range(n)]
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return self.items[self.i % len(self.items)]


def _time_loop(torch, iters: int, mod=None, mode_name: str | None = None) -> float:
    """Microseconds per iteration of the training loop, bare when ``mod`` is None."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.functional.mse_loss
    if mod is None:
        data = _Batches(torch)
        start = time.perf_counter()
        for _ in range(iters):
            opt.zero_grad()
            x, y = next(data)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        return (time.perf_counter() - start) / iters * 1e6
    mod.destroy_rerun_state_machine()
    mod.initialize_rerun_state_machine(mode=getattr(mod.RerunMode, mode_name))
    machine = mod.get_rerun_state_machine()
    data = mod.RerunDataIterator(_Batches(torch))
    start = time.perf_counter()
    for _ in range(iters):
        while machine.should_run_forward_backward(data):
            opt.zero_grad()
            x, y = next(data)
            loss = loss_fn(model(x), y)
            machine.validate_result(loss, torch.isnan, "loss is NaN")
            loss.backward()
        _, stop, code = machine.should_checkpoint_and_exit()
        if stop:
            raise RuntimeError(f"unexpected exit request {code}")
        opt.step()
    return (time.perf_counter() - start) / iters * 1e6


def worker(impl: str, iters: int, repeats: int) -> dict:
    """Time bare and each mode, interleaved, ``repeats`` times; medians in µs/iter."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # the machines log each initialisation
    _init_world()
    mod = _load_megatron() if impl == "megatron" else _load_ours()
    samples: dict[str, list[float]] = {"bare": [], **{m: [] for m in MODES}}
    errors: dict[str, str] = {}
    _time_loop(torch, max(1, iters // 10))  # warm-up
    for _ in range(repeats):
        samples["bare"].append(_time_loop(torch, iters))
        for m in MODES:
            if m in errors:
                continue
            try:
                samples[m].append(_time_loop(torch, iters, mod, m))
            except Exception as exc:  # Megatron's stats report crashes; record, go on
                errors[m] = f"{type(exc).__name__}: {exc}"
    return {
        "impl": impl,
        "medians_us": {k: statistics.median(v) for k, v in samples.items() if v},
        "errors": errors,
    }


# ------------------------------------------------------------------------------ driver
def ensure_megatron_venv() -> Path:
    """Create .bench/mcore-venv with torch and megatron-core once; return its python."""
    python = MCORE_VENV / "bin" / "python"
    probe = [str(python), "-c", "import megatron.core.rerun_state_machine"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {MCORE_VENV} with {' '.join(MCORE_REQUIREMENTS)} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(MCORE_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *MCORE_REQUIREMENTS],
                   check=True, timeout=1800)
    return python


def run_worker(python: str, impl: str, iters: int, repeats: int) -> dict:
    cmd = [python, __file__, "--worker", impl, "--iters", str(iters), "--repeats", str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("MASTER_PORT", "RANK", "WORLD_SIZE"):  # a private 1-process world
        env.pop(key, None)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{impl} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(ours: dict, megatron: dict | None) -> str:
    def cell(result, key):
        if result is None:
            return "–"
        if key in result["errors"]:
            return "crashes"
        return f"{result['medians_us'][key]:.1f}"

    def ratio(result, key):
        if result is None or key in result["errors"]:
            return "–"
        return f"{result['medians_us'][key] / result['medians_us']['bare']:.2f}"

    lines = [
        "| mode | µs/iter ours | µs/iter megatron | ours ÷ megatron | ours ÷ bare | "
        "megatron ÷ bare |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in ["bare", *MODES]:
        both = megatron is not None and key not in ours["errors"] | megatron["errors"]
        versus = (f"{ours['medians_us'][key] / megatron['medians_us'][key]:.2f}"
                  if both else "–")
        lines.append(f"| {key} | {cell(ours, key)} | {cell(megatron, key)} | {versus} | "
                     f"{ratio(ours, key)} | {ratio(megatron, key)} |")
    for result in (ours, megatron):
        for key, err in (result or {}).get("errors", {}).items():
            lines.append(f"\n{result['impl']} {key}: {err}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="iterations per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per mode")
    parser.add_argument("--megatron", action="store_true", help="also time Megatron-Core")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--worker", choices=["ours", "megatron"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iters < 1 or args.repeats < 1:
        parser.error("--iters and --repeats must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.worker, args.iters, args.repeats)))
        return 0
    ours = run_worker(sys.executable, "ours", args.iters, args.repeats)
    megatron = None
    if args.megatron:
        megatron = run_worker(str(ensure_megatron_venv()), "megatron", args.iters, args.repeats)
    print(f"rerun state machine, {args.iters} iterations x {args.repeats} repeats (medians)\n")
    print(table(ours, megatron))
    if args.json:
        Path(args.json).write_text(json.dumps({"iters": args.iters, "repeats": args.repeats,
                                               "ours": ours, "megatron": megatron}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
