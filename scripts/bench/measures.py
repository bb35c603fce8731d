"""The six measures. Each function runs one launcher once and returns its figures.

A figure that could not be taken is None, with the reason in ``note`` (for example torchrun
never detecting a hang within the bound). Times are wall-clock differences between unix
timestamps written by the workload, the launchers' own records, or the driver just before
it sent a signal; all on this machine, so one clock.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from nodes_run import NodesRun
from runner import JsonlTail, LineTail, Run, base_env, process_status

log = logging.getLogger("bench")

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "workload.py"
HB_TIMEOUT_S = 2.0  # --ft-rank-heartbeat-timeout for ours and NVRx
INITIAL_TIMEOUT_S = 120.0  # spawn -> first heartbeat: covers torch imports on a busy machine
# ours = ft_launcher with its defaults: warm restart on (the zygote's forks start every cycle)
WARM = "ours-warm"  # ours with --ft-warm-restart: standby interpreters take over on a restart
COLD = "ours-cold"  # ours with --no-ft-warm-restart: every worker a fresh interpreter
STORE = "ours-store"  # cold, with --ft-agent-store: a store-only zygote hosts each cycle's store
# ours with its defaults plus in-memory snapshots (--ft-snapshot-every, Settings.snapshot_every);
# its workload offers a snapshot each step and resumes from one before the disk checkpoint
SNAP = "ours-snap"
# The compiled measure: ours with its defaults alone (no heartbeat options), the workload
# without a client (a torchrun script), eager or under torch.compile (the workload's --compile)
EAGER = "ours-eager"
COMPILED = "ours-compiled"
PLAIN = (EAGER, COMPILED)
OURS = ("ours", WARM, STORE, COLD, SNAP, *PLAIN)
# DDP imports torch._dynamo when it is built (~1.4 s here): preloading it too is what makes a
# warm DDP worker reach its first step quickly.
WARM_PRELOAD = "torch,torch._dynamo"
# NVRx's rank monitors log "FT timeout elapsed." when they judge a rank hung, with the
# logging module's default asctime (local time, milliseconds) in brackets.
NVRX_VERDICT = "FT timeout elapsed."
NVRX_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"


@dataclass
class Settings:
    """Counts, sizes and bounds of one benchmark run (full, --quick or --smoke)."""

    repeat: int = 5
    hb_calls: int = 10_000
    nproc: int = 2
    step_time: float = 0.02
    settle_s: float = 1.0  # steady training before a fault is injected
    start_bound_s: float = 120.0  # launcher start -> first step of every rank
    hang_bound_s: float = 20.0  # how long a launcher gets to notice a SIGSTOPped rank
    crash_bound_s: float = 60.0  # SIGKILL -> first step of every rank of the next cycle
    footprint_ranks: int = 8
    footprint_hz: float = 10.0
    footprint_window_s: float = 10.0
    # goodput and start-up: a fixed training, long enough that ours-warm's standbys (ready
    # ~4-5 s after a cycle's first step here) are up before each of its two faults
    train_steps: int = 450
    ckpt_every: int = 25
    fault_after_s: float = 1.5  # goodput: kill (cycle 0) and hang (cycle 1) this long
    # after the cycle's first step
    # goodput on a fixed schedule instead: the kill and the hang this many seconds after
    # cycle 0's first step (empty: fault_after_s after each cycle's first step)
    fault_at_s: tuple[float, ...] = ()
    goodput_bound_s: float = 50.0  # wall-clock limit of a run under faults
    light: bool = False  # smoke only: the training without torch (workload.py --light)
    warm_preload: str = WARM_PRELOAD  # ours-warm's --ft-preload
    ours_preload: str | None = None  # ours' --ft-preload (None: the launcher's default)
    standby_bound_s: float = 30.0  # ours-warm: how long a fault waits for ready standbys
    state_mb: int = 0  # the training's extra state per rank, in checkpoints and snapshots
    snapshot_every: str = "1"  # ours-snap's --ft-snapshot-every
    # > 1: each run is that many launchers on loopback (nproc // nodes ranks each, c10d)
    # and a spare (nodes_run.py); goodput's third fault then loses a node
    nodes: int = 1
    hb_timeout_s: float = HB_TIMEOUT_S  # the goodput runs' --ft-rank-heartbeat-timeout
    # compiled: the two SIGKILLs, this long after the first step of every rank of cycle 0
    compiled_kills_s: tuple[float, float] = (2.0, 60.0)


@dataclass
class Launchers:
    """How to start each launcher; NVRx's path is known once its venv exists."""

    ours: list[str]
    nvrx: list[str] | None = None

    @staticmethod
    def default() -> Launchers:
        script = Path(sys.executable).with_name("ft_launcher")
        ours = [str(script)] if script.exists() else [sys.executable, "-m", "ft_launcher.cli"]
        return Launchers(ours=ours)

    def argv(self, name: str, nproc: int, max_restarts: int, workdir: Path,
             workload_args: list[str], preload: str = WARM_PRELOAD,
             ours_preload: str | None = None, snapshot_every: str = "1",
             rdzv: list[str] | None = None, hb_timeout_s: float = HB_TIMEOUT_S
             ) -> list[str]:
        """The launcher's command line with the workload and the client that goes with it
        (``preload``: what ours-warm's standbys import; ``ours_preload``: ours', when not
        the launcher's default; ``snapshot_every``: ours-snap's --ft-snapshot-every;
        ``rdzv``: one node's rendezvous options instead of a standalone job, and then
        ours-snap keeps a replica of each snapshot on another node; ``hb_timeout_s``: the
        heartbeat timeout of ours and NVRx)."""
        n, r = str(nproc), str(max_restarts)
        hb, init = str(hb_timeout_s), str(INITIAL_TIMEOUT_S)
        standalone = ["--standalone", "--local-addr", "127.0.0.1"]
        if name in PLAIN:
            head = [*self.ours, "--master-addr", "127.0.0.1", "--nproc-per-node", n,
                    "--max-restarts", r, "--ft-run-dir", str(workdir / "ft_run")]
            client = "none"
            if name == COMPILED:
                workload_args = [*workload_args, "--compile"]
        elif name in OURS:
            head = [*self.ours, *(rdzv or ["--master-addr", "127.0.0.1"]),
                    "--nproc-per-node", n, "--max-restarts", r,
                    "--ft-run-dir", str(workdir / "ft_run"),
                    "--ft-rank-heartbeat-timeout", hb, "--ft-initial-rank-heartbeat-timeout",
                    init]
            if name == WARM:
                head += ["--ft-warm-restart", "--ft-preload", preload]
            if name in ("ours", SNAP) and ours_preload is not None:
                head += ["--ft-preload", ours_preload]
            if name == SNAP:
                head += ["--ft-snapshot-every", snapshot_every]
                if rdzv:
                    head += ["--ft-snapshot-replicas", "1"]
                workload_args = [*workload_args, "--snapshots"]
            if name in (COLD, STORE):
                head += ["--no-ft-warm-restart"]
            if name == STORE:
                head += ["--ft-agent-store"]
            client = "ours"
        elif name == "torchrun":
            head = [sys.executable, "-m", "torch.distributed.run", *(rdzv or standalone),
                    "--nproc-per-node", n, "--max-restarts", r]
            client = "none"
        elif name == "nvrx":
            assert self.nvrx is not None, "NVRx venv not prepared"
            head = [*self.nvrx, *(rdzv or standalone), "--nproc-per-node", n, "--max-restarts", r,
                    "--ft-rank-heartbeat-timeout", hb,
                    "--ft-initial-rank-heartbeat-timeout", init,
                    "--ft-enable-nic-monitor", "false",
                    # NVRx's client accepts only the sections its config names: the
                    # heartbeat measure times "compute" open+close pairs.
                    "--ft-rank-section-timeouts", "compute:60"]
            client = "nvrx"
        else:
            raise ValueError(f"unknown launcher {name!r}")
        events = str(workdir / "events.jsonl")
        return [*head, str(WORKLOAD), "--events", events, "--client", client, *workload_args]


