"""A soak of in-memory snapshots: random faults against a deterministic training, then a
bit-for-bit comparison with the same training run without faults.

    python scripts/snapshot_soak.py                          # 30 min, a fault every ~30 s
    python scripts/snapshot_soak.py --minutes 5 --every 20 --out /tmp/soak.json
    python scripts/snapshot_soak.py --nodes 2 --minutes 30 --step-time 0.4   # and a spare

Runs ``examples/train_ddp.py`` (2 ranks, gloo; the data of a step is a function of the seed,
the step and the rank, so a resumed run computes what an uninterrupted one would) once
without faults (one launcher, 2 ranks), then under ``ft_launcher --ft-snapshot-every 1``
for about ``--minutes`` while a fault arrives every ``--every`` seconds (uniform within
±50 %), picked at random (``--seed``, ``--faults``) and injected once the job is whole and
training:

- ``kill``: SIGKILL of a random rank;
- ``stop``: SIGSTOP of a random rank (the launcher judges it hung after its heartbeat
  timeout and restarts the group);
- with ``--nodes 2`` (two launchers on loopback, one rank each, a spare launcher waiting,
  replicas on the other node; ``soak_nodes.py``) also ``freeze`` (SIGSTOP of a launcher and
  every process under it, thawed once the spare took its place) and ``node_kill`` (SIGKILL
  of a launcher, started again as the new spare once the world trains without it).

The launcher looks for a new local snapshot to push to the other node 5 times a second: with
``--nodes 2`` and steps shorter than that (the default ``--step-time``), a node's replica is
usually two steps or more behind, the other rank's two local copies are newer, and after a
node loss the world resumes from an older common copy or from the disk checkpoint (step 0
here). ``--step-time 0.4`` keeps them within a step (as tests/multinode/test_snapshots_nodes.py).

Then it checks: the final weights (rank 0's last checkpoint) are bit-identical to the
fault-free run's; every launcher the soak did not kill exited 0; no process a launcher
started is left; no snapshot area of the job is left in /dev/shm; every run directory's
lock can be taken. It reports the faults (with, for each, the seconds from the fault to
the first step of every rank in the next cycle), the restores, the launchers' memory (RSS,
sampled every 2 s), the ledger's attribution per launcher (``ft_report --json``) and the
goodput against the fault-free run's wall time, to stdout and to ``--out`` as JSON. Exit 0
only when every check holds.
"""

from __future__ import annotations

import argparse
import collections
import datetime
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
from soak_faults import (
    JobState,
    can_inject,
    choose,
    default_faults,
    next_gap,
    parse_faults,
    recovery_times,
)
from soak_nodes import NodeCluster, ranks_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from bench import machine_info  # noqa: E402

TRAIN = ROOT / "examples" / "train_ddp.py"
LAUNCHER = [sys.executable, "-m", "ft_launcher.cli"]
POLL_S = 0.5
SAMPLE_S = 2.0


def train_args(steps: int, step_time: float, ckpt_dir: Path | None = None) -> list[str]:
    extra = ["--ckpt-dir", str(ckpt_dir)] if ckpt_dir else []
    return [str(TRAIN), "--steps", str(steps), "--ckpt-every", "500", "--step-time",
            str(step_time), *extra]


