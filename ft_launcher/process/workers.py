"""Spawning, watching and stopping one cycle's group of local workers.

Each worker runs in its own session and process group, dies with the launcher
(PDEATHSIG), and its group is registered with the process-group guardian
(``guardian.py``), which SIGKILLs every registered group once the launcher is gone, even
after a SIGKILL. Its merged output is drained by an ``output.OutputPump``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_launcher.process.cold_exit import exit_hook_env
from ft_launcher.process.guardian import Guardian
from ft_launcher.process.output import OutputPump, Sink, open_log

log = logging.getLogger("ft_launcher")

_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux: rely on teardown alone
    _prctl = None


# The launcher's own open-file limit is raised at start (raise_fd_limit); workers get the
# limit the user gave the launcher, as under torchrun.
_worker_nofile: tuple[int, int] | None = None
GUARDIAN = Guardian()
STOP_POLL_S = 0.01  # a teardown checks this often whether its workers have exited


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each connected rank costs the
    monitor a descriptor); returns (old soft, new soft). Workers keep the old one."""
    global _worker_nofile
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            _worker_nofile = (soft, hard)
            return soft, target
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft, soft


def _child_setup(parent_pid: int) -> None:
    # Runs in the child between fork and exec. A worker must never outlive a launcher that
    # was SIGKILLed: the kernel delivers SIGKILL to the child when its parent thread dies.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # parent died before prctl took effect
            os._exit(1)
    if _worker_nofile is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, _worker_nofile)
        except (OSError, ValueError):
            pass


@dataclass
class WorkerSpec:
    """What to start for one local rank."""

    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    echo: bool  # copy output to the launcher's stdout with a rank prefix


@dataclass
class Worker:
    """One running (or finished) worker process."""

    spec: WorkerSpec
    proc: subprocess.Popen
    started_at: float
    exit_code: int | None = None  # negative: killed by that signal (Popen convention)
    _pump: OutputPump | threading.Thread | None = field(default=None, repr=False)
    warm: bool = False  # an activated standby (warm restart), not a fresh spawn
    reported: bool = False  # its exit is on record (events.jsonl)
    # The launcher sent it a terminating signal while it was still running (stop or
    # kill_all): an exit after that may be the launcher's doing; before it, its own.
    signalled: bool = False

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def local_rank(self) -> int:
        return self.spec.local_rank

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    @property
    def output_dropped_bytes(self) -> int:
        """Output bytes its log file could not take (a full disk); they were drained."""
        return getattr(self._pump, "dropped_bytes", 0)

    def describe_exit(self) -> dict[str, object]:
        """{"exit_code": N, "signal": None} or {"exit_code": None, "signal": "SIGKILL"};
        plus ``output_dropped_bytes`` when its log lost output."""
        code = self.exit_code
        info: dict[str, object] = {"exit_code": code, "signal": None}
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            info = {"exit_code": None, "signal": name}
        if self.output_dropped_bytes:
            info["output_dropped_bytes"] = self.output_dropped_bytes
        return info