@dataclass
class Context:
    """What every measure needs: launchers, settings, and where runs keep their files."""

    launchers: Launchers
    settings: Settings
    root: Path  # a fresh directory per run is made under it
    runs: list[Run] = field(default_factory=list)  # every run started, for the cleanup check

    def run(self, tag: str, launcher: str, nproc: int, max_restarts: int,
            workload_args: list[str]) -> Run:
        workdir = self.root / tag
        s = self.settings

        def argv(node_dir: Path, rdzv: list[str] | None = None) -> list[str]:
            return self.launchers.argv(launcher, nproc // s.nodes, max_restarts, node_dir,
                                       workload_args, preload=s.warm_preload,
                                       ours_preload=s.ours_preload,
                                       snapshot_every=s.snapshot_every, rdzv=rdzv,
                                       hb_timeout_s=s.hb_timeout_s)
        if s.nodes > 1:
            run: Run = NodesRun(name=tag, argv=[], workdir=workdir, env={}, argv_for=argv,
                                nodes=s.nodes, world=nproc)
        else:
            run = Run(name=tag, argv=argv(workdir), workdir=workdir, env=base_env(workdir))
        self.runs.append(run)
        return run

    def train_args(self, steps: int, ckpt_dir: Path | None = None) -> list[str]:
        s = self.settings
        args = ["--mode", "train", "--steps", str(steps), "--step-time", str(s.step_time),
                "--ckpt-every", str(s.ckpt_every)]
        if ckpt_dir is not None:
            args += ["--ckpt-dir", str(ckpt_dir)]
        if s.state_mb:
            args += ["--state-mb", str(s.state_mb)]
        if s.light:
            args.append("--light")
        return args


Result = dict[str, Any]
ENDLESS_STEPS = 10_000_000  # a training that only a fault ends


def _all_started(run: Run, nproc: int, exclude: set[int] | frozenset[int] = frozenset()
                 ) -> bool:
    return len(run.first_steps(exclude)) >= nproc


def _start_and_wait(run: Run, ctx: Context, nproc: int) -> Result | None:
    """Wait for every rank's first step; a failure note when it never comes."""
    if not run.wait(lambda: _all_started(run, nproc), ctx.settings.start_bound_s):
        return {"note": f"not every rank reached its first step within "
                        f"{ctx.settings.start_bound_s:.0f} s (exit code {run.exit_code})"}
    return None


# -- 1. heartbeat cost ----------------------------------------------------------------


