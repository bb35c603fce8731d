"""One warm-restart standby as the launcher sees it, and the process plumbing of warm
restart: adopted children (``ChildProcess``), the child-subreaper role and the reaping of
adopted orphans, killing a standby's process group (see ``standby_pool.py``)."""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from ft_launcher.process.output import LineHook, OutputPump, Sink, open_log
from ft_launcher.process.workers import GUARDIAN, spawn_process

log = logging.getLogger("ft_launcher")

BOOTSTRAP = "from ft_launcher.warm.worker_side.activation import main; main()"
_MB = 1024 * 1024
_PR_SET_CHILD_SUBREAPER = 36


@dataclass
class PythonEntry:
    """A cold worker's argv prefix split up: interpreter and flags, then script or module."""

    interpreter: list[str]  # [python, -u]
    module: bool
    target: str

    @classmethod
    def parse(cls, entrypoint: list[str]) -> PythonEntry | None:
        """[python, flags..., script] or [python, flags..., -m, mod]; None otherwise."""
        if len(entrypoint) < 2 or entrypoint[0] != sys.executable:
            return None
        if len(entrypoint) >= 3 and entrypoint[-2] == "-m":
            flags, module = entrypoint[1:-2], True
        else:
            flags, module = entrypoint[1:-1], False
        if not all(f.startswith("-") and f != "-m" for f in flags):
            return None
        return cls([entrypoint[0], *flags], module, entrypoint[-1])

    def sys_path0(self) -> str:
        """What ``sys.path[0]`` is for the script: its real directory, or the cwd for -m."""
        if self.module:
            return os.getcwd()
        return os.path.dirname(os.path.realpath(self.target))


@dataclass
class Standby:
    """One standby process; the pump thread fills in what the process tells."""

    local_rank: int
    nonce: str
    spawned_at: float
    sink: Sink  # before activation: the standby log
    stdin: IO[bytes]
    stdout: IO[bytes]
    proc: subprocess.Popen | ChildProcess | None  # None: forked, pid not told yet
    forked: bool = False
    cycle_sink: Sink | None = None  # set by take() before the activation record is sent
    told_pid: int | None = None  # a forked standby's own pid, once adopted
    ready_s: float | None = None  # import (spawned) or fork-to-ready (forked) time it reported
    ready_at: float | None = None
    threads: int | None = None
    failure: str | None = None  # "module: error" when a preload failed
    reported: bool = False
    generation: int = 0  # of the zygote that forked it (ZygoteSide.generation)
    pump: OutputPump | None = field(default=None, repr=False)

    def start_pump(self, wake: Callable[[], None] | None = None) -> None:
        """Read its output: messages to the launcher, the rest to its sink. ``wake`` (from
        the pump's thread) after each message and at the end of its output, so that the
        launcher's loop sleeps until there is news instead of polling for it."""
        self.pump = OutputPump(self.stdout, self.sink, name=f"ft-standby-{self.local_rank}",
                               on_line=message_hook(self, wake), on_eof=wake).start()

    def ready_fields(self) -> dict[str, object]:
        """The ``standby_ready`` event's fields after ``preload``."""
        assert self.ready_at is not None and self.pid is not None
        return {"forked": self.forked, "import_s": self.ready_s,
                "ready_s": round(self.ready_at - self.spawned_at, 3), "threads": self.threads,
                **memory_mb(self.pid)}

    def death_fields(self) -> dict[str, object]:
        """The ``standby_died`` event's fields."""
        code = self.proc.returncode if self.proc is not None else None
        return {"local_rank": self.local_rank, "pid": self.pid, "forked": self.forked,
                "was_ready": self.ready_at is not None,
                "exit_code": code if code is None or code >= 0 else None,
                "signal": signal_name(-code) if code is not None and code < 0 else None}

    def adopt(self, run_dir: str) -> bool:
        """Whether its process is known: a forked standby's, once it told its pid and is
        this launcher's child (else ``failure`` says why not)."""
        if self.proc is None and self.told_pid is not None:
            if parent_of(self.told_pid) == os.getpid():
                self.proc = ChildProcess(self.told_pid)
                # Its group dies with the launcher, however the launcher dies (guardian.py).
                GUARDIAN.register(self.told_pid, run_dir)
            else:
                self.failure = self.failure or \
                    f"standby pid {self.told_pid} is not the launcher's child"
        return self.proc is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.told_pid

    def exited(self) -> bool:
        """Dead: reaped, or (forked, pid not known yet) its output pipe closed."""
        if self.proc is not None:
            return self.proc.poll() is not None
        return self.pump is not None and (self.pump.eof or not self.pump.is_alive())

    def handle(self, message: str) -> bool:
        """A message line from the standby; True when its output now goes to the cycle."""
        kind, _, rest = message.partition(" ")
        try:
            if kind == "ready":
                seconds, _, threads = rest.partition(" ")
                self.ready_s, self.threads = float(seconds), int(threads or 0)
                self.ready_at = time.monotonic()
            elif kind == "pid":
                self.told_pid = int(rest)
        except ValueError:
            self.failure = f"unreadable message from the standby: {message!r}"
            return False
        if kind == "failed":
            self.failure = rest
        return kind == "start"


