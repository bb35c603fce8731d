"""Learned preloads against today's default preloads, side by side, on the project's DDP example.

    python scripts/bench/learned_preloads.py                   # 20 pairs
    python scripts/bench/learned_preloads.py --pairs 2 --steps 300 --out /tmp/x.json

Runs ``examples/train_ddp.py`` (2 ranks, gloo) under ``ft_launcher`` with its defaults
(warm restart on, learned preloads on) and with ``--no-ft-preload-learn`` (the preloads
alone, as before learning existed), in pairs whose order alternates. Per run: the wall time
from the launcher's start to its exit, and the PSS of the launcher and everything under it
(the zygote, its learner, the standbys, the workers), sampled every ``--sample-s``: the
mean over the run and the peak. A pair's figures are learned / not learned. What the zygote
learned (``preload_learned``: modules, the learner's CPU time) comes from events.jsonl.
Medians printed, everything written to ``--out`` as JSON. Every process started is ended
by pid.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from bench import machine_info  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_ddp.py"
LEARNED, NOT_LEARNED = "learned", "not-learned"
RUN_BOUND_S = 300.0


def tree_pss(root: psutil.Process) -> int | None:
    """PSS in bytes of ``root`` and every process under it (those that vanish while read
    are skipped); None when ``root`` is gone."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            continue
    return total


def one_run(kind: str, steps: int, step_time: float, sample_s: float,
            workdir: Path) -> dict[str, Any]:
    run_dir = workdir / "run"
    argv = [sys.executable, "-m", "ft_launcher.cli", "--ft-run-dir", str(run_dir),
            "--nproc-per-node", "2", *(["--no-ft-preload-learn"] if kind == NOT_LEARNED
                                       else []),
            str(EXAMPLE), "--steps", str(steps), "--step-time", str(step_time),
            "--ckpt-dir", str(workdir / "ckpt")]
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    samples: list[int] = []
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None and time.monotonic() - start < RUN_BOUND_S:
            pss = tree_pss(root)
            if pss:
                samples.append(pss)
            time.sleep(sample_s)
        proc.wait(timeout=max(1.0, RUN_BOUND_S - (time.monotonic() - start)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - start
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
              if line.strip()]
    learned = [e for e in events if e["event"] == "preload_learned"]
    return {
        "exit_code": proc.returncode, "wall_s": round(wall, 3),
        "pss_mean_mb": round(statistics.fmean(samples) / 2**20, 1) if samples else None,
        "pss_peak_mb": round(max(samples) / 2**20, 1) if samples else None,
        "samples": len(samples),
        "learned_modules": sum(len(e.get("modules", [])) for e in learned),
        "learner_cpu_s": round(sum(e.get("cpu_s") or 0.0 for e in learned), 3),
        "refused": sorted({e.get("module") for e in events
                           if e["event"] == "preload_refused"} - {None}),
    }


def ratios(pairs: list[dict[str, dict[str, Any]]], key: str) -> list[float]:
    """learned / not learned per pair, for the pairs where both runs have the figure."""
    out = []
    for pair in pairs:
        a, b = pair[LEARNED].get(key), pair[NOT_LEARNED].get(key)
        if isinstance(a, int | float) and isinstance(b, int | float) and b:
            out.append(round(a / b, 4))
    return out


def summary(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("wall_s", "pss_mean_mb", "pss_peak_mb"):
        r = ratios(pairs, key)
        out[key] = {
            LEARNED: statistics.median(p[LEARNED][key] for p in pairs),
            NOT_LEARNED: statistics.median(p[NOT_LEARNED][key] for p in pairs),
            "ratio_median": round(statistics.median(r), 4) if r else None,
            "ratio_min": min(r) if r else None, "ratio_max": max(r) if r else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--sample-s", type=float, default=0.25)
    p.add_argument("--out", default=str(HERE / "learned_preloads.json"))
    args = p.parse_args(argv)
    doc: dict[str, Any] = {
        "machine": machine_info(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
        "workload": f"examples/train_ddp.py --steps {args.steps} --step-time "
                    f"{args.step_time:g}, 2 ranks, gloo",
        "pairs": [],
    }
    for i in range(args.pairs):
        order = (LEARNED, NOT_LEARNED) if i % 2 == 0 else (NOT_LEARNED, LEARNED)
        pair: dict[str, dict[str, Any]] = {}
        for kind in order:
            with tempfile.TemporaryDirectory(prefix="ft_bench_learn_") as tmp:
                pair[kind] = one_run(kind, args.steps, args.step_time, args.sample_s,
                                     Path(tmp))
        doc["pairs"].append(pair)
        print(f"pair {i}: " + ", ".join(
            f"{k} wall {pair[k]['wall_s']} s pss {pair[k]['pss_mean_mb']} MB "
            f"(exit {pair[k]['exit_code']}, learned {pair[k]['learned_modules']})"
            for k in (LEARNED, NOT_LEARNED)), flush=True)
    doc["summary"] = summary(doc["pairs"])
    doc["failed_runs"] = sum(1 for pair in doc["pairs"] for r in pair.values()
                             if r["exit_code"] != 0)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0 if doc["failed_runs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