def heartbeat(ctx: Context, launcher: str, tag: str) -> Result:
    """µs per send_heartbeat() in one worker, ``hb_calls`` calls after a warm-up, each
    sent (``fold_``: back to back as ours folds them); then µs per section open+close pair,
    as many (when the launcher's client has sections)."""
    args = ["--mode", "heartbeat", "--calls", str(ctx.settings.hb_calls)]
    with ctx.run(tag, launcher, 1, 0, args) as run:
        run.wait(lambda: bool(run.events("hb_stats")), ctx.settings.start_bound_s + 60)
    stats = run.events("hb_stats")
    if not stats:
        return {"p50_us": None, "p99_us": None, "note": f"no hb_stats (exit {run.exit_code})"}
    s = stats[0]
    out = {"p50_us": s["p50_us"], "p99_us": s["p99_us"], "mean_us": s["mean_us"]}
    # One start_section + end_section pair, timed in the same run after the heartbeats.
    for key in ("fold_p50_us", "fold_p99_us", "sec_p50_us", "sec_p99_us", "section_note"):
        if key in s:
            out[key] = s[key]
    return out


# -- 2. hang detection ----------------------------------------------------------------


def hang(ctx: Context, launcher: str, tag: str) -> Result:
    """SIGSTOP rank 1 during training; time from the signal to the launcher's verdict."""
    s = ctx.settings
    bound = HB_TIMEOUT_S + s.hang_bound_s if launcher != "torchrun" else s.hang_bound_s
    with ctx.run(tag, launcher, s.nproc, 0, ctx.train_args(ENDLESS_STEPS)) as run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"detect_s": None, "excess_ms": None, **failed}
        run.sleep_until(time.time() + s.settle_s)
        victim = run.pid_of(1)
        t_sig = run.signal_worker(victim, signal.SIGSTOP)
        read_verdict = _verdict_reader(launcher, run, t_sig)
        verdict: Verdict | None = None

        def decided() -> bool:
            nonlocal verdict
            verdict = read_verdict()
            return verdict is not None

        run.wait(decided, bound)
        victim_state = process_status(victim)
    if verdict is None:
        state = "still stopped" if victim_state == psutil.STATUS_STOPPED else \
            f"victim {victim_state or 'gone'}"
        return {"detect_s": None, "excess_ms": None,
                "note": f"not detected within {bound:.0f} s ({state})"}
    detect = verdict.t - t_sig
    out = {"detect_s": round(detect, 4), "excess_ms": round((detect - HB_TIMEOUT_S) * 1000, 1)}
    if verdict.silence_s is not None:
        out["lag_ms"] = round((verdict.silence_s - HB_TIMEOUT_S) * 1000, 1)
    return out


@dataclass
class Verdict:
    """When a launcher judged a rank hung and, where it records it, how long the rank had
    been silent by then (so the lag past the timeout needs no guess at the last heartbeat)."""

    t: float
    silence_s: float | None = None


def _verdict_reader(launcher: str, run: Run, t_sig: float) -> Callable[[], Verdict | None]:
    """A callable returning the verdict once the launcher recorded one."""
    found: list[Verdict] = []
    if launcher in OURS:
        tail = JsonlTail(run.workdir / "ft_run" / "events.jsonl")

        def ours() -> Verdict | None:
            # detected_at: the verdict itself; the event is written once the stacks are in.
            found.extend(Verdict(r.get("detected_at", r["ts"]), r.get("silence_s"))
                         for r in tail.read() if r.get("event") == "hang_detected")
            return found[0] if found else None

        return ours
    if launcher == "nvrx":
        lines = LineTail(run.log_path)

        def nvrx() -> Verdict | None:
            for line in lines.read():
                t = _nvrx_log_time(line) if NVRX_VERDICT in line else None
                if t is not None and t >= t_sig - 0.01:
                    found.append(Verdict(t))
            return found[0] if found else None

        return nvrx
    return lambda: None  # torchrun has no hang detection


def _nvrx_log_time(line: str) -> float | None:
    """Unix time of an NVRx log line ``[2026-11-29 10:05:48,193] [WARNING] ...``."""
    if not line.startswith("["):
        return None
    stamp = line[1:line.find("]")]
    try:
        return datetime.strptime(stamp, NVRX_TIME_FORMAT).timestamp()
    except ValueError:
        return None


# -- 2b. verdict latency from the last heartbeat call ---------------------------------

MARK_POLL_S = 0.0005  # how often the driver reads the victim's heartbeat mark


def read_mark(path: Path) -> tuple[int, float, float] | None:
    """(calls, last call's unix time, its return's) from a workload's --hb-mark file; None
    while there is none or the line is torn (being rewritten)."""
    try:
        parts = path.read_text().split()
        return int(parts[0]), float(parts[1]), float(parts[2])
    except (OSError, ValueError, IndexError):
        return None


def _stop_after_a_heartbeat(run: Run, mark: Path, victim: int, bound_s: float
                            ) -> tuple[tuple[int, float, float], float] | None:
    """SIGSTOP ``victim`` as soon as a new heartbeat call of it has returned (its mark
    changed); (that mark, the signal's time), or None when none came within ``bound_s``."""
    seen = read_mark(mark)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        now = read_mark(mark)
        if now is not None and (seen is None or now[0] > seen[0]):
            return now, run.signal_worker(victim, signal.SIGSTOP)
        time.sleep(MARK_POLL_S)
    return None


