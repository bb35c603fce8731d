"""What snapshots cost a training run, with and without, side by side.

    python scripts/bench/snapshot_overhead.py                       # 1 s steps, 200 MB, 20 pairs
    python scripts/bench/snapshot_overhead.py --every 1 --out /tmp/every1.json
    python scripts/bench/snapshot_overhead.py --step-s 0.1 --pairs 5 --out /tmp/x.json
    python scripts/bench/snapshot_overhead.py --device cuda --out snapshot_overhead_gpu.json

Runs ``scripts/bench/snapshot_step.py`` (2 ranks, gloo, ``--mb`` MB of state per rank, a
step of fixed compute calibrated once to about ``--step-s`` seconds; with ``--device cuda``
state and compute on the GPU, which the 2 ranks share on a one-GPU machine) under ``ft_launcher``
in pairs: one run with ``--ft-snapshot-every off``, one with the launcher's default
frequency (or ``--every``'s, e.g. ``1`` for every step), in alternating order. Each run's
figure is the ranks' step loop wall time (first step excluded, so start-up is not counted);
a pair's overhead is with / without - 1. The same is also reported for the steady state,
from the third step on: by then a rank's first slot files have had their memory claimed, a
cost paid once per job. Medians printed, everything written to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from bench import machine_info  # noqa: E402

STEP = HERE / "snapshot_step.py"


def calibrate(step_s: float, device: str, size: int) -> int:
    """Matmul rounds that take about ``step_s`` on one core, or on the GPU (the compute)."""
    torch.set_num_threads(1)
    a = torch.randn(size, size, device=device)
    rounds = 50
    while True:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x = a
        for _ in range(rounds):
            x = torch.tanh(x @ a)
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        if took > 0.2:
            return max(1, round(rounds * step_s / took))
        rounds *= 2


class RunFailed(Exception):
    """A run that did not finish with 0; its output's tail is the message."""


def run_once(work: int, args: argparse.Namespace, snapshots: bool, tmp: Path
             ) -> tuple[float, float, float]:
    """One run's step loop wall time: from the second step, and from the third; and its
    median step."""
    out = tmp / f"loop-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "ft_launcher.cli", "--ft-run-dir", str(tmp / out.stem),
           "--nproc-per-node", "2", "--max-restarts", "0"]
    if not snapshots:
        cmd += ["--ft-snapshot-every", "off"]
    elif args.every != "auto":
        cmd += ["--ft-snapshot-every", args.every]
    cmd += [str(STEP), "--mb", str(args.mb), "--steps", str(args.steps), "--work", str(work),
            "--size", str(args.size), "--device", args.device, "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True,
                         timeout=60 + args.steps * args.step_s * 10)
    if res.returncode != 0:
        raise RunFailed("\n".join((res.stdout + res.stderr).splitlines()[-30:]))
    steps = json.loads(out.read_text())["step_s"]
    return sum(steps[1:]), sum(steps[2:]), statistics.median(steps[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--every", default="auto",
                    help="the with-run's --ft-snapshot-every [auto: the launcher's default]")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", type=Path, default=HERE / "snapshot_overhead.json")
    args = ap.parse_args(argv)
    # On a GPU, small matmuls would time kernel launches rather than compute.
    args.size = 4096 if args.device == "cuda" else 256
    machine = machine_info()
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    work = calibrate(args.step_s, args.device, args.size)
    pairs: list[dict[str, Any]] = []
    failures: list[str] = []  # a failed run is kept, and its pair run again
    with tempfile.TemporaryDirectory(prefix="ft-snap-overhead-") as tmp:
        for i in range(args.pairs * 2):
            if len(pairs) == args.pairs:
                break
            order = [False, True] if i % 2 == 0 else [True, False]
            try:
                loop = {snap: run_once(work, args, snap, Path(tmp)) for snap in order}
            except RunFailed as e:
                failures.append(str(e))
                print(f"a run failed:\n{e}", flush=True)
                continue
            (without, without_steady, step), (with_, with_steady, _) = loop[False], loop[True]
            pairs.append({"without_s": round(without, 4), "with_s": round(with_, 4),
                          "step_median_without_s": round(step, 4),
                          "overhead": round(with_ / without - 1, 4),
                          "steady_without_s": round(without_steady, 4),
                          "steady_with_s": round(with_steady, 4),
                          "steady_overhead": round(with_steady / without_steady - 1, 4)})
            print(f"pair {i + 1}: without {without:.2f} s, with {with_:.2f} s, overhead "
                  f"{pairs[-1]['overhead']:+.1%} (steady {pairs[-1]['steady_overhead']:+.1%})",
                  flush=True)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    overheads = [p["overhead"] for p in pairs]
    steady = [p["steady_overhead"] for p in pairs]
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "scripts/bench/snapshot_overhead.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "settings": {"mb_per_rank": args.mb, "ranks": 2, "step_s": args.step_s,
                     "steps": args.steps, "matmul_rounds": work, "device": args.device,
                     "matmul_size": args.size, "every": args.every},
        "pairs": pairs,
        "failed_runs": failures,
        "overhead_median": statistics.median(overheads),
        "steady_overhead_median": statistics.median(steady),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"median overhead {result['overhead_median']:+.1%} over {len(pairs)} pairs "
          f"(min {min(overheads):+.1%}, max {max(overheads):+.1%}); from the third step "
          f"{result['steady_overhead_median']:+.1%} (min {min(steady):+.1%}, "
          f"max {max(steady):+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
