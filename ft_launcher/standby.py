"""Warm restart: one standby interpreter per local rank, ready to become the next worker.

With ``--ft-warm-restart`` (YAML ``warm_restart: true``) the launcher keeps, while a cycle
runs, one standby process per local rank that already imported the ``--ft-preload``
modules (default ``torch``) and waits (``standby_worker.py`` runs inside it). A restart
hands each ready standby the new cycle's argv and environment; it runs the training script
in place, so the worker skips the interpreter start and the imports. Local ranks without a
ready standby start cold. Off by default; without the option nothing here runs.

Life cycle, driven by the supervisor's loop through four calls:

- ``take(spec)``: at a cycle's start, activate the local rank's ready standby (a Worker
  whose ``started_at`` is the activation time, so the initial-heartbeat clock starts then);
- ``cycle_started()``: the cycle's workers were started; hold new standbys back;
- ``tick(training_started)``: every loop iteration; spawn missing standbys once every rank
  of the cycle sent its first heartbeat (or ``SPAWN_DELAY_S`` passed), so standbys never
  compete with the cycle's own start-up, at most ``max(1, cores // 2)`` importing at once;
  report ready ones (``standby_ready`` with pid, import time and memory) and replace dead
  ones (``standby_died``);
- ``close()``: SIGKILL every standby's process group (the supervisor's ``finally``).
  A SIGKILLed launcher takes them along through PDEATHSIG, like its workers.

Standbys are spawned like workers (``workers.spawn_process``: exec of a fresh interpreter,
own session, PDEATHSIG), never forked from the launcher. Their environment is the
launcher's plus ``OMP_NUM_THREADS`` when the launcher sets it for workers (libraries read it
when they load). Their output before activation goes to ``LOG_DIR/standby/local_rank_N.log``;
after activation to the cycle's rank log, echoed like a cold worker's. The run directory is
on their command line, so tools that look for a run's processes find them.

The feature turns itself off for the rest of the job (one ``warm_restart_disabled`` event)
when the entrypoint is not a Python script (``--no-python``), a preload fails to import or
opens a GPU device, or a local rank's standby dies ``MAX_EARLY_DEATHS`` times before it
was ready.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from ft_launcher.config import LaunchConfig
from ft_launcher.workers import Worker, WorkerSpec, spawn_process

log = logging.getLogger("ft_launcher")

BOOTSTRAP = "from ft_launcher.standby_worker import main; main()"
SPAWN_DELAY_S = 5.0  # spawn standbys this long after a cycle started, heartbeats or not
MAX_EARLY_DEATHS = 3  # standbys of one local rank dying before ready, in a row
STANDBY_ENV_KEYS = ("OMP_NUM_THREADS",)  # worker settings that libraries read at load time
_MB = 1024 * 1024


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


class _Sink:
    """Where a standby's output lines go: a log file, and the console with a prefix."""

    def __init__(self, log_file: IO[bytes], prefix: bytes | None) -> None:
        self.log_file = log_file
        self.prefix = prefix

    def write(self, line: bytes) -> None:
        self.log_file.write(line)
        self.log_file.flush()
        if self.prefix is not None:
            try:
                sys.stdout.buffer.write(self.prefix + line)
                sys.stdout.buffer.flush()
            except (OSError, ValueError):
                self.prefix = None

    def close(self) -> None:
        self.log_file.close()


@dataclass
class Standby:
    """One standby process; the pump thread fills in what the process tells."""

    local_rank: int
    proc: subprocess.Popen
    nonce: str
    spawned_at: float
    sink: _Sink
    cycle_sink: _Sink | None = None  # set by take() before the activation record is sent
    ready_s: float | None = None  # import time the standby reported
    ready_at: float | None = None
    threads: int | None = None
    failure: str | None = None  # "module: error" when a preload failed
    reported: bool = False
    pump: threading.Thread | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def handle(self, message: str) -> bool:
        """A message line from the standby; True when its output now goes to the cycle."""
        kind, _, rest = message.partition(" ")
        if kind == "ready":
            seconds, _, threads = rest.partition(" ")
            try:
                self.ready_s, self.threads = float(seconds), int(threads or 0)
            except ValueError:
                self.failure = f"unreadable message from the standby: {message!r}"
                return False
            self.ready_at = time.monotonic()
        elif kind == "failed":
            self.failure = rest
        return kind == "start"