def verdict(ctx: Context, launcher: str, tag: str) -> Result:
    """SIGSTOP rank 1 right after a send_heartbeat() call returned; the verdict's time
    minus (that call + the timeout): what the launcher adds to the timeout itself."""
    s = ctx.settings
    bound = HB_TIMEOUT_S + s.hang_bound_s
    mark = ctx.root / tag / "hb_mark_{rank}"
    args = [*ctx.train_args(ENDLESS_STEPS), "--hb-mark", str(mark)]
    with ctx.run(tag, launcher, s.nproc, 0, args) as run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"excess_ms": None, **failed}
        run.sleep_until(time.time() + s.settle_s)
        victim, path = run.pid_of(1), Path(str(mark).replace("{rank}", "1"))
        stopped = _stop_after_a_heartbeat(run, path, victim, s.settle_s + 5.0)
        if stopped is None:
            return {"excess_ms": None, "note": "rank 1 wrote no heartbeat mark"}
        seen, t_sig = stopped
        # Read before the verdict: the launcher continues the rank to end it, and it may
        # heartbeat again then. A write in flight when the stop landed is done by now.
        run.sleep_until(t_sig + 0.05)
        last = read_mark(path) or seen
        read_verdict = _verdict_reader(launcher, run, t_sig)
        run.wait(lambda: read_verdict() is not None, bound)
        got = read_verdict()
    if got is None:
        return {"excess_ms": None, "note": f"not detected within {bound:.0f} s"}
    t = got.t
    return {"excess_ms": round((t - last[1] - HB_TIMEOUT_S) * 1000, 1),
            "after_return_ms": round((t - last[2] - HB_TIMEOUT_S) * 1000, 1),
            "stop_after_return_ms": round((t_sig - seen[2]) * 1000, 2),
            "late_stop": last[0] != seen[0],  # a later call slipped in before the stop
            "detect_s": round(t - t_sig, 4)}


# -- 3. crash recovery ----------------------------------------------------------------


def crash(ctx: Context, launcher: str, tag: str) -> Result:
    """SIGKILL rank 1; time to the first training step of every rank of the next cycle.

    ours-warm is killed only once every local rank has a ready standby, and its figure
    counts only when the next cycle's ``workers_started`` says every rank started warm."""
    s = ctx.settings
    ft = FtEvents(run_dir_events(ctx, tag)) if launcher == WARM else None
    # ours (the defaults): killed when a user's fault would come; its flags say how it restarted
    flags = FtEvents(run_dir_events(ctx, tag)) if launcher == "ours" else None
    extra: Result = {}
    with ctx.run(tag, launcher, s.nproc, 1, ctx.train_args(ENDLESS_STEPS)) as run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"recovery_s": None, **failed}
        run.sleep_until(time.time() + s.settle_s)
        if ft is not None:
            waited = _wait_standbys(run, ft, s.nproc, s.standby_bound_s)
            if waited is None:
                return {"recovery_s": None, "note": _not_ready(s.standby_bound_s)}
            extra["standby_wait_s"] = waited
            extra.update(_standby_memory(ft.records))
        old = run.worker_pids()
        t_kill = run.signal_worker(run.pid_of(1), signal.SIGKILL)
        if not run.wait(lambda: _all_started(run, s.nproc, old), s.crash_bound_s):
            return {"recovery_s": None, "launcher_exit": run.exit_code,
                    "note": f"not recovered within {s.crash_bound_s:.0f} s", **extra}
        t_first = max(r["t"] for r in run.first_steps(old).values())
        t_spawn = max(r["t"] for r in run.events("pid") if r["pid"] not in old)
        if ft is not None or flags is not None:
            extra["warm"] = _restart_warm_flags(run, ft or flags, 1)  # type: ignore[arg-type]
    out = {"recovery_s": round(t_first - t_kill, 4), "respawn_s": round(t_spawn - t_kill, 4),
           **extra}
    if ft is not None and not _all_warm(extra["warm"]):
        # A cold restart under the warm label would flatter nothing and mislead: keep the
        # figures under other names, out of the table.
        out["cold_recovery_s"] = out.pop("recovery_s")
        out["cold_respawn_s"] = out.pop("respawn_s")
        out.update(recovery_s=None, respawn_s=None,
                   note=f"restart was not warm (warm={extra['warm']})")
    return out


# -- ours-warm: standbys ---------------------------------------------------------------


class FtEvents:
    """Every record of ours' run-directory events.jsonl read so far."""

    def __init__(self, path: Path) -> None:
        self.tail = JsonlTail(path)
        self.records: list[dict[str, Any]] = []

    def refresh(self) -> list[dict[str, Any]]:
        self.records.extend(self.tail.read())
        return self.records


def run_dir_events(ctx: Context, tag: str) -> Path:
    """Where ours' launcher of run ``tag`` writes its events (see Launchers.argv)."""
    return ctx.root / tag / "ft_run" / "events.jsonl"


def ready_standbys(records: list[dict[str, Any]]) -> dict[int, int]:
    """local rank -> pid of its standby that is ready now: reported ``standby_ready`` and
    since then neither taken over as a worker (its pid in a ``workers_started``) nor dead."""
    ready: dict[int, int] = {}
    for r in records:
        event = r.get("event")
        if event == "standby_ready":
            ready[int(r["local_rank"])] = int(r["pid"])
        elif event in ("workers_started", "standby_died", "warm_restart_disabled"):
            gone = set(r.get("pids") or []) | ({r["pid"]} if "pid" in r else set())
            if event == "warm_restart_disabled":
                gone = set(ready.values())
            ready = {lr: pid for lr, pid in ready.items() if pid not in gone}
    return ready


