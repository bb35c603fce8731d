"""What snapshots cost a training run, with and without, side by side.

    python scripts/bench/snapshot_overhead.py                       # 1 s steps, 200 MB, 20 pairs
    python scripts/bench/snapshot_overhead.py --every 1 --out /tmp/every1.json
    python scripts/bench/snapshot_overhead.py --step-s 0.1 --pairs 5 --out /tmp/x.json
    python scripts/bench/snapshot_overhead.py --wait-s 0.5 --steps 20 \
        --out scripts/bench/snapshot_overhead_wait.json
    python scripts/bench/snapshot_overhead.py --device cuda --out snapshot_overhead_gpu.json
    python scripts/bench/snapshot_overhead.py --workload ddp --steps 600 --step-s 0.02 \
        --out scripts/bench/snapshot_overhead_ddp.json

Runs ``scripts/bench/snapshot_step.py`` (2 ranks, gloo, ``--mb`` MB of state per rank, a
step of fixed compute calibrated once to about ``--step-s`` seconds; with ``--device cuda``
state and compute on the GPU, which the 2 ranks share on a one-GPU machine) under ``ft_launcher``
in pairs: one run with ``--ft-snapshot-every off``, one with the launcher's default
frequency (or ``--every``'s, e.g. ``1`` for every step), in alternating order. Each run's
figure is the ranks' step loop wall time (first step excluded, so start-up is not counted);
a pair's overhead is with / without - 1. The same is also reported for the steady state,
from the third step on: by then a rank's first slot files have had their memory claimed, a
cost paid once per job. Each run also records the interval the ranks agreed on and the CPU
time rank 0 spent outside its training thread (the slots' claims and the background
commits, beside the agent's own threads): on cores the compute keeps busy that time comes
out of the step, where an idle core would absorb it. ``--wait-s`` makes that much of each
step a sleep after the compute (a GPU step's host thread waiting for the device), the rest
calibrated compute. Medians printed, everything written to ``--out`` as JSON.

``--workload ddp`` runs the project's DDP example instead (``examples/train_ddp.py``, 2
ranks, ``--steps`` steps with ``--step-time`` ``--step-s``, a snapshot offered every step,
a disk checkpoint every 20), and its figure is the launcher's whole wall time, fault-free:
what a user of the example pays for snapshots being on by default.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from bench import machine_info  # noqa: E402

from ft_launcher.rundir import read_events  # noqa: E402

STEP = HERE / "snapshot_step.py"
DDP = HERE.parent.parent / "examples" / "train_ddp.py"


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


@dataclass(frozen=True)
class StepRun:
    """One run of the calibrated step: its loop's wall time from the second step and from
    the third, its median step, rank 0's CPU time outside its training thread, and the
    interval the ranks agreed on (None: none announced)."""

    loop_s: float
    steady_s: float
    step_median_s: float
    background_cpu_s: float
    every: int | None


def run_once(work: int, args: argparse.Namespace, snapshots: bool, tmp: Path) -> StepRun:
    out = tmp / f"loop-{time.monotonic_ns()}.json"
    run_dir = tmp / out.stem
    cmd = launcher(run_dir, args, snapshots) + [
        str(STEP), "--mb", str(args.mb), "--steps", str(args.steps), "--work", str(work),
        "--size", str(args.size), "--device", args.device, "--wait-s", str(args.wait_s),
        "--out", str(out)]
    launch(cmd, timeout=60 + args.steps * args.step_s * 10)
    doc = json.loads(out.read_text())
    steps = doc["step_s"]
    return StepRun(sum(steps[1:]), sum(steps[2:]), statistics.median(steps[1:]),
                   doc["cpu_s"] - doc["main_cpu_s"], agreed_every(run_dir))


def agreed_every(run_dir: Path) -> int | None:
    """The first interval the ranks agreed on, from the run's events."""
    every = [e["every"] for e in read_events(run_dir) if e.get("event") == "snapshot_frequency"]
    return every[0] if every else None