def _pump(sb: Standby) -> None:
    # Copies the standby's merged output to its sink, line by line, and takes the lines
    # marked with its nonce as messages. The "start" message switches to the cycle's log:
    # it is written after the activation record arrived, so nothing printed before
    # activation lands in the cycle's log and nothing after it is lost.
    mark = f"@@ft-standby {sb.nonce} ".encode()
    stream = sb.proc.stdout
    assert stream is not None
    sink = sb.sink
    try:
        for line in iter(stream.readline, b""):
            at = line.find(mark)
            if at < 0:
                sink.write(line)
                continue
            if at > 0:  # a partial line printed just before the message
                sink.write(line[:at] + b"\n")
            if sb.handle(line[at + len(mark):].decode(errors="replace").strip()) \
                    and sb.cycle_sink is not None:
                sink.close()
                sink = sb.cycle_sink
    finally:
        stream.close()
        sink.close()
        if sb.cycle_sink is not None and sb.cycle_sink is not sink:
            sb.cycle_sink.close()


def _encode_record(cwd: str, entry: PythonEntry, args: list[str],
                   env: dict[str, str]) -> bytes:
    """The activation record: ``<length>\\n`` + NUL-separated fields (no NUL can occur in
    argv or environment strings, so no quoting is needed)."""
    fields = [cwd, "module" if entry.module else "path", entry.target, str(len(args)), *args,
              *(f"{k}={v}" for k, v in env.items())]
    payload = b"\0".join(os.fsencode(f) for f in fields)
    return str(len(payload)).encode() + b"\n" + payload