def _wait_standbys(run: Run, ft: FtEvents, nproc: int, bound: float) -> float | None:
    """Wait until every local rank has a ready standby; seconds waited, None on timeout."""
    t0 = time.monotonic()
    if not run.wait(lambda: len(ready_standbys(ft.refresh())) >= nproc, bound):
        return None
    return round(time.monotonic() - t0, 3)


def _standby_memory(records: list[dict[str, Any]]) -> dict[str, float]:
    """RSS and PSS summed over the ready standbys, as their standby_ready events say."""
    ready = set(ready_standbys(records).values())
    found = [r for r in records if r.get("event") == "standby_ready" and r["pid"] in ready]
    return {f"standby_{k}": round(sum(r.get(k) or 0.0 for r in found), 1)
            for k in ("rss_mb", "pss_mb")}


def _not_ready(bound: float) -> str:
    return f"standby not ready within {bound:.0f} s"


def _restart_warm_flags(run: Run, ft: FtEvents, cycle: int) -> list[bool] | None:
    """``warm`` of the launcher's workers_started for ``cycle`` (None if never recorded)."""

    def started() -> list[dict[str, Any]]:
        return [r for r in ft.refresh()
                if r.get("event") == "workers_started" and r.get("cycle") == cycle]

    # The launcher writes it right after spawning, before any worker can take a step; a
    # short bound only covers a slow disk.
    run.wait(lambda: bool(started()), 5.0)
    found = started()
    return [bool(x) for x in found[0].get("warm", [])] if found else None


def _all_warm(flags: list[bool] | None) -> bool:
    return flags is not None and len(flags) > 0 and all(flags)


# -- 4. start-up and the fault-free half of 6. goodput ----------------------------------


def clean(ctx: Context, launcher: str, tag: str) -> Result:
    """The fixed training without faults: start-up time, wall time, and the end (``exit_s``:
    the last rank's "done" record -> the launcher's exit; the workers' own exit is in it)."""
    s = ctx.settings
    workdir = ctx.root / tag
    with ctx.run(tag, launcher, s.nproc, 0, ctx.train_args(s.train_steps, workdir / "ckpt")
                 ) as run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"startup_s": None, "wall_s": None, **failed}
        startup = max(r["t"] for r in run.first_steps().values()) - run.t_start
        spawn = min(r["t"] for r in run.events("pid")) - run.t_start
        exited = run.wait_exit(s.goodput_bound_s)
    done = run.events("done")
    if not exited or run.exit_code != 0 or len(done) < s.nproc:
        return {"startup_s": round(startup, 4), "spawn_s": round(spawn, 4), "wall_s": None,
                "note": f"fault-free run did not finish (exit {run.exit_code}, "
                        f"{len(done)}/{s.nproc} ranks done)"}
    assert run.t_exit is not None
    # one step's wall time, first step to done, and so how often a checkpoint came
    step_s = (max(r["t"] for r in done) - startup - run.t_start) / max(1, s.train_steps - 1)
    return {"startup_s": round(startup, 4), "spawn_s": round(spawn, 4),
            "wall_s": round(run.t_exit - run.t_start, 4),
            "exit_s": round(run.t_exit - max(r["t"] for r in done), 4),
            "step_s": round(step_s, 5), "ckpt_interval_s": round(step_s * s.ckpt_every, 2)}


# -- 6. goodput under faults ----------------------------------------------------------


def faulted(ctx: Context, launcher: str, tag: str) -> Result:
    """The fixed training with a kill in cycle 0 and a hang in cycle 1 (and, on several
    nodes, the loss of a node that does not host the store in cycle 2), bounded in time;
    ``lost``: per fault, the step the victim had reached and where the next cycle resumed.

    ours-warm gets each fault only once every local rank has a ready standby (later than
    planned when the standbys are still importing); a run whose standbys are not
    ready in time, or whose restarts were not all warm, has no goodput figure."""
    s = ctx.settings
    workdir = ctx.root / tag
    bound = s.goodput_bound_s
    steps: list[str] = []
    ft = FtEvents(run_dir_events(ctx, tag)) if launcher == WARM else None
    extra: Result = {}
    mark = workdir / "hb_mark_{rank}"
    args = [*ctx.train_args(s.train_steps, workdir / "ckpt"), "--hb-mark", str(mark)]
    at_fault: list[tuple[int | None, frozenset[int]]] = []  # (victim's step, pids so far)
    with ctx.run(tag, launcher, s.nproc, 3, args) as run:
        deadline = time.monotonic() + bound
        seen: set[int] = set()
        t_zero: float | None = None
        for index, fault in enumerate(FAULTS if s.nodes > 1 else FAULTS[:2]):
            left = deadline - time.monotonic()
            if not run.wait(lambda ex=frozenset(seen): _all_started(run, s.nproc, ex), left):
                break
            t_first = max(r["t"] for r in run.first_steps(frozenset(seen)).values())
            t_zero = t_first if t_zero is None else t_zero
            run.sleep_until(fault_time(s, index, t_zero, t_first))
            if ft is not None:
                left = min(s.standby_bound_s, deadline - time.monotonic())
                waited = _wait_standbys(run, ft, s.nproc, max(0.0, left))
                if waited is None and not run.events("done"):
                    steps.append(f"{fault} not sent: {_not_ready(left)}")
                    return {"wall_s": None, "bounded": [], "faults": steps,
                            "note": _not_ready(left), **extra}
                extra.setdefault("standby_wait_s", []).append(waited)
            seen |= run.worker_pids()
            if len(run.events("done")):
                steps.append(f"{fault} missed: training already done")
                break
            victim = run.pid_off_host() if fault == NODE_LOST else run.pid_of(1)
            at_fault.append((_step_reached(run, mark, victim), frozenset(seen)))
            if fault == NODE_LOST:
                run.lose_node(victim)
            else:
                run.signal_worker(victim, getattr(signal, fault))
            steps.append(fault)
        run.wait_exit(max(0.0, deadline - time.monotonic()))
        if ft is not None:
            sent = [x for x in steps if x in ("SIGKILL", "SIGSTOP")]  # one restart each
            extra["warm"] = [_restart_warm_flags(run, ft, c) for c in range(1, len(sent) + 1)]
    extra["lost"] = [work_lost(run.events("first_step"), step, before)
                     for step, before in at_fault]
    finished = run.exit_code == 0 and len(run.events("done")) >= s.nproc \
        and run.t_exit is not None and run.t_exit - run.t_start <= bound
    if not finished:
        return {"wall_s": bound, "bounded": ["wall_s"], "faults": steps,
                "note": f"did not finish within {bound:.0f} s", **extra}
    assert run.t_exit is not None
    out = {"wall_s": round(run.t_exit - run.t_start, 4), "bounded": [], "faults": steps,
           **extra}
    if ft is not None and not all(_all_warm(f) for f in extra["warm"]):
        out["cold_wall_s"] = out.pop("wall_s")
        out.update(wall_s=None, note=f"a restart was not warm (warm={extra['warm']})")
    return out