def handles_signal(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` or ignores it (``/proc`` SigCgt,
    SigIgn), so that sending it cannot kill the process by its default action. False when
    the process is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = {k: v for k, _, v in (line.partition(":") for line in f)}
        caught = int(masks["SigCgt"].strip(), 16) | int(masks["SigIgn"].strip(), 16)
    except (OSError, KeyError, ValueError):
        return False
    return bool(caught >> (signum - 1) & 1)


def spawn_process(argv: list[str], env: dict[str, str], stdin: int) -> subprocess.Popen:
    """Start a worker-like process: own session, PDEATHSIG, stdout+stderr merged in a pipe.

    Used for cold workers and for warm-restart standbys (standby_pool.py), so both are isolated
    and outlived by nothing in the same way.
    """
    parent = os.getpid()
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: _child_setup(parent),  # noqa: PLW1509
        close_fds=True,
    )
    GUARDIAN.register(proc.pid, env.get("FT_RUN_DIR", ""))
    return proc


# Warm restart's hand-over: (spec, the sink maker for its output) -> an activated standby.
WarmSource = Callable[[WorkerSpec, Callable[[WorkerSpec], Sink]], Worker | None]


class WorkerGroup:
    """The local workers of one cycle, each in its own session and process group."""

    def __init__(self, events: Callable[..., Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """``events(name, **fields)``, when given, records ``output_dropped`` (once per
        worker whose log file cannot be written: a full disk), from ``poll``, so on the
        caller's thread, never on an output thread. ``clock`` and ``sleep`` time the
        teardown's waits (a test's fake clock)."""
        self.workers: list[Worker] = []
        self.events = events
        self.clock, self.sleep = clock, sleep
        self._drops: list[dict[str, Any]] = []  # appended by output threads

    def start(self, specs: list[WorkerSpec], warm: WarmSource | None = None) -> None:
        """Spawn every worker; on a spawn failure kill the ones already started.

        ``warm(spec, sink)`` (warm restart, standby_pool.py) may hand over an activated
        standby for a spec, its output going to ``sink(spec)`` as a cold worker's does (so a
        full disk is reported alike); where it returns None the worker is spawned cold.
        """
        try:
            for spec in specs:
                worker = warm(spec, self.sink) if warm is not None else None
                if worker is None:
                    worker = self._spawn(spec)
                self.workers.append(worker)
        except OSError:
            self.kill_all()
            raise

    def sink(self, spec: WorkerSpec) -> Sink:
        """Where a worker's output goes: its cycle log (never through a symlink), and the
        console with a rank prefix when it is echoed."""
        prefix = f"[rank{spec.rank}]: ".encode() if spec.echo else None

        def dropped(reason: str) -> None:  # on the output thread: recorded by poll()
            self._drops.append({"rank": spec.rank, "log": str(spec.log_path),
                                "reason": reason})

        return Sink(open_log(spec.log_path), prefix, label=f"rank {spec.rank}",
                    on_drop=dropped)

    def _spawn(self, spec: WorkerSpec) -> Worker:
        sink = self.sink(spec)
        try:
            proc = spawn_process(spec.argv, exit_hook_env(spec.argv, spec.env),
                                 stdin=subprocess.DEVNULL)
        except OSError:
            sink.close()
            raise
        assert proc.stdout is not None
        worker = Worker(spec=spec, proc=proc, started_at=time.time())
        worker._pump = OutputPump(proc.stdout, sink, name=f"ft-log-rank{spec.rank}").start()
        return worker

    def poll(self) -> list[Worker]:
        """Reap exited workers; return those that exited since the last poll. Also records
        the output drops reported since (``output_dropped`` events)."""
        while self._drops:
            drop = self._drops.pop(0)
            if self.events is not None:
                self.events("output_dropped", **drop)
        exited = []
        for w in self.workers:
            if w.alive:
                code = w.proc.poll()
                if code is not None:
                    w.exit_code = code
                    exited.append(w)
        return exited

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.alive]

    def send_signal(self, worker: Worker, signum: int) -> None:
        """Send a signal to a worker's whole process group (dataloader children too)."""
        try:
            os.killpg(worker.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def signal_process(self, worker: Worker, pid: int, signum: int) -> bool:
        """Send a signal to one process of a worker's group (the worker itself, or a
        process it started there); False when the pid is not ours or is gone."""
        try:
            if pid != worker.pid and os.getpgid(pid) != worker.pid:
                return False
            os.kill(pid, signum)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self, grace: float, signum: int = signal.SIGTERM,
             ignoring: Callable[[list[Worker]], list[Worker]] | None = None) -> None:
        """SIGCONT + ``signum`` to every group, wait up to ``grace``, then SIGKILL.

        Workers that already exited are reaped first, so one that exited by itself (a 16
        just before the teardown) keeps its own exit code and is not signalled.
        ``ignoring(alive)``, asked while waiting, names workers that plainly ignore the
        signal (they carry on working): those are killed at once rather than waited for."""
        self.poll()
        for w in self.alive():
            # A SIGSTOPped worker would never act on SIGTERM; continue it first.
            w.signalled = True
            self.send_signal(w, signal.SIGCONT)
            self.send_signal(w, signum)

        def kill_ignoring() -> None:
            for w in ignoring(self.alive()) if ignoring is not None else ():
                self.send_signal(w, signal.SIGKILL)

        self._wait(grace, kill_ignoring)
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every process group (also of exited leaders: their children may live)."""
        self.poll()
        for w in self.workers:
            w.signalled = w.signalled or w.alive
            self.send_signal(w, signal.SIGCONT)
            self.send_signal(w, signal.SIGKILL)
        self._wait(10.0)
        for w in self.workers:
            if not w.alive:
                GUARDIAN.unregister(w.pid)
            if w._pump is not None:
                w._pump.join(timeout=2.0)

    def _wait(self, timeout: float, tick: Callable[[], None] | None = None) -> None:
        deadline = self.clock() + timeout
        while self.alive() and self.clock() < deadline:
            self.poll()
            if self.alive():
                if tick is not None:
                    tick()
                self.sleep(STOP_POLL_S)
        self.poll()