def launch(cmd: list[str], timeout: float) -> None:
    """Run one launcher to its end; RunFailed with its output's tail unless it exits 0."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RunFailed("\n".join((res.stdout + res.stderr).splitlines()[-30:]))


def launcher(run_dir: Path, args: argparse.Namespace, snapshots: bool) -> list[str]:
    cmd = [sys.executable, "-m", "ft_launcher.cli", "--ft-run-dir", str(run_dir),
           "--nproc-per-node", "2", "--max-restarts", "0"]
    if not snapshots:
        return cmd + ["--ft-snapshot-every", "off"]
    return cmd if args.every == "auto" else cmd + ["--ft-snapshot-every", args.every]


def run_ddp_once(args: argparse.Namespace, snapshots: bool, tmp: Path
                 ) -> tuple[float, int | None]:
    """One fault-free run of the DDP example: the launcher's wall time, and the interval
    the ranks agreed on (None: no snapshot_frequency event)."""
    run_dir = tmp / f"ddp-{time.monotonic_ns()}"
    cmd = launcher(run_dir, args, snapshots) + [
        str(DDP), "--steps", str(args.steps), "--step-time", str(args.step_s),
        "--ckpt-dir", str(run_dir / "ckpt")]
    start = time.monotonic()
    launch(cmd, timeout=120 + args.steps * args.step_s * 10)
    return time.monotonic() - start, agreed_every(run_dir)


def compared(without_s: float, with_s: float) -> dict[str, Any]:
    return {"without_s": round(without_s, 4), "with_s": round(with_s, 4),
            "overhead": round(with_s / without_s - 1, 4)}


def ddp_pair(without: tuple[float, int | None], with_: tuple[float, int | None]
             ) -> dict[str, Any]:
    return {**compared(without[0], with_[0]), "every": with_[1]}


def step_pair(without: StepRun, with_: StepRun) -> dict[str, Any]:
    return {**compared(without.loop_s, with_.loop_s),
            "step_median_without_s": round(without.step_median_s, 4),
            "steady_without_s": round(without.steady_s, 4),
            "steady_with_s": round(with_.steady_s, 4),
            "steady_overhead": round(with_.steady_s / without.steady_s - 1, 4),
            "background_cpu_without_s": round(without.background_cpu_s, 4),
            "background_cpu_with_s": round(with_.background_cpu_s, 4),
            "every": with_.every}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--every", default="auto",
                    help="the with-run's --ft-snapshot-every [auto: the launcher's default]")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--wait-s", type=float, default=0.0,
                    help="of each step, a sleep after the compute (a host waiting on a GPU)")
    ap.add_argument("--workload", choices=["steps", "ddp"], default="steps",
                    help="steps: the calibrated step of --mb MB; ddp: examples/train_ddp.py")
    ap.add_argument("--out", type=Path, default=HERE / "snapshot_overhead.json")
    args = ap.parse_args(argv)
    ddp = args.workload == "ddp"
    if not 0 <= args.wait_s < args.step_s:
        ap.error("--wait-s must be at least 0 and less than --step-s")
    # On a GPU, small matmuls would time kernel launches rather than compute.
    args.size = 4096 if args.device == "cuda" else 256
    machine = machine_info()
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    work = 0 if ddp else calibrate(args.step_s - args.wait_s, args.device, args.size)
    pairs: list[dict[str, Any]] = []
    failures: list[str] = []  # a failed run is kept, and its pair run again
    with tempfile.TemporaryDirectory(prefix="ft-snap-overhead-") as tmp:
        for i in range(args.pairs * 2):
            if len(pairs) == args.pairs:
                break
            order = [False, True] if i % 2 == 0 else [True, False]
            try:
                runs = {snap: run_ddp_once(args, snap, Path(tmp)) if ddp
                        else run_once(work, args, snap, Path(tmp)) for snap in order}
            except RunFailed as e:
                failures.append(str(e))
                print(f"a run failed:\n{e}", flush=True)
                continue
            pair = (ddp_pair if ddp else step_pair)(runs[False], runs[True])
            pairs.append(pair)
            steady = "" if ddp else (
                f" (steady {pair['steady_overhead']:+.1%}; every {pair['every']}, rank 0's "
                f"CPU outside its training thread {pair['background_cpu_without_s']:.2f} s "
                f"-> {pair['background_cpu_with_s']:.2f} s)")
            print(f"pair {i + 1}: without {pair['without_s']:.2f} s, with {pair['with_s']:.2f} s, "
                  f"overhead {pair['overhead']:+.1%}{steady}", flush=True)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    overheads = [p["overhead"] for p in pairs]
    settings: dict[str, Any] = (
        {"workload": "ddp_example", "ranks": 2, "steps": args.steps,
         "step_time_s": args.step_s, "every": args.every} if ddp else
        {"mb_per_rank": args.mb, "ranks": 2, "step_s": args.step_s, "steps": args.steps,
         "wait_s": args.wait_s, "matmul_rounds": work, "device": args.device,
         "matmul_size": args.size, "every": args.every})
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "scripts/bench/snapshot_overhead.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "settings": settings,
        "pairs": pairs,
        "failed_runs": failures,
        "overhead_median": statistics.median(overheads),
    }
    line = (f"median overhead {result['overhead_median']:+.1%} over {len(pairs)} pairs "
            f"(min {min(overheads):+.1%}, max {max(overheads):+.1%})")
    if not ddp:
        steady = [p["steady_overhead"] for p in pairs]
        result["steady_overhead_median"] = statistics.median(steady)
        added = [p["background_cpu_with_s"] - p["background_cpu_without_s"] for p in pairs]
        result["background_cpu_added_median_s"] = round(statistics.median(added), 4)
        line += (f"; from the third step {result['steady_overhead_median']:+.1%} "
                 f"(min {min(steady):+.1%}, max {max(steady):+.1%}); rank 0's CPU outside "
                 f"its training thread +{result['background_cpu_added_median_s']:.2f} s")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