NODE_LOST = "node lost"  # SIGKILL of a node that does not host the store, all of it
FAULTS = ("SIGKILL", "SIGSTOP", NODE_LOST)  # goodput's faults, in the order they come


def fault_time(s: Settings, index: int, t_zero: float, t_cycle: float) -> float:
    """When goodput's fault ``index`` (0: the kill, 1: the hang) is sent, in unix time:
    ``fault_at_s[index]`` after cycle 0's first step ``t_zero`` (not before the current
    cycle's first step ``t_cycle``), or, without ``fault_at_s``, ``fault_after_s`` after
    ``t_cycle``."""
    if s.fault_at_s:
        return max(t_cycle, t_zero + s.fault_at_s[index])
    return t_cycle + s.fault_after_s


def _step_reached(run: Run, mark: Path, victim: int) -> int | None:
    """The last step ``victim`` finished: its cycle's first step, plus the heartbeats (one
    a step) its --hb-mark counted after it, less one; None when either is missing."""
    firsts = [r for r in run.events("first_step") if r["pid"] == victim]
    got = read_mark(Path(str(mark).replace("{rank}", str(firsts[0]["rank"])))) \
        if firsts else None
    if got is None or not isinstance(firsts[0].get("step"), int):
        return None
    return firsts[0]["step"] - 1 + got[0]


def work_lost(first_steps: list[dict[str, Any]], reached: int | None,
              before: frozenset[int]) -> dict[str, Any] | None:
    """What one fault cost in steps: the step reached when it came, where the next cycle
    (the earliest first step of a process not in ``before``) resumed and from what, and the
    difference (``redone``); None when either end is unknown (no next cycle)."""
    later = [r for r in first_steps if r.get("pid") not in before
             and isinstance(r.get("step"), int)]
    if reached is None or not later:
        return None
    nxt = min(later, key=lambda r: r["t"])
    resumed = nxt["step"] - 1
    return {"reached": reached, "resumed_from": resumed, "source": nxt.get("source"),
            "redone": reached - resumed}


# -- 5. footprint ---------------------------------------------------------------------


def footprint(ctx: Context, launcher: str, tag: str) -> Result:
    """Launcher-side CPU and memory while ``footprint_ranks`` ranks heartbeat at 10 Hz."""
    s = ctx.settings
    n = s.footprint_ranks
    duration = s.start_bound_s + s.footprint_window_s + 30  # the workers end by themselves
    args = ["--mode", "idle", "--hz", str(s.footprint_hz), "--duration", str(duration)]
    with ctx.run(tag, launcher, n, 0, args) as run:
        if not run.wait(lambda: len(run.events("ready")) >= n, s.start_bound_s):
            return {"cpu_pct": None, "rss_mb": None, "pss_mb": None,
                    "note": f"{len(run.events('ready'))}/{n} ranks ready"}
        run.sleep_until(time.time() + s.settle_s)
        cpu_pct, side = _launcher_cpu(run, s.footprint_window_s)
        rss, pss = _memory(side)
    return {"cpu_pct": cpu_pct, "rss_mb": round(rss / 2**20, 1),
            "pss_mb": round(pss / 2**20, 1), "processes": len(side)}


# -- 6. launcher CPU while ranks train --------------------------------------------------


def training(ctx: Context, launcher: str, tag: str) -> Result:
    """Launcher-side CPU while ``nproc`` ranks train, a heartbeat per step (``cpu_pct``),
    and in a second run with each step in a section as well (``sections_cpu_pct``; clients
    that have sections)."""
    out: Result = {}
    for key, extra in (("", []), ("sections_", ["--sections"])):
        if extra and launcher == "torchrun":
            continue
        out.update({f"{key}{k}": v for k, v in _training_cpu(ctx, launcher, f"{tag}{key}",
                                                              extra).items()})
    return out