def launch(run_dir: Path, steps: int, snapshots: bool, step_time: float,
           heartbeat_timeout: float = 5.0) -> subprocess.Popen:
    flags = ["--ft-run-dir", str(run_dir), "--nproc-per-node", "2", "--max-restarts", "1000",
             "--ft-rank-heartbeat-timeout", str(heartbeat_timeout),
             "--ft-initial-rank-heartbeat-timeout", "120"]
    if snapshots:
        flags += ["--ft-snapshot-every", "1"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")  # noqa: SIM115 - the child's
    return subprocess.Popen([*LAUNCHER, *flags, *train_args(steps, step_time)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def signal_rank(kind: str, ranks: list[psutil.Process],
                rng: random.Random) -> dict[str, Any] | None:
    victim = rng.choice(ranks)
    t = time.time()
    try:
        victim.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    except psutil.Error:
        return None
    return {"t": t, "kind": kind, "pid": victim.pid}


class SingleJob:
    """One launcher, 2 ranks: the rank faults."""

    def __init__(self, base: Path, args: argparse.Namespace) -> None:
        self.run_dir = base / "soak"
        self.proc = launch(self.run_dir, args.steps, True, args.step_time,
                           args.heartbeat_timeout)
        self.launcher = psutil.Process(self.proc.pid)

    def running(self) -> bool:
        return self.proc.poll() is None

    def launchers(self) -> dict[str, psutil.Process]:
        return {"soak": self.launcher} if self.running() else {}

    def state(self) -> JobState:
        return JobState(ranks_running=len(ranks_of(self.launcher, TRAIN)), world_size=2,
                        world_nodes=1, spares=0)

    def inject(self, kind: str, rng: random.Random) -> dict[str, Any] | None:
        return signal_rank(kind, ranks_of(self.launcher, TRAIN), rng)

    def recover(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def run_dirs(self) -> list[Path]:
        return [self.run_dir]

    def exit_codes(self) -> list[dict[str, Any]]:
        return [{"node": "soak", "pid": self.proc.pid, "exit_code": self.proc.poll(),
                 "killed_by_soak": False}]

    def shm_left(self) -> list[str]:
        events = read_events(self.run_dir)
        return [e["path"] for e in events
                if e["event"] == "snapshots_ready" and os.path.exists(e["path"])]

    def weights_path(self) -> Path:
        return self.run_dir / "ckpt" / "ckpt.pt"


class NodesJob:
    """Two launchers and a spare on loopback (soak_nodes.NodeCluster): every fault."""

    def __init__(self, base: Path, args: argparse.Namespace) -> None:
        self.base = base / "nodes"
        self.cluster = NodeCluster(
            self.base, train_args(args.steps, args.step_time, self.base / "ckpt"), args)
        try:
            self.cluster.start()
        except BaseException:
            self.cluster.close()
            raise

    def running(self) -> bool:
        return self.cluster.running()

    def launchers(self) -> dict[str, psutil.Process]:
        out = {}
        for n in self.cluster.live():
            try:
                out[f"{n.name}:{n.proc.pid}"] = psutil.Process(n.proc.pid)
            except psutil.Error:
                continue
        return out

    def state(self) -> JobState:
        return self.cluster.state(TRAIN)

    def inject(self, kind: str, rng: random.Random) -> dict[str, Any] | None:
        world = self.cluster.world()
        if kind in ("freeze", "node_kill"):
            return self.cluster.inject_node(kind, rng.choice(world))
        ranks = [p for n in world for p in self.cluster.ranks(n, TRAIN)]
        return signal_rank(kind, ranks, rng)

    def recover(self) -> dict[str, Any] | None:
        return self.cluster.recover(TRAIN)

    def close(self) -> None:
        self.cluster.close()

    def run_dirs(self) -> list[Path]:
        return sorted({n.run_dir for n in self.cluster.nodes})

    def exit_codes(self) -> list[dict[str, Any]]:
        return self.cluster.exit_codes()

    def shm_left(self) -> list[str]:
        return self.cluster.shm_left()

    def weights_path(self) -> Path:
        return self.base / "ckpt" / "ckpt.pt"


def soak(job: SingleJob | NodesJob, args: argparse.Namespace) -> dict[str, Any]:
    """Inject faults until ``--minutes`` have passed, then wait for the job's end (bounded:
    three times the planned duration and 10 minutes more)."""
    rng = random.Random(args.seed)
    seen: set[int] = set()
    rss: dict[str, list[float]] = collections.defaultdict(list)
    faults: list[dict[str, Any]] = []
    recoveries: list[dict[str, Any]] = []
    start = time.monotonic()
    deadline, give_up = start + args.minutes * 60, start + args.minutes * 180 + 600
    next_fault, kind = start + next_gap(rng, args.every), None
    next_sample = start
    while job.running() and time.monotonic() < give_up:
        now = time.monotonic()
        if now >= next_sample:
            next_sample = now + SAMPLE_S
            sample(job, seen, rss)
        done = job.recover()
        if done is not None:
            recoveries.append(done)
        if now >= next_fault and now < deadline:
            kind = kind or choose(rng, args.faults)
            if can_inject(kind, job.state(), args.nodes):
                fault = job.inject(kind, rng)
                if fault is not None:
                    faults.append(fault)
                    kind, next_fault = None, now + next_gap(rng, args.every)
        time.sleep(POLL_S)
    timed_out = job.running()
    return {"faults": faults, "recoveries": recoveries, "pids": seen, "rss_mb": rss,
            "timed_out": timed_out}


def sample(job: SingleJob | NodesJob, seen: set[int], rss: dict[str, list[float]]) -> None:
    for name, launcher in job.launchers().items():
        try:
            rss[name].append(round(launcher.memory_info().rss / 2**20, 1))
            seen.update(p.pid for p in launcher.children(recursive=True))
        except psutil.Error:
            continue


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    path = run_dir / "events.jsonl"
    for line in path.open() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def lock_free(run_dir: Path) -> bool:
    fd = os.open(run_dir / "launcher.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def processes_left(pids: set[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            continue
    return sorted(alive)


def ledger(run_dir: Path) -> dict[str, Any]:
    """The run directory's goodput ledger (``ft_report --json``), the figures that matter."""
    res = subprocess.run([sys.executable, "-m", "ft_launcher.observe.report", "--json",
                          str(run_dir)], capture_output=True, text=True, timeout=120)
    try:
        led = json.loads(res.stdout).get("ledger", {})
    except ValueError:
        return {"error": res.stderr[-500:]}
    return {k: led.get(k) for k in ("goodput", "wall_s", "productive_s", "lost_by_cause_s")}


def fault_costs(faults: list[dict[str, Any]], run_dirs: list[Path]) -> None:
    """Adds to each fault ``recovery_s``: fault -> first step of every rank after it."""
    firsts = [(float(e.get("at", e["ts"])), e["rank"]) for d in run_dirs
              for e in read_events(d) if e["event"] == "first_step"]
    for fault, cost in zip(faults, recovery_times([f["t"] for f in faults], firsts, 2),
                           strict=True):
        fault["recovery_s"] = None if cost is None else round(cost, 2)


def report(job: SingleJob | NodesJob, run: dict[str, Any], ref: dict[str, Any],
           args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    soak_w = torch.load(job.weights_path(), weights_only=True)["model"]
    identical = ref["weights"].keys() == soak_w.keys() and all(
        torch.equal(ref["weights"][k], soak_w[k]) for k in soak_w)
    fault_costs(run["faults"], job.run_dirs())
    by_kind = collections.Counter(f["kind"] for f in run["faults"])
    costs = collections.defaultdict(list)
    for f in run["faults"]:
        if f["recovery_s"] is not None:
            costs[f["kind"]].append(f["recovery_s"])
    exits = job.exit_codes()
    return {
        "command": " ".join(["python", "scripts/snapshot_soak.py", *argv]),
        "nodes": args.nodes, "steps": args.steps, "reference_exit_code": ref["exit_code"],
        "reference_wall_s": ref["wall_s"], "wall_s": run["wall_s"],
        "goodput_vs_reference": round(ref["wall_s"] / run["wall_s"], 4),
        "faults_by_kind": dict(by_kind),
        "recovery_s_by_kind": {k: {"median": sorted(v)[len(v) // 2], "max": max(v)}
                               for k, v in costs.items()},
        "faults": run["faults"], "recoveries": run["recoveries"],
        "restores": [{k: e.get(k) for k in ("ts", "cycle", "rank", "iteration", "source")}
                     for d in job.run_dirs() for e in read_events(d)
                     if e["event"] == "snapshot_restored"],
        "weights_bit_identical": identical,
        "ledgers": {d.name: ledger(d) for d in job.run_dirs()},
        "launcher_rss_mb": {name: {"first": v[0], "max": max(v), "last": v[-1]}
                            for name, v in run["rss_mb"].items() if v},
        "launchers": exits, "timed_out": run["timed_out"],
        "processes_left": processes_left(run["pids"]), "shm_left": job.shm_left(),
        "locks_free": {d.name: lock_free(d) for d in job.run_dirs()},
    }


def verdict(result: dict[str, Any]) -> bool:
    return (result["weights_bit_identical"] and result["reference_exit_code"] == 0
            and not result["timed_out"]
            and all(e["exit_code"] == 0 for e in result["launchers"] if not e["killed_by_soak"])
            and not result["processes_left"] and not result["shm_left"]
            and all(result["locks_free"].values()))


def reference(base: Path, steps: int, step_time: float) -> dict[str, Any]:
    started = time.time()
    proc = launch(base / "reference", steps, False, step_time)
    proc.wait()
    return {"exit_code": proc.returncode, "wall_s": round(time.time() - started, 1),
            "weights": torch.load(base / "reference" / "ckpt" / "ckpt.pt", weights_only=True)
            ["model"]}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30, help="how long faults are injected")
    ap.add_argument("--every", type=float, default=30, help="mean seconds between faults")
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                    help="1: one launcher, 2 ranks; 2: two launchers on loopback and a spare")
    ap.add_argument("--step-time", type=float, default=0.05,
                    help="seconds each step sleeps besides its compute (train_ddp.py)")
    ap.add_argument("--rate", type=float, default=None,
                    help="training steps per second, to size --steps [1 / (step time + "
                         "20 ms): 2 ranks on 2 shared CPUs]")
    ap.add_argument("--steps", type=int, default=0, help="training steps [--minutes x --rate]")
    ap.add_argument("--faults", default=None,
                    help="comma-separated, among kill, stop, freeze, node_kill [all that apply]")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0,
                    help="--ft-rank-heartbeat-timeout of the launchers (what a stop costs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the run directories under this directory [a temporary one]")
    args = ap.parse_args(argv)
    try:
        args.faults = parse_faults(args.faults or default_faults(args.nodes), args.nodes)
    except ValueError as exc:
        ap.error(str(exc))
    args.rate = args.rate or 1 / (args.step_time + 0.02)
    args.steps = args.steps or int(args.minutes * 60 * args.rate)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="ft-soak-") as tmp_dir:
        base = args.keep or Path(tmp_dir)
        ref = reference(base, args.steps, args.step_time)
        started = time.time()
        job = SingleJob(base, args) if args.nodes == 1 else NodesJob(base, args)
        try:
            run = soak(job, args)
        finally:
            job.close()
        run["wall_s"] = round(time.time() - started, 1)
        result = report(job, run, ref, args, argv)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {"date": datetime.date.today().isoformat(), "machine": machine, **result,
              "ok": verdict(result)}
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
