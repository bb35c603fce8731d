"""A soak of in-memory snapshots: random faults against a deterministic training, then a
bit-for-bit comparison with the same training run without faults.

    python scripts/snapshot_soak.py                          # 30 min, a fault every ~30 s
    python scripts/snapshot_soak.py --minutes 5 --every 20 --out /tmp/soak.json

Runs ``examples/train_ddp.py`` (2 ranks, gloo; the data of a step is a function of the seed
and the step, so a resumed run computes what an uninterrupted one would) once without faults,
then under ``ft_launcher --ft-snapshot-every 1`` for about ``--minutes`` while a fault arrives
every ``--every`` seconds (uniform within ±50 %), picked at random (``--seed``) from:

- ``kill``: SIGKILL of a random rank;
- ``stop``: SIGSTOP of a random rank (the launcher judges it hung after its heartbeat
  timeout and restarts the group).

Then it checks: the final weights (rank 0's last checkpoint) are bit-identical to the
fault-free run's; no process the launcher started is left; the job's snapshot directory in
/dev/shm is gone; the run directory's lock can be taken; the launcher's memory (RSS, sampled
every 2 s) stayed flat. It reports the faults, the restores, and the ledger's attribution
(``summary.json``), to stdout and to ``--out`` as JSON. Exit 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train_ddp.py"
LAUNCHER = [sys.executable, "-m", "ft_launcher.cli"]


def train_args(steps: int) -> list[str]:
    return [str(TRAIN), "--steps", str(steps), "--ckpt-every", "500", "--step-time", "0.05"]


def launch(run_dir: Path, steps: int, snapshots: bool) -> subprocess.Popen:
    flags = ["--ft-run-dir", str(run_dir), "--nproc-per-node", "2", "--max-restarts", "1000",
             "--ft-rank-heartbeat-timeout", "5", "--ft-initial-rank-heartbeat-timeout", "120"]
    if snapshots:
        flags += ["--ft-snapshot-every", "1"]
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")  # noqa: SIM115 - the child's
    return subprocess.Popen([*LAUNCHER, *flags, *train_args(steps)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def ranks_of(launcher: psutil.Process) -> list[psutil.Process]:
    """The launcher's training processes (a warm worker's command line is the cold one's)."""
    found = []
    for p in launcher.children(recursive=True):
        try:
            if str(TRAIN) in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "ckpt" / "ckpt.pt", weights_only=True)["model"]


def inject(kind: str, launcher: psutil.Process, rng: random.Random) -> dict[str, Any] | None:
    ranks = ranks_of(launcher)
    if len(ranks) < 2:
        return None  # between cycles: try again later
    victim = rng.choice(ranks)
    try:
        victim.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    except psutil.Error:
        return None
    return {"t": time.time(), "kind": kind, "pid": victim.pid}


def soak(run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    proc = launch(run_dir, args.steps, snapshots=True)
    launcher = psutil.Process(proc.pid)
    seen: set[int] = set()
    rss: list[float] = []
    faults: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.minutes * 60
    next_fault = time.monotonic() + args.every * rng.uniform(0.5, 1.5)
    while proc.poll() is None:
        try:
            rss.append(launcher.memory_info().rss / 2**20)
            seen.update(p.pid for p in launcher.children(recursive=True))
        except psutil.Error:
            pass
        now = time.monotonic()
        if now >= next_fault and now < deadline:
            fault = inject(rng.choice(args.faults), launcher, rng)
            if fault is not None:
                faults.append(fault)
                next_fault = now + args.every * rng.uniform(0.5, 1.5)
        time.sleep(2)
    return {"exit_code": proc.returncode, "faults": faults, "pids": seen, "rss_mb": rss}


def leftovers(run_dir: Path, pids: set[int], events: list[dict[str, Any]]) -> dict[str, Any]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            continue
    shm = [e["path"] for e in events
           if e["event"] == "snapshots_ready" and os.path.exists(e["path"])]
    fd = os.open(run_dir / "launcher.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock_free = True
    except OSError:
        lock_free = False
    finally:
        os.close(fd)
    return {"processes_left": alive, "shm_left": shm, "lock_free": lock_free}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--every", type=float, default=30, help="mean seconds between faults")
    ap.add_argument("--steps", type=int, default=0,
                    help="training steps [enough for --minutes at about 8 steps/s]")
    ap.add_argument("--faults", default="kill,stop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the run directories under this directory [a temporary one]")
    args = ap.parse_args(argv)
    args.faults = args.faults.split(",")
    args.steps = args.steps or int(args.minutes * 60 * 8)
    with tempfile.TemporaryDirectory(prefix="ft-soak-") as tmp_dir:
        tmp = args.keep or tmp_dir
        ref_dir, soak_dir = Path(tmp) / "reference", Path(tmp) / "soak"
        ref = launch(ref_dir, args.steps, snapshots=False)
        ref.wait()
        started = time.time()
        run = soak(soak_dir, args)
        wall = time.time() - started
        ref_w, soak_w = weights(ref_dir), weights(soak_dir)
        identical = ref_w.keys() == soak_w.keys() and all(
            torch.equal(ref_w[k], soak_w[k]) for k in ref_w)
        ledger = json.loads(subprocess.run(
            [sys.executable, "-m", "ft_launcher.observe.report", "--json", str(soak_dir)],
            check=True, capture_output=True, text=True).stdout).get("ledger", {})
        events = [json.loads(line) for line in (soak_dir / "events.jsonl").open()]
        left = leftovers(soak_dir, run["pids"], events)
    rss = run["rss_mb"]
    result = {
        "command": " ".join(["python", "scripts/snapshot_soak.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "reference_exit_code": ref.returncode, "exit_code": run["exit_code"],
        "wall_s": round(wall, 1), "steps": args.steps, "faults": run["faults"],
        "restores": [e for e in events if e["event"] == "snapshot_restored"],
        "weights_bit_identical": identical,
        "goodput": ledger.get("goodput"), "lost_by_cause_s": ledger.get("lost_by_cause_s"),
        "launcher_rss_mb": {"first": rss[0] if rss else None, "max": max(rss, default=None),
                            "last": rss[-1] if rss else None},
        **left,
    }
    ok = (identical and run["exit_code"] == 0 and ref.returncode == 0
          and not left["processes_left"] and not left["shm_left"] and left["lock_free"])
    result["ok"] = ok
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