class StandbyPool:
    """The standbys of this node; every method is a no-op when warm restart is off."""

    def __init__(self, cfg: LaunchConfig, log_dir: Path,
                 event: Callable[..., Any]) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.event = event
        self.entry = PythonEntry.parse(cfg.entrypoint)
        self.enabled = cfg.ft.warm_restart
        self.standbys: dict[int, Standby] = {}
        self.env = dict(os.environ)
        self._cycle_start = time.monotonic()
        self._early_deaths: dict[int, int] = {}
        self._max_starting = max(1, (os.cpu_count() or 1) // 2)

    # -- the supervisor's calls ----------------------------------------------------------

    def take(self, spec: WorkerSpec) -> Worker | None:
        """Activate the ready standby of ``spec.local_rank`` as this cycle's worker."""
        if not self.enabled:
            return None
        self._learn_env(spec)
        sb = self.standbys.get(spec.local_rank)
        entry = self.entry
        n = len(self.cfg.entrypoint)
        if sb is None or sb.ready_at is None or sb.failure or sb.proc.poll() is not None \
                or entry is None or spec.argv[:n] != self.cfg.entrypoint:
            return None
        if not sb.reported:
            self._report_ready(sb)
        record = _encode_record(os.getcwd(), entry, spec.argv[n:], spec.env)
        prefix = f"[rank{spec.rank}]: ".encode() if spec.echo else None
        sb.cycle_sink = _Sink(open(spec.log_path, "ab", buffering=0), prefix)  # noqa: SIM115
        assert sb.proc.stdin is not None
        try:
            sb.proc.stdin.write(record)
            sb.proc.stdin.close()
        except OSError:  # it died just now: tick() reports it, this rank starts cold
            sb.cycle_sink.close()
            sb.cycle_sink = None
            return None
        del self.standbys[spec.local_rank]
        return Worker(spec=spec, proc=sb.proc, started_at=time.time(), _pump=sb.pump,
                      warm=True)

    def cycle_started(self) -> None:
        """The cycle's workers are up: new standbys wait until it runs (see ``tick``)."""
        self._cycle_start = time.monotonic()
        if self.enabled and self.entry is None:
            self._disable("the training program is not a Python script (--no-python); "
                          "workers start cold")

    def tick(self, training_started: bool) -> None:
        """Report ready and dead standbys; spawn missing ones when the cycle runs."""
        if not self.enabled:
            return
        for sb in list(self.standbys.values()):
            if sb.proc.poll() is not None:
                self._on_exit(sb)
            elif sb.failure:
                self._disable(f"preload failed: {sb.failure}")
            elif sb.ready_at is not None and not sb.reported:
                self._report_ready(sb)
            if not self.enabled:
                return
        if training_started or time.monotonic() - self._cycle_start >= SPAWN_DELAY_S:
            self._spawn_missing()

    def close(self) -> None:
        """SIGKILL every standby's process group and reap it."""
        standbys = list(self.standbys.values())
        self.standbys.clear()
        for sb in standbys:
            try:
                os.killpg(sb.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for sb in standbys:
            try:
                sb.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the kernel
                log.warning("standby pid %d did not exit after SIGKILL", sb.pid)
            if sb.proc.stdin is not None:
                sb.proc.stdin.close()
            if sb.pump is not None:
                sb.pump.join(timeout=2.0)

    # -- inside ----------------------------------------------------------------------------

    def _learn_env(self, spec: WorkerSpec) -> None:
        env = dict(os.environ)
        env.update({k: spec.env[k] for k in STANDBY_ENV_KEYS if k in spec.env})
        self.env = env

    def _spawn_missing(self) -> None:
        starting = sum(1 for sb in self.standbys.values() if sb.ready_at is None)
        for local_rank in range(self.cfg.nproc_per_node):
            if starting >= self._max_starting:
                return
            if local_rank not in self.standbys:
                try:
                    self.standbys[local_rank] = self._spawn(local_rank)
                except OSError as exc:  # out of processes or files: the job goes on cold
                    self._disable(f"cannot spawn a standby: {exc}")
                    return
                starting += 1

    def _spawn(self, local_rank: int) -> Standby:
        assert self.entry is not None
        nonce = secrets.token_hex(8)
        argv = [*self.entry.interpreter, "-c", BOOTSTRAP, nonce, str(self.cfg.run_dir.absolute()),
                self.entry.sys_path0(), ",".join(self.cfg.ft.preload)]
        log_path = self.log_dir / f"local_rank_{local_rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab", buffering=0)  # noqa: SIM115
        try:
            proc = spawn_process(argv, self.env, stdin=subprocess.PIPE)
        except OSError:
            log_file.close()
            raise
        sb = Standby(local_rank, proc, nonce, time.monotonic(), _Sink(log_file, None))
        sb.pump = threading.Thread(target=_pump, args=(sb,), daemon=True,
                                   name=f"ft-standby-{local_rank}")
        sb.pump.start()
        log.debug("standby for local rank %d spawned: pid %d", local_rank, proc.pid)
        return sb

    def _report_ready(self, sb: Standby) -> None:
        sb.reported = True
        self._early_deaths[sb.local_rank] = 0
        assert sb.ready_at is not None
        self.event("standby_ready", local_rank=sb.local_rank, pid=sb.pid,
                   preload=self.cfg.ft.preload, import_s=sb.ready_s,
                   ready_s=round(sb.ready_at - sb.spawned_at, 3), threads=sb.threads,
                   **_memory(sb.pid))

    def _on_exit(self, sb: Standby) -> None:
        del self.standbys[sb.local_rank]
        if sb.pump is not None:
            sb.pump.join(timeout=1.0)  # its last lines may say why (a failed preload)
        if sb.failure:
            self._disable(f"preload failed: {sb.failure}")
            return
        code = sb.proc.returncode
        self.event("standby_died", local_rank=sb.local_rank, pid=sb.pid,
                   was_ready=sb.ready_at is not None,
                   exit_code=code if code >= 0 else None,
                   signal=_signal_name(-code) if code < 0 else None)
        if sb.ready_at is None:
            deaths = self._early_deaths.get(sb.local_rank, 0) + 1
            self._early_deaths[sb.local_rank] = deaths
            if deaths >= MAX_EARLY_DEATHS:
                self._disable(f"the standby of local rank {sb.local_rank} died {deaths} "
                              "times before it was ready")

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self.event("warm_restart_disabled", reason=reason)
        self.close()


def _memory(pid: int) -> dict[str, float | None]:
    """RSS and PSS (shared pages split among the processes that map them) in MiB."""
    try:
        info = psutil.Process(pid).memory_full_info()
        return {"rss_mb": round(info.rss / _MB, 1), "pss_mb": round(info.pss / _MB, 1)}
    except (psutil.Error, AttributeError):
        return {"rss_mb": None, "pss_mb": None}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
