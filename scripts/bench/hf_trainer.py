"""A Hugging Face Trainer under ours, torchrun and NVRx: what each SIGKILL of a rank costs.

    python scripts/bench/hf_trainer.py                   # 5 kills a run, every mode
    python scripts/bench/hf_trainer.py --short           # 2 kills a run: checks the wiring
    python scripts/bench/hf_trainer.py --modes ours,ours-callback --repeat 3

Each run is examples/hf_trainer.py (a tiny GPT-2 on random tokens, 2 CPU ranks, gloo; a
disk checkpoint every 50 steps; ``resume_from_checkpoint`` from the newest) training
without end under one launcher with its defaults. It runs through scripts/bench/hf_worker.py,
whose step clock is a TrainerCallback of the benchmark's own, not ft_agent: to every
launcher the script is the same plain HF script. Modes:

- ours: ft_launcher (this repository) with its defaults;
- torchrun: ``python -m torch.distributed.run --standalone``;
- nvrx: NVRx's ft_launcher 0.4.1 (``python -m nvidia_resiliency_ext.fault_tolerance.launcher``,
  from the test extras, in this environment: the script needs transformers) with
  ``--standalone --ft-enable-nic-monitor false``;
- ours-callback: ours, the script with ``--ft-callback`` (ft_agent.transformers'
  FaultToleranceCallback: a snapshot offered after every step) and the launcher's default
  snapshot frequency (the ranks agree on an interval whose blocking stays under 2 % of a
  step);
- ours-callback-each-step: the same with ``--ft-snapshot-every 1`` (a snapshot of every
  step, whatever it costs).

In each run rank 1 is SIGKILLed ``faults`` times, each time ``settle_s`` seconds after
every rank took its first step of the current cycle (the delays vary, so the kills land at
different distances from the last checkpoint). Per kill: SIGKILL → first step of every rank
of the next cycle (``recovery_s``), SIGKILL → every new worker running (``respawn_s``), and
the steps redone: the last step a rank finished before the kill minus the step the next
cycle resumed from. Per run, the median step time of rank 0 before the first kill (what
the snapshots cost a step). A run that does not recover within the bound ends there.

Writes one JSON file (``--out``; scripts/bench/hf_trainer.json by default, a temporary file
with ``--short``), which ``python -m scripts.docs.render`` renders in docs/benchmarks.md
when it is committed. Every process started is ended by pid.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import compile_ours, machine_info  # noqa: E402
from measures import Launchers  # noqa: E402
from runner import JsonlTail, Run, base_env  # noqa: E402

log = logging.getLogger("bench")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "hf_worker.py"
CALLBACK = "ours-callback"
CALLBACK_EACH_STEP = "ours-callback-each-step"
OURS = ("ours", CALLBACK, CALLBACK_EACH_STEP)
MODES = ("ours", "torchrun", "nvrx", CALLBACK, CALLBACK_EACH_STEP)
NPROC = 2
ENDLESS_STEPS = 10_000_000  # the training that only the driver ends
# The targets for ours with its defaults, and with the callback.
FIRST_KILL_S = 1.5
LATER_KILL_S = 1.0
MAX_REDONE_WITH_CALLBACK = 1


@dataclass
class Settings:
    """How many kills, when, and the bounds of a run."""

    faults: int = 5
    # seconds from every rank's first step of a cycle to the kill, per kill
    settle_s: tuple[float, ...] = (6.0, 8.5, 11.0, 7.0, 9.5)
    save_steps: int = 50
    repeat: int = 1
    start_bound_s: float = 180.0  # launcher start -> every rank's first step
    recovery_bound_s: float = 60.0  # a kill -> every rank's first step of the next cycle


SHORT = Settings(faults=2, settle_s=(4.0, 5.0))


def launcher_argv(mode: str, workdir: Path, s: Settings) -> list[str]:
    """The launcher's command line, its defaults but for the addresses and the restarts."""
    n, restarts = str(NPROC), str(s.faults + 1)
    if mode in OURS:
        head = [*Launchers.default().ours, "--master-addr", "127.0.0.1", "--nproc-per-node",
                n, "--max-restarts", restarts, "--ft-run-dir", str(workdir / "ft_run")]
        if mode == CALLBACK_EACH_STEP:
            head += ["--ft-snapshot-every", "1"]
    elif mode == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr",
                "127.0.0.1", "--nproc-per-node", n, "--max-restarts", restarts]
    elif mode == "nvrx":
        head = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher",
                "--standalone", "--local-addr", "127.0.0.1", "--nproc-per-node", n,
                "--max-restarts", restarts, "--ft-enable-nic-monitor", "false"]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    script = [str(WORKER), "--bench-events", str(workdir / "events.jsonl"), "--output-dir",
              str(workdir / "out"), "--max-steps", str(ENDLESS_STEPS), "--save-steps",
              str(s.save_steps)]
    callback = mode in (CALLBACK, CALLBACK_EACH_STEP)
    return [*head, *script, *(["--ft-callback"] if callback else [])]


