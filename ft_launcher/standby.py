"""Warm restart: one standby process per local rank, ready to become the next worker.

With ``--ft-warm-restart`` (YAML ``warm_restart: true``) the launcher keeps one standby per
local rank that already imported the ``--ft-preload`` modules (default ``torch``) and waits
(``worker_side/standby.py`` runs inside it). A restart hands each ready standby the new
cycle's argv and environment; it runs the training script in place, so the worker skips the
interpreter start and the imports. Local ranks without a ready standby start cold.

Where standbys come from:

- **The zygote** (``worker_side/zygote.py``): one process per node, spawned when the pool is
  created (at launcher start), that imports the preloads once. Once it is ready
  (``zygote_ready``) it forks a standby per local rank, and a fresh one whenever one dies or
  was taken for a restart (as soon as the new cycle's ranks sent their first heartbeats, at
  most ``REFILL_DELAY_S`` later), so a second fault soon after a restart finds standbys
  again. A forked standby shares the imported pages copy-on-write and is ready in
  milliseconds. The first cycle waits for them (``first_cycle_waits``), so its workers are
  forks too and the node imports torch once: the zygote then imports at full priority.
  Where forking is expected to be unsafe (torch preloaded and ``OMP_NUM_THREADS`` not 1:
  torch's OpenMP pool starts at import) nothing waits, and the zygote imports under
  ``SCHED_IDLE`` until the first cycle trains (``tick(True)``) or ``SPAWN_DELAY_S`` passed,
  so it does not slow that cycle's start; it usually falls back then. The launcher is a child
  subreaper (``PR_SET_CHILD_SUBREAPER``) and adopts each standby, so a worker made from one
  is the launcher's own child like a cold worker (exit status, SIGCHLD, PDEATHSIG relative
  to the launcher), and the zygote's death costs no worker anything.
- **Spawned standbys** (the fallback, after one ``zygote_fallback`` event saying why: the
  preloads started threads or a CUDA context, the launcher cannot adopt processes, or the
  zygote or its forks died): a fresh interpreter per local rank (``workers.spawn_process``)
  that imports the preloads itself, spawned once every rank of a cycle sent its first
  heartbeat (or ``SPAWN_DELAY_S`` passed), at most ``max(1, cores // 2)`` importing at once.

Life cycle, driven by the supervisor's loop through five calls:

- ``first_cycle_waits()``: before the first cycle, whether its start should wait (the
  supervisor ticks meanwhile, bounded, and stops on a terminating signal);
- ``take(spec)``: at a cycle's start, activate the local rank's ready standby (a Worker
  whose ``started_at`` is the activation time, so the initial-heartbeat clock starts then);
- ``cycle_started()``: the cycle's workers were started;
- ``tick(training_started)``: every loop iteration; reads the zygote's messages, reports
  ready standbys (``standby_ready`` with pid, time to ready and memory), replaces dead ones
  (``standby_died``), forks or spawns missing ones and reaps adopted orphans;
- ``close()``: SIGKILL every standby's process group and the zygote (the supervisor's
  ``finally``). A SIGKILLed launcher takes them along through PDEATHSIG, like its workers.

One more: ``take_store()`` before a single-node cycle's workers start hands over a TCPStore
server that a fork of the zygote already hosts, so that every rank can connect to a
listening store (see its docstring for the worker environment that goes with it). Cold runs
get it with ``--ft-agent-store`` (one node): a store-only zygote, which
imports torch alone at idle priority until it is ready (never raised by the launcher) and
never forks a standby.

Standbys' environment is the launcher's plus ``OMP_NUM_THREADS`` when the launcher sets it
for workers (libraries read it when they load). Their output before activation goes to
``LOG_DIR/standby/local_rank_N.log`` (the zygote's to ``zygote.log``); after activation to
the cycle's rank log, echoed like a cold worker's. The run directory is on their command
line, so tools that look for a run's processes find them.

As a subreaper the launcher also adopts the orphans of its workers (a worker's children when
the worker dies first); ``tick`` and ``close`` reap those that exited (zombies of another
session, never one of the launcher's own children).

The feature turns itself off for the rest of the job (one ``warm_restart_disabled`` event)
when the entrypoint is not a Python script (``--no-python``), a preload fails to import or
(spawned) opens a GPU device, or a local rank's spawned standby dies ``MAX_EARLY_DEATHS``
times before it was ready.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from ft_launcher.config import LaunchConfig
from ft_launcher.output import LineHook, OutputPump, Sink, open_log
from ft_launcher.workers import GUARDIAN, Worker, WorkerSpec, spawn_process

log = logging.getLogger("ft_launcher")

BOOTSTRAP = "from ft_launcher.worker_side.standby import main; main()"
ZYGOTE_BOOTSTRAP = "from ft_launcher.worker_side.zygote import main; main()"
SPAWN_DELAY_S = 5.0  # spawn standbys (raise the zygote) this long after a cycle started
# Replacement forks wait for the new cycle's first heartbeats (or this long): a fork copies
# the zygote's page tables, CPU better left to the workers that are starting.
REFILL_DELAY_S = 1.0
MAX_EARLY_DEATHS = 3  # standbys of one local rank dying before ready, in a row
STANDBY_ENV_KEYS = ("OMP_NUM_THREADS",)  # worker settings that libraries read at load time
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
    pump: OutputPump | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.told_pid

    def exited(self) -> bool:
        """Dead: reaped, or (forked, pid not known yet) its output pipe closed."""
        if self.proc is not None:
            return self.proc.poll() is not None
        return self.pump is not None and not self.pump.is_alive()

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


def _messages(sb: Standby) -> LineHook:
    """The output pump's line hook: lines marked with the standby's nonce are messages to
    the launcher, kept out of every log. The "start" message switches the pump to the
    cycle's log: it is written after the activation record arrived, so nothing printed
    before activation lands in the cycle's log and nothing after it is lost."""
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
        return True

    return on_line


