"""Spawning, watching and stopping one cycle's group of local workers."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger("ft_launcher")

_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux: rely on teardown alone
    _prctl = None


def _child_setup(parent_pid: int) -> None:
    # Runs in the child between fork and exec. A worker must never outlive a launcher that
    # was SIGKILLed: the kernel delivers SIGKILL to the child when its parent thread dies.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # parent died before prctl took effect
            os._exit(1)


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
    _pump: threading.Thread | None = field(default=None, repr=False)
    warm: bool = False  # an activated standby (warm restart), not a fresh spawn
    reported: bool = False  # its exit is on record (events.jsonl)

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

    def describe_exit(self) -> dict[str, object]:
        """{"exit_code": N, "signal": None} or {"exit_code": None, "signal": "SIGKILL"}."""
        code = self.exit_code
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return {"exit_code": None, "signal": name}
        return {"exit_code": code, "signal": None}


def spawn_process(argv: list[str], env: dict[str, str], stdin: int) -> subprocess.Popen:
    """Start a worker-like process: own session, PDEATHSIG, stdout+stderr merged in a pipe.

    Used for cold workers and for warm-restart standbys (standby.py), so both are isolated
    and outlived by nothing in the same way.
    """
    parent = os.getpid()
    return subprocess.Popen(
        argv,
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: _child_setup(parent),  # noqa: PLW1509
        close_fds=True,
    )


def _pump_output(stream: IO[bytes], log_file: IO[bytes], prefix: bytes | None) -> None:
    # A thread per worker copies its merged stdout/stderr to the cycle's log file, and to the
    # console when asked, so the worker never blocks on a full pipe.
    out = sys.stdout.buffer if prefix is not None else None
    with stream, log_file:
        for line in iter(stream.readline, b""):
            log_file.write(line)
            log_file.flush()
            if out is not None:
                try:
                    out.write(prefix + line)
                    out.flush()
                except (OSError, ValueError):
                    out = None


class WorkerGroup:
    """The local workers of one cycle, each in its own session and process group."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []

    def start(self, specs: list[WorkerSpec],
              warm: Callable[[WorkerSpec], Worker | None] | None = None) -> None:
        """Spawn every worker; on a spawn failure kill the ones already started.

        ``warm`` (warm restart, standby.py) may hand over an activated standby for a spec;
        where it returns None the worker is spawned cold.
        """
        try:
            for spec in specs:
                worker = warm(spec) if warm is not None else None
                if worker is None:
                    worker = self._spawn(spec)
                self.workers.append(worker)
        except OSError:
            self.kill_all()
            raise

    @staticmethod
    def _spawn(spec: WorkerSpec) -> Worker:
        log_file = open(spec.log_path, "ab", buffering=0)  # noqa: SIM115
        try:
            proc = spawn_process(spec.argv, spec.env, stdin=subprocess.DEVNULL)
        except OSError:
            log_file.close()
            raise
        prefix = f"[rank{spec.rank}]: ".encode() if spec.echo else None
        worker = Worker(spec=spec, proc=proc, started_at=time.time())
        worker._pump = threading.Thread(
            target=_pump_output,
            args=(proc.stdout, log_file, prefix),
            name=f"ft-log-rank{spec.rank}",
            daemon=True,
        )
        worker._pump.start()
        return worker

    def poll(self) -> list[Worker]:
        """Reap exited workers; return those that exited since the last poll."""
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

    def stop(self, grace: float, signum: int = signal.SIGTERM) -> None:
        """SIGCONT + ``signum`` to every group, wait up to ``grace``, then SIGKILL."""
        for w in self.alive():
            # A SIGSTOPped worker would never act on SIGTERM; continue it first.
            self.send_signal(w, signal.SIGCONT)
            self.send_signal(w, signum)
        self._wait(grace)
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every process group (also of exited leaders: their children may live)."""
        for w in self.workers:
            self.send_signal(w, signal.SIGCONT)
            self.send_signal(w, signal.SIGKILL)
        self._wait(10.0)
        for w in self.workers:
            if w._pump is not None:
                w._pump.join(timeout=2.0)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            self.poll()
            if self.alive():
                time.sleep(0.01)
        self.poll()