def _training_cpu(ctx: Context, launcher: str, tag: str, extra: list[str]) -> Result:
    s = ctx.settings
    with ctx.run(tag, launcher, s.nproc, 0, ctx.train_args(ENDLESS_STEPS) + extra) as run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"cpu_pct": None, **failed}
        run.sleep_until(time.time() + s.settle_s + 1.0)  # past DDP's first-step work
        cpu_pct, _ = _launcher_cpu(run, s.footprint_window_s)
        load = os.getloadavg()[0]
    return {"cpu_pct": cpu_pct, "load": round(load, 2)}


def _launcher_cpu(run: Run, window_s: float) -> tuple[float, list[psutil.Process]]:
    """% of a core the launcher side of ``run`` used over the next ``window_s``, and
    those processes."""
    assert run.proc is not None
    side = _launcher_side(run.proc.pid, run.worker_pids())
    cpu0, t0 = _cpu_seconds(side), time.monotonic()
    time.sleep(window_s)
    cpu1, t1 = _cpu_seconds(side), time.monotonic()
    return round(100 * (cpu1 - cpu0) / (t1 - t0), 2), side


def _launcher_side(launcher_pid: int, workers: set[int]) -> list[psutil.Process]:
    """The launcher and its descendants, less the workers and their descendants."""
    root = psutil.Process(launcher_pid)
    excluded = set(workers)
    for pid in workers:
        try:
            excluded |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            pass
    return [p for p in [root, *root.children(recursive=True)] if p.pid not in excluded]


def _cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _memory(procs: list[psutil.Process]) -> tuple[int, int]:
    rss = pss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss, pss


# -- issue 17: two faults in a row, and what the standbys cost in memory ---------------


def crash_twice(ctx: Context, launcher: str, tag: str, after_s: float = 2.0) -> Result:
    """SIGKILL rank 1 ``after_s`` after every rank's first step, then again ``after_s`` after
    the restarted cycle's first steps: SIGKILL -> first step of every rank, for each fault.

    Unlike ``crash``, nothing waits for standbys: the faults come when a user's would, and
    the launcher's ``workers_started`` tells whether each restart was warm."""
    s = ctx.settings
    ft = FtEvents(run_dir_events(ctx, tag)) if launcher in OURS else None
    out: Result = {}
    with ctx.run(tag, launcher, s.nproc, 2, ctx.train_args(ENDLESS_STEPS)) as run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"first_s": None, "second_s": None, **failed}
        seen: set[int] = set()
        for n, name in ((1, "first"), (2, "second")):
            t_first = max(r["t"] for r in run.first_steps(frozenset(seen)).values())
            run.sleep_until(t_first + after_s)
            seen |= run.worker_pids()
            out[f"{name}_s"] = _kill_rank_1(run, s, frozenset(seen))
            if out[f"{name}_s"] is None:
                out["note"] = f"fault {n} not recovered within {s.crash_bound_s:.0f} s"
                break
            if ft is not None:
                out[f"{name}_warm"] = _restart_warm_flags(run, ft, n)
    out.setdefault("second_s", None)
    return out


def _kill_rank_1(run: Run, s: Settings, old: frozenset[int]) -> float | None:
    """SIGKILL rank 1; seconds to the first step of every rank not among ``old`` (the
    workers before the kill), None when they do not all step within the crash bound."""
    t_kill = run.signal_worker(run.pid_of(1), signal.SIGKILL)
    if not run.wait(lambda: _all_started(run, s.nproc, old), s.crash_bound_s):
        return None
    return round(max(r["t"] for r in run.first_steps(old).values()) - t_kill, 4)


def hang_restart(ctx: Context, launcher: str, tag: str, after_s: float = 2.0) -> Result:
    """SIGSTOP rank 1 ``after_s`` after every rank's first step; the launcher's hang verdict
    (at the heartbeat timeout) -> the first step of every rank of the next cycle, and
    whether that restart was warm (nothing waits for standbys). Ours only: the verdict is
    read from its events."""
    s = ctx.settings
    ft = FtEvents(run_dir_events(ctx, tag))
    with ctx.run(tag, launcher, s.nproc, 1, ctx.train_args(ENDLESS_STEPS)) as run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"after_verdict_s": None, **failed}
        t_first = max(r["t"] for r in run.first_steps(frozenset()).values())
        run.sleep_until(t_first + after_s)
        seen = run.worker_pids()
        t_sig = run.signal_worker(run.pid_of(1), signal.SIGSTOP)
        read_verdict = _verdict_reader(launcher, run, t_sig)
        verdict: Verdict | None = None

        def decided() -> bool:
            nonlocal verdict
            verdict = verdict or read_verdict()
            return verdict is not None and _all_started(run, s.nproc, frozenset(seen))

        if not run.wait(decided, HB_TIMEOUT_S + s.crash_bound_s) or verdict is None:
            return {"after_verdict_s": None, "note": "no verdict and new first steps within "
                                                     f"{HB_TIMEOUT_S + s.crash_bound_s:.0f} s"}
        t_new = max(r["t"] for r in run.first_steps(frozenset(seen)).values())
        return {"detect_s": round(verdict.t - t_sig, 4),
                "after_verdict_s": round(t_new - verdict.t, 4),
                "warm": _restart_warm_flags(run, ft, 1)}