def _encode_record(cwd: str, entry: PythonEntry, args: list[str],
                   env: dict[str, str]) -> bytes:
    """The activation record: ``<length>\\n`` + NUL-separated fields (no NUL can occur in
    argv or environment strings, so no quoting is needed)."""
    fields = [cwd, "module" if entry.module else "path", entry.target, str(len(args)), *args,
              *(f"{k}={v}" for k, v in env.items())]
    payload = b"\0".join(os.fsencode(f) for f in fields)
    return str(len(payload)).encode() + b"\n" + payload


@dataclass
class _Zygote:
    """The launcher's end of the zygote: its process, control socket and output pump."""

    proc: subprocess.Popen
    ctl: socket.socket
    pump: OutputPump
    started_at: float
    ready: bool = False
    raised: bool = False  # back to normal scheduling (it starts under SCHED_IDLE)

    def messages(self) -> tuple[list[str], bool]:
        """Packets waiting on the control socket, and whether the zygote closed it."""
        out: list[str] = []
        while True:
            try:
                data = self.ctl.recv(4096)
            except BlockingIOError:
                return out, False
            except OSError:
                return out, True
            if not data:
                return out, True
            out.append(data.decode(errors="replace"))

    def raise_priority(self) -> None:
        self.raised = True
        try:
            os.sched_setscheduler(self.proc.pid, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):  # gone, or not allowed: it raises itself when ready
            pass

    def stop(self) -> None:
        self.ctl.close()
        _kill_group(self.proc)
        self.pump.join(timeout=2.0)