class ChildProcess:
    """A child of the launcher that ``subprocess`` did not start: a standby forked by the
    zygote and adopted by the launcher. Offers the part of Popen the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # cannot happen to an adopted child; be definite
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([f"pid {self.pid}"], timeout or 0.0)
            time.sleep(0.005)
        return code


def message_hook(sb: Standby, wake: Callable[[], None] | None = None) -> LineHook:
    """The output pump's line hook: lines marked with the standby's nonce are messages to
    the launcher, kept out of every log. The "start" message switches the pump to the
    cycle's log: it is written after the activation record arrived, so nothing printed
    before activation lands in the cycle's log and nothing after it is lost. ``wake``
    follows each message (the launcher acts on it in its loop)."""
    mark = f"@@ft-standby {sb.nonce} ".encode()

    def on_line(pump: OutputPump, chunk: bytes) -> bool:
        at = chunk.find(mark)
        if at < 0:
            return False
        if at > 0:  # a partial line printed just before the message
            pump.sink.write(chunk[:at] + b"\n")
        if sb.handle(chunk[at + len(mark):].decode(errors="replace").strip()) \
                and sb.cycle_sink is not None:
            pump.swap_sink(sb.cycle_sink)
        if wake is not None:
            wake()
        return True

    return on_line


def encode_record(cwd: str, entry: PythonEntry, args: list[str],
                   env: dict[str, str]) -> bytes:
    """The activation record: ``<length>\\n`` + NUL-separated fields (no NUL can occur in
    argv or environment strings, so no quoting is needed)."""
    fields = [cwd, "module" if entry.module else "path", entry.target, str(len(args)), *args,
              *(f"{k}={v}" for k, v in env.items())]
    payload = b"\0".join(os.fsencode(f) for f in fields)
    return str(len(payload)).encode() + b"\n" + payload


def kill_group(proc: subprocess.Popen | ChildProcess, wait: bool = True) -> None:
    """SIGKILL a session leader's process group and (``wait``) reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    GUARDIAN.unregister(proc.pid)
    if wait:
        reap(proc)


def reap(proc: subprocess.Popen | ChildProcess) -> None:
    """Wait (at most 5 s) for a SIGKILLed process to exit, and reap it."""
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the kernel
        log.warning("pid %d did not exit after SIGKILL", proc.pid)


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: state, ppid, pgrp, session, ..."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].decode().split()


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def reap_orphans() -> int:
    """Reap exited orphans this process adopted as a subreaper; how many were reaped.

    Only zombies of another session that do not lead it: every process the launcher starts
    itself is either a session leader (workers, standbys, the zygote) or in the launcher's own
    session (commands it runs), and their owners reap them. The peek (``WNOWAIT``) stops at
    the first exited child that is not an orphan; its owner reaps it soon."""
    mine = os.getsid(0)
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None:
            return reaped
        fields = _stat_fields(info.si_pid)
        session = int(fields[3]) if fields else None
        if session is None or session in (info.si_pid, mine):
            return reaped
        os.waitpid(info.si_pid, os.WNOHANG)
        reaped += 1


def float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def memory_mb(pid: int) -> dict[str, float | None]:
    """RSS and PSS (shared pages split among the processes that map them) in MiB."""
    try:
        info = psutil.Process(pid).memory_full_info()
        return {"rss_mb": round(info.rss / _MB, 1), "pss_mb": round(info.pss / _MB, 1)}
    except (psutil.Error, AttributeError):
        return {"rss_mb": None, "pss_mb": None}


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def standby_sink(log_dir: Path, local_rank: int) -> Sink:
    """Where a standby's output goes before activation: ``LOG_DIR/local_rank_N.log``."""
    log_path = log_dir / f"local_rank_{local_rank}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return Sink(open_log(log_path), None, label=f"standby {local_rank}")


def run_dir_env(env: dict[str, str], run_dir: Path) -> dict[str, str]:
    """A standby's (or the zygote's) environment with the run's ``FT_RUN_DIR``, as its
    workers get it: ``/proc/PID/environ`` of a worker made from a standby keeps showing
    the environment the standby started with, and tools find a run's workers by it."""
    return {**env, "FT_RUN_DIR": str(run_dir.absolute())}


def spawn_standby(entry: PythonEntry, local_rank: int, run_dir: Path, preload: list[str],
                  env: dict[str, str], log_dir: Path) -> Standby:
    """A fresh interpreter that imports ``preload`` and waits as a standby (raises
    OSError when it cannot be started); its output pump is not started yet."""
    nonce = secrets.token_hex(8)
    argv = [*entry.interpreter, "-c", BOOTSTRAP, nonce, str(run_dir.absolute()),
            entry.sys_path0(), ",".join(preload)]
    sink = standby_sink(log_dir, local_rank)
    try:
        proc = spawn_process(argv, run_dir_env(env, run_dir), stdin=subprocess.PIPE)
    except OSError:
        sink.close()
        raise
    assert proc.stdin is not None and proc.stdout is not None
    return Standby(local_rank, nonce, time.monotonic(), sink, proc.stdin, proc.stdout, proc)