def standby_memory(ctx: Context, launcher: str, tag: str) -> Result:
    """PSS of every standby process (the zygote and its forks, or spawned standbys) with
    ``footprint_ranks`` local ranks, and of those plus the launcher itself, against one
    interpreter that imported the same preloads, measured in the same run (so it shares the
    same libraries' pages)."""
    s = ctx.settings
    n = s.footprint_ranks
    ft = FtEvents(run_dir_events(ctx, tag))
    args = ["--mode", "idle", "--hz", str(s.footprint_hz), "--duration", "600"]
    with ctx.run(tag, launcher, n, 0, args) as run:
        if not run.wait(lambda: len(ready_standbys(ft.refresh())) >= n, s.start_bound_s):
            return {"standbys_pss_mb": None, "note": f"{len(ready_standbys(ft.records))}/{n} "
                    "standbys ready"}
        run.sleep_until(time.time() + s.settle_s)
        pids = list(ready_standbys(ft.refresh()).values())
        pids += [r["pid"] for r in ft.records if r.get("event") == "zygote_ready"]
        procs = [psutil.Process(p) for p in pids]
        reference = psutil.Popen([sys.executable, "-c", "import sys, time; "
                                  "[__import__(m) for m in sys.argv[1].split(',')]; "
                                  "print('ok', flush=True); time.sleep(600)",
                                  s.warm_preload], stdout=subprocess.PIPE)
        try:
            assert reference.stdout is not None
            reference.stdout.readline()
            time.sleep(0.5)
            _, ref_pss = _memory([reference])
            rss, pss = _memory(procs)
            assert run.proc is not None
            _, launcher_pss = _memory([psutil.Process(run.proc.pid)])
        finally:
            reference.kill()
            reference.wait()
    return {"standbys_pss_mb": round(pss / 2**20, 1), "standbys_rss_mb": round(rss / 2**20, 1),
            "one_interpreter_pss_mb": round(ref_pss / 2**20, 1),
            "ratio_to_one": round(pss / ref_pss, 2), "processes": len(procs),
            "launcher_pss_mb": round(launcher_pss / 2**20, 1),
            "with_launcher_ratio_to_one": round((pss + launcher_pss) / ref_pss, 2)}


# -- a compiled training against the same training eager --------------------------------

COMPILER_TMP = "compiler-tmp"  # under the driver's root: TMPDIR of every compiled-measure run


def compiled(ctx: Context, launcher: str, tag: str) -> Result:
    """The same training eager (ours-eager) or under torch.compile (ours-compiled), with the
    launcher's defaults and no client: SIGKILL rank 1 at each of ``compiled_kills_s`` after
    the first step of every rank of cycle 0 (once early, once after a minute); for each,
    SIGKILL → the first step of every rank of the next cycle, and how that restart started
    (``workers_started``'s warm flags) and what the zygote had learned by the kill (the
    modules, the compiler's warm-ups). Nothing waits for standbys or learning.

    Every run has the same TMPDIR, where torch's compiler keeps its caches (compiled
    graphs, kernels, precompiled headers), filled once by ``warm_compiler_caches``: the
    compiled runs start as a rerun of a job on its machine does."""
    s = ctx.settings
    tmp = warm_compiler_caches(ctx)
    ft = FtEvents(run_dir_events(ctx, tag))
    out: Result = {}
    run = ctx.run(tag, launcher, s.nproc, len(s.compiled_kills_s), ctx.train_args(ENDLESS_STEPS))
    run.env["TMPDIR"] = str(tmp)
    with run:
        failed = _start_and_wait(run, ctx, s.nproc)
        if failed:
            return {"early_s": None, "late_s": None, **failed}
        t_first = max(r["t"] for r in run.first_steps().values())
        out["first_step_s"] = round(t_first - run.t_start, 3)
        seen: set[int] = set()
        kills = zip(("early", "late"), s.compiled_kills_s, strict=True)
        for n, (name, after) in enumerate(kills, 1):
            run.sleep_until(t_first + after)
            seen |= run.worker_pids()
            out[f"{name}_learned"] = _learned(ft.refresh())
            out[f"{name}_s"] = _kill_rank_1(run, s, frozenset(seen))
            if out[f"{name}_s"] is None:
                out["note"] = f"fault {n} not recovered within {s.crash_bound_s:.0f} s"
                break
            out[f"{name}_warm"] = _restart_warm_flags(run, ft, n)
    out.setdefault("late_s", None)
    return out


def _learned(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the zygote had learned so far: modules, and the compiler's warm-ups."""
    rounds = [r for r in records if r.get("event") == "preload_learned"]
    return {"modules": sum(int(r.get("count") or 0) for r in rounds),
            "warmed": sorted({w for r in rounds for w in r.get("warmed") or []})}


def warm_compiler_caches(ctx: Context) -> Path:
    """The compiled measure's TMPDIR, its compiler caches filled by one short compiled
    training (untimed) the first time it is asked for."""
    tmp = ctx.root / COMPILER_TMP
    done = tmp / ".warm"
    if done.exists():
        return tmp
    tmp.mkdir(exist_ok=True)
    s = ctx.settings
    run = ctx.run("compiled-caches", COMPILED, s.nproc, 0, ctx.train_args(5))
    run.env["TMPDIR"] = str(tmp)
    with run:
        if not run.wait_exit(s.start_bound_s * 2) or run.exit_code != 0:
            raise RuntimeError(f"the compiler's caches were not filled (exit {run.exit_code})")
    done.touch()
    return tmp