class StandbyPool:
    """The standbys of this node; every method is a no-op when warm restart is off."""

    def __init__(self, cfg: LaunchConfig, log_dir: Path,
                 event: Callable[..., Any]) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.event = event
        self.entry = PythonEntry.parse(cfg.entrypoint)
        self.enabled = cfg.ft.warm_restart
        # Without warm restart the zygote only hosts cycle stores (single node: other nodes
        # cannot know the port), and needs nothing but torch for that.
        self.stores_only = not self.enabled and cfg.ft.agent_store and cfg.max_nodes == 1
        self.standbys: dict[int, Standby] = {}
        self.env = dict(os.environ)
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in self.env:
            self.env["OMP_NUM_THREADS"] = "1"  # what the workers get (worker_env's rule)
        self._cycle_start = time.monotonic()
        self._early_deaths: dict[int, int] = {}
        self._max_starting = max(1, (os.cpu_count() or 1) // 2)
        self._held: list[tuple[str, dict[str, Any]]] | None = []  # events before the first call
        self.zygote: _Zygote | None = None
        self.forking = False  # standbys come from the zygote (else: spawned)
        self.adopting = False  # this process is a child subreaper: it reaps adopted orphans
        self.store: ChildProcess | None = None  # this cycle's TCPStore host (take_store)
        self.spare_store: tuple[int, ChildProcess] | None = None  # the next cycle's
        self._store_requested = False
        self._store_failed = False
        self._dying: list[ChildProcess] = []  # killed store hosts not reaped yet
        # The first cycle's workers come from the zygote's forks (see first_cycle_waits),
        # so the zygote imports at full priority from its start.
        self.warm_first_cycle = self.enabled and self._forks_expected()
        self._first_cycle = True
        if (self.enabled or self.stores_only) and self.entry is not None:
            self._start_zygote()

    # -- the supervisor's calls ----------------------------------------------------------

    def take(self, spec: WorkerSpec) -> Worker | None:
        """Activate the ready standby of ``spec.local_rank`` as this cycle's worker (``tick``
        forks its replacement once the new cycle trains)."""
        if not self.enabled:
            return None
        self._release_events()
        self._learn_env(spec)
        sb = self.standbys.get(spec.local_rank)
        entry = self.entry
        n = len(self.cfg.entrypoint)
        if sb is None or sb.ready_at is None or sb.failure or entry is None \
                or spec.argv[:n] != self.cfg.entrypoint or not self._adopt(sb) \
                or sb.exited():
            return None
        assert sb.proc is not None
        if not sb.reported:
            self._report_ready(sb)
        record = _encode_record(os.getcwd(), entry, spec.argv[n:], spec.env)
        prefix = f"[rank{spec.rank}]: ".encode() if spec.echo else None
        sb.cycle_sink = Sink(open_log(spec.log_path), prefix, label=f"rank {spec.rank}")
        try:
            sb.stdin.write(record)
            sb.stdin.close()
        except OSError:  # it died just now: tick() reports it, this rank starts cold
            sb.cycle_sink.close()
            sb.cycle_sink = None
            return None
        del self.standbys[spec.local_rank]  # tick() forks its replacement (REFILL_DELAY_S)
        return Worker(spec=spec, proc=sb.proc, started_at=time.time(),  # type: ignore[arg-type]
                      _pump=sb.pump, warm=True)

    def first_cycle_waits(self) -> bool:
        """Whether the first cycle's workers should still wait for standbys (``tick`` brings
        them): the zygote is importing the preloads, forking a standby per local rank, or
        (one node) starting the cycle store. Then the workers start from its forks and the
        node imports torch once, instead of once per rank and once more for the zygote:
        on busy cores that import is what warm restart cost a clean run. False once the
        first cycle started, and whenever forking is out (the workers then start cold)."""
        zygote = self.zygote
        if not (self._first_cycle and self.warm_first_cycle and self.enabled
                and zygote is not None):  # None: it fell back, or never started
            return False
        if not zygote.ready:
            return True
        for local_rank in range(self.cfg.nproc_per_node):
            sb = self.standbys.get(local_rank)
            if sb is None or sb.ready_at is None or sb.told_pid is None:
                return True
        return self._store_requested and self.cfg.max_nodes == 1

    def cycle_started(self) -> None:
        """The cycle's workers are up (spawned standbys wait until it runs, see ``tick``)."""
        self._first_cycle = False
        self._cycle_start = time.monotonic()
        self._release_events()
        if self.enabled and self.entry is None:
            self._disable("the training program is not a Python script (--no-python); "
                          "workers start cold")

    @property
    def needs_ticks(self) -> bool:
        """Whether ``tick`` has work to poll for: standbys, a zygote, adopted orphans."""
        return self.enabled or self.stores_only or self.adopting

    def tick(self, training_started: bool) -> None:
        """Zygote messages; report ready and dead standbys; fork or spawn missing ones."""
        if self.adopting:
            reap_orphans()  # one waitid() when there is nothing to reap
        if not (self.enabled or self.stores_only):
            return
        self._dying = [p for p in self._dying if p.poll() is None]
        self._release_events()
        running = training_started or time.monotonic() - self._cycle_start >= SPAWN_DELAY_S
        if self.zygote is not None:
            self._zygote_messages()
            # A store-only zygote stays idle until it is ready (it then raises itself): it
            # is not asked for, so it must cost a busy machine nothing (measured on 2 cores:
            # raised 5 s after the start, it cost the first step 2 s and a clean run 10 %).
            if self.zygote is not None and running and not self.zygote.raised \
                    and self.enabled:
                self.zygote.raise_priority()
        for sb in list(self.standbys.values()):  # none without warm restart
            if not self.enabled:
                return
            if sb.ready_at is not None or sb.told_pid is not None:
                self._adopt(sb)
            if sb.exited():
                self._on_exit(sb)
            elif sb.failure and sb.forked:  # the zygote did the preloads: forking went wrong
                self._fallback(sb.failure)
            elif sb.failure:
                self._disable(f"preload failed: {sb.failure}")
            elif sb.ready_at is not None and not sb.reported:
                self._report_ready(sb)
        if not self.enabled:
            return
        refill = training_started or time.monotonic() - self._cycle_start >= REFILL_DELAY_S
        if self.forking and refill:
            for local_rank in range(self.cfg.nproc_per_node):
                if local_rank not in self.standbys and self.forking:
                    self._fork(local_rank)
        elif self.zygote is None and running:
            self._spawn_missing()

    def close(self) -> None:
        """SIGKILL every standby's process group, the store hosts and the zygote, and reap
        them. Every group is killed before the first wait, so their teardowns (tens of ms
        each for a process that holds torch) overlap instead of adding up at the job's end."""
        standbys = list(self.standbys.values())
        self.standbys.clear()
        self._end_store()
        procs: list[subprocess.Popen | ChildProcess] = [
            sb.proc for sb in standbys if self._adopt(sb) and sb.proc is not None]
        procs += self._dying
        if self.spare_store is not None:
            procs.append(self.spare_store[1])
        zygote, self.zygote = self.zygote, None
        if zygote is not None:
            zygote.ctl.close()
            procs.append(zygote.proc)
        for proc in procs:
            _kill_group(proc, wait=False)
        for sb in standbys:
            sb.stdin.close()  # a forked one not yet adopted exits when it reads EOF
        for proc in procs:
            _reap(proc)
        for pump in [sb.pump for sb in standbys] + [zygote.pump if zygote else None]:
            if pump is not None:
                pump.join(timeout=2.0)
        self._dying.clear()
        self.spare_store = None
        self.forking = False
        if self.adopting:
            reap_orphans()

    def take_store(self) -> int | None:
        """The port of a TCPStore server that already listens, for the cycle about to start.

        The zygote keeps one spare store host (a fork of it, torch preloaded) listening on a
        port of its choosing; this hands it over and asks for the next spare. The caller
        gives every worker of the cycle ``MASTER_PORT=<port>`` and
        ``TORCHELASTIC_USE_AGENT_STORE=True`` (as torchrun's agent does with its own store),
        so every rank is a client of a store that is up before any of them connects: none
        meets a refused connection and waits out the TCPStore client's back-off (0.5 s,
        then about 1 s, 2 s, ...) while rank 0 still sets up its own store. Single node
        only: other nodes cannot know. None while no spare is ready (the zygote is still
        importing: a store-only zygote's first cycle, or a first cycle that did not wait),
        without torch among the preloads, or with warm restart off: rank 0 hosts the store
        as before. The previous cycle's store ends here (and in ``close``); each cycle gets
        a fresh one, so no key outlives it.
        """
        self._end_store()
        if self.spare_store is None:
            return None
        port, self.store = self.spare_store
        self.spare_store = None
        self._emit("store_taken", port=port, pid=self.store.pid)
        self._request_store()
        return port

    def _request_store(self) -> None:
        if self.zygote is not None and self.zygote.ready and not self._store_requested \
                and self.spare_store is None and not self._store_failed:
            try:
                self.zygote.ctl.send(b"store 127.0.0.1 0")
                self._store_requested = True
            except OSError:
                pass  # the zygote's closed socket is seen at the next tick

    def _on_store(self, rest: str) -> None:
        """``PORT PID`` of a store host that listens now: the next cycle's spare."""
        self._store_requested = False
        fields = rest.split()
        if len(fields) == 2 and all(f.isdigit() for f in fields) \
                and _parent_of(int(fields[1])) == os.getpid():
            self.spare_store = (int(fields[0]), ChildProcess(int(fields[1])))
            GUARDIAN.register(int(fields[1]), str(self.cfg.run_dir))

    def _end_store(self) -> None:
        # SIGKILL now, reap later (tick, close): a restart does not wait for it.
        if self.store is not None:
            _kill_group(self.store, wait=False)
            self._dying.append(self.store)
            self.store = None
        self._dying = [p for p in self._dying if p.poll() is None]

    # -- the zygote ----------------------------------------------------------------------

    def _start_zygote(self) -> None:
        assert self.entry is not None
        self.adopting = become_subreaper()
        if not self.adopting:
            self._fallback("the launcher cannot adopt forked standbys "
                           "(prctl PR_SET_CHILD_SUBREAPER failed)")
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        idle = not self.warm_first_cycle
        argv = [*self.entry.interpreter, "-c", ZYGOTE_BOOTSTRAP, secrets.token_hex(8),
                str(self.cfg.run_dir.absolute()), self.entry.sys_path0(),
                ",".join(self._preload()), str(os.getpid()), "idle" if idle else "normal"]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        sink = Sink(open_log(self.log_dir / "zygote.log"), None, label="zygote")
        try:
            # A store-only zygote runs no user code: no OpenMP pool that would make it unsafe.
            env = {**self.env, "OMP_NUM_THREADS": "1"} if self.stores_only else self.env
            proc = spawn_process(argv, env, stdin=theirs.fileno())
        except OSError as exc:
            sink.close()
            ours.close()
            self._fallback(f"cannot spawn the zygote: {exc}")
            return
        finally:
            theirs.close()
        if idle:  # from its first instruction (it also sets this itself, a little later)
            try:
                os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError):
                pass
        ours.setblocking(False)
        assert proc.stdout is not None
        pump = OutputPump(proc.stdout, sink, name="ft-zygote-log").start()
        self.zygote = _Zygote(proc, ours, pump, time.monotonic(), raised=not idle)
        log.debug("zygote spawned: pid %d", proc.pid)

    def _zygote_messages(self) -> None:
        zygote = self.zygote
        assert zygote is not None
        messages, closed = zygote.messages()
        for message in messages:
            kind, _, rest = message.partition(" ")
            if kind == "ready":
                seconds, _, threads = rest.partition(" ")
                zygote.ready, self.forking = True, self.enabled
                self._request_store()
                self.event("zygote_ready", pid=zygote.proc.pid, preload=self._preload(),
                           import_s=_float(seconds), threads=_float(threads),
                           ready_s=round(time.monotonic() - zygote.started_at, 3),
                           **_memory(zygote.proc.pid))
            elif kind == "unsafe":
                self._fallback(rest)
                return
            elif kind == "failed" and self.stores_only:
                self._fallback(f"preload failed: {rest}")
                return
            elif kind == "failed":
                self._disable(f"preload failed: {rest}")
                return
            elif kind == "store":
                self._on_store(rest)
            elif kind == "storefailed":
                self._store_requested, self._store_failed = False, True
                log.info("no cycle store from the zygote: %s", rest[:200])
            else:  # forkfailed, bad request: the standby's closed pipe tells the rest
                log.warning("zygote: %s", message[:200])
        if closed and self.zygote is not None:
            code = zygote.proc.poll()
            self._fallback(f"the zygote exited (exit code {code})" if code is not None
                           else "the zygote closed its control socket")

    def _fork(self, local_rank: int) -> None:
        """Ask the zygote for a standby of ``local_rank``; its pipes travel with the request."""
        assert self.zygote is not None
        nonce = secrets.token_hex(8)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            socket.send_fds(self.zygote.ctl, [f"fork {local_rank} {nonce}".encode()],
                            [in_r, out_w])
        except OSError as exc:
            for fd in (in_w, out_r):
                os.close(fd)
            self._fallback(f"cannot reach the zygote: {exc}")
            return
        finally:
            os.close(in_r)
            os.close(out_w)
        log_path = self.log_dir / f"local_rank_{local_rank}.log"
        sink = Sink(open_log(log_path), None, label=f"standby {local_rank}")
        sb = Standby(local_rank, nonce, time.monotonic(), sink, os.fdopen(in_w, "wb", 0),
                     os.fdopen(out_r, "rb"), None, forked=True)
        self._start_pump(sb)

    def _adopt(self, sb: Standby) -> bool:
        """A forked standby's process, once it told its pid and is this launcher's child."""
        if sb.proc is None and sb.told_pid is not None:
            if _parent_of(sb.told_pid) == os.getpid():
                sb.proc = ChildProcess(sb.told_pid)
                # Its group dies with the launcher, however the launcher dies (guardian.py).
                GUARDIAN.register(sb.told_pid, str(self.cfg.run_dir))
            else:
                sb.failure = sb.failure or f"standby pid {sb.told_pid} is not the launcher's child"
        return sb.proc is not None

    def _fallback(self, reason: str) -> None:
        """Forking is out for this job: say why once, spawn standbys from now on. Forked
        standbys the launcher adopted stay (they need no zygote); the others go."""
        forked = [sb for sb in self.standbys.values()
                  if sb.forked and (sb.failure or not self._adopt(sb) or sb.ready_at is None)]
        for sb in forked:
            del self.standbys[sb.local_rank]
        if self.zygote is not None:
            self.zygote.stop()
            self.zygote = None
        self.forking = False
        self._emit("zygote_fallback", reason=reason, preload=self._preload())
        for sb in forked:
            self._kill(sb)

    # -- inside ----------------------------------------------------------------------------

    def _preload(self) -> list[str]:
        return ["torch"] if self.stores_only else self.cfg.ft.preload

    def _forks_expected(self) -> bool:
        """Whether the zygote is expected to be safe to fork, so that the first cycle may
        wait for it. torch starts its OpenMP pool at import unless ``OMP_NUM_THREADS`` is
        1 (the launcher sets that for several local ranks, as torchrun does): the zygote
        would then fall back after its whole import, and waiting for it would only have
        delayed the start. Other unsafe preloads are found out by the zygote."""
        return self.entry is not None and (
            "torch" not in self.cfg.ft.preload or self.env.get("OMP_NUM_THREADS") == "1")

    def _emit(self, name: str, **fields: Any) -> None:
        if self._held is not None:
            self._held.append((name, fields))
        else:
            self.event(name, **fields)

    def _release_events(self) -> None:
        # Events found while the launcher was being set up wait for its first event.
        held, self._held = self._held, None
        for name, fields in held or ():
            self.event(name, **fields)

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
                    self._spawn(local_rank)
                except OSError as exc:  # out of processes or files: the job goes on cold
                    self._disable(f"cannot spawn a standby: {exc}")
                    return
                starting += 1

    def _spawn(self, local_rank: int) -> None:
        assert self.entry is not None
        nonce = secrets.token_hex(8)
        argv = [*self.entry.interpreter, "-c", BOOTSTRAP, nonce, str(self.cfg.run_dir.absolute()),
                self.entry.sys_path0(), ",".join(self.cfg.ft.preload)]
        log_path = self.log_dir / f"local_rank_{local_rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sink = Sink(open_log(log_path), None, label=f"standby {local_rank}")
        try:
            proc = spawn_process(argv, self.env, stdin=subprocess.PIPE)
        except OSError:
            sink.close()
            raise
        assert proc.stdin is not None and proc.stdout is not None
        sb = Standby(local_rank, nonce, time.monotonic(), sink, proc.stdin,
                     proc.stdout, proc)
        self._start_pump(sb)

    def _start_pump(self, sb: Standby) -> None:
        sb.pump = OutputPump(sb.stdout, sb.sink, name=f"ft-standby-{sb.local_rank}",
                             on_line=_messages(sb)).start()
        self.standbys[sb.local_rank] = sb
        log.debug("standby for local rank %d %s", sb.local_rank,
                  "requested from the zygote" if sb.forked else f"spawned: pid {sb.pid}")

    def _report_ready(self, sb: Standby) -> None:
        sb.reported = True
        self._early_deaths[sb.local_rank] = 0
        assert sb.ready_at is not None and sb.pid is not None
        self.event("standby_ready", local_rank=sb.local_rank, pid=sb.pid,
                   preload=self.cfg.ft.preload, forked=sb.forked, import_s=sb.ready_s,
                   ready_s=round(sb.ready_at - sb.spawned_at, 3), threads=sb.threads,
                   **_memory(sb.pid))

    def _on_exit(self, sb: Standby) -> None:
        del self.standbys[sb.local_rank]
        if sb.proc is not None:
            _kill_group(sb.proc, wait=False)  # what it may have left in its group
        if sb.pump is not None:
            sb.pump.join(timeout=1.0)  # its last lines may say why (a failed preload)
        if sb.failure:
            self._disable(f"preload failed: {sb.failure}")
            return
        code = sb.proc.returncode if sb.proc is not None else None
        self.event("standby_died", local_rank=sb.local_rank, pid=sb.pid, forked=sb.forked,
                   was_ready=sb.ready_at is not None,
                   exit_code=code if code is None or code >= 0 else None,
                   signal=_signal_name(-code) if code is not None and code < 0 else None)
        if sb.ready_at is None:
            deaths = self._early_deaths.get(sb.local_rank, 0) + 1
            self._early_deaths[sb.local_rank] = deaths
            if deaths >= MAX_EARLY_DEATHS:
                why = (f"the standby of local rank {sb.local_rank} died {deaths} times before "
                       "it was ready")
                if sb.forked:
                    self._early_deaths.clear()
                    self._fallback(f"forked {why}")
                else:
                    self._disable(why)

    def _kill(self, sb: Standby) -> None:
        if sb.proc is not None:
            _kill_group(sb.proc)
        sb.stdin.close()

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self._emit("warm_restart_disabled", reason=reason)
        self.close()