def _all_started(run: Run, old: set[int], bound_s: float) -> bool:
    """Wait until every rank took a first step in a process not in ``old``."""
    return run.wait(lambda: len(run.first_steps(old)) >= NPROC, bound_s)


def _last_step_before(run: Run, t: float, pids: set[int]) -> int | None:
    steps = [r["step"] for r in run.events("step") if r["pid"] in pids and r["t"] <= t]
    return max(steps) if steps else None


def _step_s(run: Run, pid: int) -> float | None:
    """The median time between two steps of one worker."""
    ts = [r["t"] for r in run.events("step") if r["pid"] == pid]
    gaps = [b - a for a, b in itertools.pairwise(ts)]
    return round(statistics.median(gaps), 5) if gaps else None


def _warm_flags(workdir: Path) -> dict[int, list[bool]]:
    """cycle -> ``warm`` of ours' workers_started (empty for the others)."""
    out: dict[int, list[bool]] = {}
    for r in JsonlTail(workdir / "ft_run" / "events.jsonl").read():
        if r.get("event") == "workers_started":
            out[int(r["cycle"])] = [bool(x) for x in r.get("warm", [])]
    return out


def one_run(mode: str, root: Path, tag: str, s: Settings) -> tuple[dict[str, Any], list[int]]:
    """One launcher, ``s.faults`` kills; (its figures, pids left alive after its stop)."""
    workdir = root / tag
    env = {**base_env(workdir), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = Run(name=tag, argv=launcher_argv(mode, workdir, s), workdir=workdir, env=env)
    faults: list[dict[str, Any]] = []
    out: dict[str, Any] = {"faults": faults}
    with run:
        if not _all_started(run, set(), s.start_bound_s):
            out["note"] = (f"not every rank took a first step within {s.start_bound_s:.0f} s "
                           f"(exit {run.exit_code})")
            return out, run.leftovers()
        out["startup_s"] = round(max(r["t"] for r in run.first_steps().values())
                                 - run.t_start, 3)
        old: set[int] = set()
        for i in range(s.faults):
            # every rank's first step of this cycle, then the settle time
            cycle_start = max(r["t"] for r in run.first_steps(old).values())
            run.sleep_until(cycle_start + s.settle_s[i % len(s.settle_s)])
            old = run.worker_pids()
            if i == 0:
                out["step_s"] = _step_s(run, run.pid_of(0))
            t_kill = run.signal_worker(run.pid_of(1), signal.SIGKILL)
            done = _last_step_before(run, t_kill, old)
            if not _all_started(run, old, s.recovery_bound_s):
                faults.append({"recovery_s": None, "killed_after_step": done,
                               "note": f"not recovered within {s.recovery_bound_s:.0f} s "
                                       f"(launcher exit {run.exit_code})"})
                break
            firsts = run.first_steps(old)
            resumed = min(r["step"] for r in firsts.values()) - 1
            spawned = [r["t"] for r in run.events("pid") if r["pid"] not in old]
            faults.append({
                "recovery_s": round(max(r["t"] for r in firsts.values()) - t_kill, 4),
                "respawn_s": round(max(spawned) - t_kill, 4) if spawned else None,
                "killed_after_step": done, "resumed_from": resumed,
                "redone": None if done is None else done - resumed})
    if mode in OURS:
        warm = _warm_flags(workdir)
        for i, fault in enumerate(faults):
            fault["warm"] = warm.get(i + 1)
    return out, run.leftovers()


def _values(runs: list[dict[str, Any]], key: str, kills: slice) -> list[Any]:
    return [f.get(key) for r in runs for f in r["faults"][kills]]


def _spread(values: list[Any]) -> dict[str, Any] | None:
    nums = [v for v in values if isinstance(v, (int, float))]
    if not nums:
        return None
    return {"median": round(statistics.median(nums), 4), "min": min(nums), "max": max(nums),
            "n": len(nums), "of": len(values)}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: the first kill's recovery, the later kills', the steps redone and the
    step time before the first kill."""
    return {mode: {"first_recovery_s": _spread(_values(rs, "recovery_s", slice(0, 1))),
                   "later_recovery_s": _spread(_values(rs, "recovery_s", slice(1, None))),
                   "redone": _spread(_values(rs, "redone", slice(None))),
                   "step_s": _spread([r.get("step_s") for r in rs])}
            for mode, rs in runs.items()}


def targets(runs: dict[str, list[dict[str, Any]]], faults: int) -> list[dict[str, Any]]:
    """The targets ours is judged against, each with its figures and whether it is met
    (None where the run did not give the figures)."""
    ours, callback = runs.get("ours", []), runs.get(CALLBACK_EACH_STEP, [])

    def judged(what: str, values: list[Any], limit: float, expected: int) -> dict[str, Any]:
        met = None
        if values and len(values) == expected:
            met = all(isinstance(v, (int, float)) and v <= limit for v in values)
        return {"target": what, "values": values, "met": met}

    out = []
    if ours:
        out.append(judged(f"ours, defaults: SIGKILL → first step of every rank ≤ "
                          f"{FIRST_KILL_S:g} s for the first kill",
                          _values(ours, "recovery_s", slice(0, 1)), FIRST_KILL_S, len(ours)))
        out.append(judged(f"ours, defaults: SIGKILL → first step of every rank ≤ "
                          f"{LATER_KILL_S:g} s for every kill from the second on",
                          _values(ours, "recovery_s", slice(1, None)), LATER_KILL_S,
                          len(ours) * (faults - 1)))
    if callback:
        out.append(judged(f"ours with the callback, a snapshot of every step: ≤ "
                          f"{MAX_REDONE_WITH_CALLBACK} step redone per kill",
                          _values(callback, "redone", slice(None)),
                          MAX_REDONE_WITH_CALLBACK, len(callback) * faults))
    return out


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "transformers", "accelerate", "nvidia-resiliency-ext"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def method(s: Settings) -> list[str]:
    return [
        f"Training: examples/hf_trainer.py through scripts/bench/hf_worker.py, {NPROC} CPU "
        f"ranks (gloo), a disk checkpoint every {s.save_steps} steps (save_total_limit 2), "
        "resume_from_checkpoint from the newest; the step clock is the benchmark's own "
        "TrainerCallback (an O_APPEND line per step), not ft_agent.",
        "Launchers, their defaults but for the addresses and --max-restarts: ours = "
        "ft_launcher --master-addr 127.0.0.1; torchrun = python -m torch.distributed.run "
        "--standalone --local-addr 127.0.0.1; nvrx = python -m "
        "nvidia_resiliency_ext.fault_tolerance.launcher --standalone --local-addr 127.0.0.1 "
        "--ft-enable-nic-monitor false (NVRx from the test extras, in the same environment); "
        "ours-callback = ours, the script with --ft-callback (snapshots at the frequency "
        "the ranks agree on: blocking under 2 % of a step); ours-callback-each-step = the "
        "same with --ft-snapshot-every 1.",
        f"Kills: rank 1 SIGKILLed {s.faults} times a run by the driver (by pid), each "
        f"settle_s after every rank's first step of the current cycle (settle_s = "
        f"{', '.join(f'{x:g}' for x in s.settle_s)} s, in turn). recovery_s = the latest "
        "first step among the next cycle's ranks − the kill; respawn_s = the latest new "
        "worker's start (its first line, before its imports) − the kill; redone = the last "
        "step a rank finished before the kill − the step the next cycle resumed from; step "
        "= the median time between two steps of rank 0 before the first kill. A kill "
        f"not recovered within {s.recovery_bound_s:g} s ends the run.",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of {','.join(MODES)} [all]")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode, interleaved [1]")
    p.add_argument("--short", action="store_true", help=f"{SHORT.faults} kills a run")
    p.add_argument("--out", default=None, help="the JSON result [scripts/bench/hf_trainer.json; "
                   "--short: a temporary file]")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[bench %(asctime)s] %(message)s")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"error: --modes: expected a subset of {','.join(MODES)}, "
                         f"got {args.modes!r}")
    if args.repeat < 1:
        raise SystemExit(f"error: --repeat: expected a positive count, got {args.repeat}")
    s = dataclasses.replace(SHORT if args.short else Settings(), repeat=args.repeat)
    out = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "hf_trainer_short.json" if args.short
        else HERE / "hf_trainer.json")
    machine = machine_info()
    compile_ours()
    root = Path(tempfile.mkdtemp(prefix="fth-"))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    leftovers: list[str] = []
    t0 = time.monotonic()
    try:
        for i in range(s.repeat):
            order = modes[i % len(modes):] + modes[:i % len(modes)]  # who goes first rotates
            for mode in order:
                tag = f"{mode}-{i}"
                result, left = one_run(mode, root, tag, s)
                if left:
                    leftovers.append(f"{tag}: {left}")
                log.info("%s: %s", tag, json.dumps(result))
                runs[mode].append(result)
    finally:
        if args.keep_runs:
            log.info("run directories kept in %s", root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    doc = {
        "version": 1,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {**machine, "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "command": shlex.join(["python", "scripts/bench/hf_trainer.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "profile": "short" if args.short else "full",
        "settings": dataclasses.asdict(s),
        "modes": modes,
        "versions": _versions(),
        "duration_s": round(time.monotonic() - t0, 1),
        "runs": runs,
        "summary": summarize(runs),
        "targets": targets(runs, s.faults),
        "leftover_processes": leftovers,
        "method": method(s),
    }
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    log.info("wrote %s", out)
    print(json.dumps({"summary": doc["summary"], "targets": doc["targets"]}, indent=1,
                     ensure_ascii=False))
    if leftovers:
        log.error("processes left behind: %s", leftovers)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