@dataclass
class FirstCycleWait:
    """How the wait for the first cycle's standbys ended: ready (neither field set), a
    terminating signal (``signum``), or the time limit (``timed_out``)."""

    signum: int | None = None
    timed_out: bool = False


def await_first_cycle(waits: Callable[[], bool], pause: Callable[[], None],
                      pending_signal: Callable[[], int | None], limit_s: float,
                      clock: Callable[[], float] = time.monotonic) -> FirstCycleWait:
    """Wait while ``waits()`` (``StandbyPool.first_cycle_waits``), calling ``pause()``
    (sleep a little, tick the pool) between looks, at most ``limit_s`` by ``clock``.

    A stuck import must not hold the job forever (past the limit the ranks start cold),
    and a stop signal must not wait for an import to finish (it ends the wait at once).
    """
    deadline = clock() + limit_s
    while waits():
        signum = pending_signal()
        if signum is not None:
            return FirstCycleWait(signum=signum)
        if clock() >= deadline:
            return FirstCycleWait(timed_out=True)
        pause()
    return FirstCycleWait()


def _kill_group(proc: subprocess.Popen | ChildProcess, wait: bool = True) -> None:
    """SIGKILL a session leader's process group and (``wait``) reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    GUARDIAN.unregister(proc.pid)
    if wait:
        _reap(proc)


def _reap(proc: subprocess.Popen | ChildProcess) -> None:
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


def _parent_of(pid: int) -> int | None:
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


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


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
