"""The launcher's end of the warm-restart zygote (``worker_side/zygote.py``): starting it,
its control socket (messages in, fork, store and learn requests out), the TCPStore hosts it
forks for the cycles, and its learners, which replace it once they imported the learned
preloads (see ``standby_pool.py`` for when each is used, ``learned_preloads.py`` for
which modules are learned)."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_launcher.process.output import OutputPump, Sink, open_log
from ft_launcher.process.workers import GUARDIAN, spawn_process
from ft_launcher.warm.standby_process import (
    ChildProcess,
    PythonEntry,
    Standby,
    become_subreaper,
    float_or_none,
    kill_group,
    memory_mb,
    parent_of,
    run_dir_env,
    standby_sink,
)
from ft_launcher.warm.worker_side.learning import valid_name

log = logging.getLogger("ft_launcher")

ZYGOTE_BOOTSTRAP = "from ft_launcher.warm.worker_side.zygote import main; main()"


@dataclass
class Zygote:
    """The zygote's process, control socket and output pump."""

    proc: subprocess.Popen | ChildProcess  # a learner that took over is an adopted child
    ctl: socket.socket
    pump: OutputPump  # its output's; a learner that takes over writes to the same pipe
    started_at: float
    ready: bool = False
    raised: bool = False  # back to normal scheduling (it starts under SCHED_IDLE)

    @classmethod
    def spawn(cls, entry: PythonEntry, run_dir: Path, preload: list[str],
              env: dict[str, str], log_dir: Path, idle: bool,
              learn_dir: Path | None = None) -> Zygote:
        """Start the zygote (``idle``: under ``SCHED_IDLE``; ``learn_dir``: where its
        standbys' workers record their imports); OSError when it cannot."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [*entry.interpreter, "-c", ZYGOTE_BOOTSTRAP, secrets.token_hex(8),
                str(run_dir.absolute()), entry.sys_path0(), ",".join(preload),
                str(os.getpid()), "idle" if idle else "normal",
                str(learn_dir) if learn_dir is not None else ""]
        log_dir.mkdir(parents=True, exist_ok=True)
        sink = Sink(open_log(log_dir / "zygote.log"), None, label="zygote")
        try:
            proc = spawn_process(argv, env, stdin=theirs.fileno())
        except OSError:
            sink.close()
            ours.close()
            raise
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
        log.debug("zygote spawned: pid %d", proc.pid)
        return cls(proc, ours, pump, time.monotonic(), raised=not idle)

    def messages(self) -> tuple[list[str], bool]:
        """Packets waiting on the control socket, and whether the zygote closed it."""
        return read_packets(self.ctl)

    def request_fork(self, local_rank: int, log_dir: Path) -> Standby:
        """Ask for a standby of ``local_rank``; its pipes travel with the request (OSError:
        the zygote cannot be reached). Its output pump is not started yet."""
        nonce = secrets.token_hex(8)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            socket.send_fds(self.ctl, [f"fork {local_rank} {nonce}".encode()], [in_r, out_w])
        except OSError:
            for fd in (in_w, out_r):
                os.close(fd)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
        return Standby(local_rank, nonce, time.monotonic(), standby_sink(log_dir, local_rank),
                       os.fdopen(in_w, "wb", 0), os.fdopen(out_r, "rb"), None, forked=True)

    def raise_priority(self) -> None:
        self.raised = True
        try:
            os.sched_setscheduler(self.proc.pid, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):  # gone, or not allowed: it raises itself when ready
            pass

    def stop(self) -> None:
        self.ctl.close()
        kill_group(self.proc)
        self.pump.join(timeout=2.0)


def read_packets(ctl: socket.socket) -> tuple[list[str], bool]:
    """Packets waiting on a non-blocking control socket, and whether the peer closed it."""
    out: list[str] = []
    while True:
        try:
            data = ctl.recv(4096)
        except BlockingIOError:
            return out, False
        except OSError:
            return out, True
        if not data:
            return out, True
        out.append(data.decode(errors="replace"))


LEARN_STALL_S = 60.0  # one module's import, at most, before the learner is given up
# How often a learner's socket is polled: nothing waits for its answer, so the launcher
# need not wake every --monitor-interval for it.
LEARN_POLL_S = 0.5


@dataclass
class LearnResult:
    """How a round ended: ``refused`` (name or None, reason) when it failed, else how many
    modules were imported, in how many seconds and CPU seconds; ``pid`` of the new zygote."""

    refused: tuple[str | None, str] | None = None
    imported: int = 0
    import_s: float | None = None
    cpu_s: float | None = None
    pid: int | None = None
    warmed: list[str] = field(default_factory=list)  # the compiler's warm-ups it ran


@dataclass
class Learner:
    """A fork of the zygote importing a round of learned preloads; the next zygote if it
    succeeds (``worker_side/zygote.py``)."""

    ctl: socket.socket
    last_news: float  # its last message (a stall is judged from it)
    proc: ChildProcess | None = None
    importing: str | None = None
    done: LearnResult | None = None  # what it learned, while it waits to take over


@dataclass
class StoreHosts:
    """The cycles' TCPStore hosts, forks of the zygote: the current cycle's, the spare for
    the next one, and killed ones not reaped yet (``StandbyPool.take_store``)."""

    run_dir: Path
    current: ChildProcess | None = None
    spare: tuple[int, ChildProcess] | None = None  # port, host
    requested: bool = False
    failed: bool = False
    dying: list[ChildProcess] = field(default_factory=list)

    def request(self, zygote: Zygote | None) -> None:
        """Ask a ready zygote for the next spare, unless one is there or on its way."""
        if zygote is not None and zygote.ready and not self.requested \
                and self.spare is None and not self.failed:
            try:
                zygote.ctl.send(b"store 127.0.0.1 0")
                self.requested = True
            except OSError:
                pass  # the zygote's closed socket is seen at the next tick

    def on_store(self, rest: str) -> None:
        """``PORT PID`` of a store host that listens now: the next cycle's spare."""
        self.requested = False
        fields = rest.split()
        if len(fields) == 2 and all(f.isdigit() for f in fields) \
                and parent_of(int(fields[1])) == os.getpid():
            self.spare = (int(fields[0]), ChildProcess(int(fields[1])))
            GUARDIAN.register(int(fields[1]), str(self.run_dir))

    def on_failed(self, rest: str) -> None:
        self.requested, self.failed = False, True
        log.info("no cycle store from the zygote: %s", rest[:200])

    def take(self) -> tuple[int, int] | None:
        """End the current store and make the spare current: (port, pid), or None."""
        self.end_current()
        if self.spare is None:
            return None
        port, self.current = self.spare
        self.spare = None
        return port, self.current.pid

    def end_current(self) -> None:
        # SIGKILL now, reap later (tick, close): a restart does not wait for it.
        if self.current is not None:
            kill_group(self.current, wait=False)
            self.dying.append(self.current)
            self.current = None
        self.reap_dying()

    def reap_dying(self) -> None:
        self.dying = [p for p in self.dying if p.poll() is None]

    def processes(self) -> list[ChildProcess]:
        """Every host still to kill and reap (after ``end_current``)."""
        return [*self.dying, *([self.spare[1]] if self.spare is not None else [])]

    def forget(self) -> None:
        """After ``close`` killed and reaped ``processes()``."""
        self.dying.clear()
        self.spare = None


@dataclass
class Verdict:
    """The zygote is out for this job: ``fallback`` (spawn standbys from now on) or
    ``disable`` (warm restart off), and why."""

    action: str
    reason: str


class ZygoteSide:
    """The zygote's side of the standby pool: the zygote, whether standbys come from it
    (``forking``), the store hosts it forks, and the child-subreaper role it needs. The
    pool acts on the :class:`Verdict` when the zygote is out."""

    def __init__(self, run_dir: Path, log_dir: Path, preload: list[str],
                 stores_only: bool) -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.preload = preload
        self.stores_only = stores_only
        self.zygote: Zygote | None = None
        self.forking = False  # standbys come from the zygote (else: spawned)
        self.adopting = False  # this process is a child subreaper: it reaps adopted orphans
        self.stores = StoreHosts(run_dir)  # the cycles' TCPStore hosts (take_store)
        self.learner: Learner | None = None
        self.generation = 0  # how many learners took over: standbys of older ones are stale
        self.retired: list[subprocess.Popen | ChildProcess] = []  # zygotes replaced, to reap

    def start(self, entry: PythonEntry, env: dict[str, str], idle: bool,
              learn_dir: Path | None = None) -> str | None:
        """Become a subreaper and start the zygote; why not, when it cannot be done."""
        self.adopting = become_subreaper()
        if not self.adopting:
            return ("the launcher cannot adopt forked standbys "
                    "(prctl PR_SET_CHILD_SUBREAPER failed)")
        # One thread at import: torch's OpenMP pool, started at import unless its count
        # (MKL_NUM_THREADS, else OMP_NUM_THREADS, else the cores) is 1, would make every fork
        # unsafe. The workers get their own count back at activation
        # (activation.restore_thread_count); a store host needs no threads.
        env = {**run_dir_env(env, self.run_dir), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            self.zygote = Zygote.spawn(entry, self.run_dir, self.preload, env, self.log_dir,
                                       idle=idle, learn_dir=learn_dir)
        except OSError as exc:
            return f"cannot spawn the zygote: {exc}"
        return None

    def poll(self, enabled: bool, event: Callable[..., Any]) -> Verdict | None:
        """Act on the zygote's messages (``zygote_ready`` goes to ``event``)."""
        zygote = self.zygote
        assert zygote is not None
        messages, closed = zygote.messages()
        for message in messages:
            verdict = self._on_message(zygote, message, enabled, event)
            if verdict is not None:
                return verdict
        if closed:
            code = zygote.proc.poll()
            return Verdict("fallback", f"the zygote exited (exit code {code})"
                           if code is not None else "the zygote closed its control socket")
        return None

    def answer_due(self) -> bool:
        """Whether the zygote owes an answer (polled): its readiness, a store host."""
        zygote = self.zygote
        return zygote is not None and (not zygote.ready or self.stores.requested)

    def _on_message(self, zygote: Zygote, message: str, enabled: bool,
                    event: Callable[..., Any]) -> Verdict | None:
        kind, _, rest = message.partition(" ")
        if kind == "ready":
            seconds, _, threads = rest.partition(" ")
            zygote.ready, self.forking = True, enabled
            self.stores.request(zygote)
            event("zygote_ready", pid=zygote.proc.pid, preload=self.preload,
                  import_s=float_or_none(seconds), threads=float_or_none(threads),
                  ready_s=round(time.monotonic() - zygote.started_at, 3),
                  **memory_mb(zygote.proc.pid))
        elif kind == "unsafe":
            return Verdict("fallback", rest)
        elif kind == "failed":
            return Verdict("fallback" if self.stores_only else "disable",
                           f"preload failed: {rest}")
        elif kind == "store":
            self.stores.on_store(rest)
        elif kind == "storefailed":
            self.stores.on_failed(rest)
        else:  # forkfailed, bad request: the standby's closed pipe tells the rest
            log.warning("zygote: %s", message[:200])
        return None

    def stop(self) -> None:
        """The zygote is out: stop it; standbys are spawned from now on."""
        self._drop_learner()
        self._reap_retired(wait=True)  # first: they hold the zygote's output pipe too
        if self.zygote is not None:
            self.zygote.stop()
            self.zygote = None
        self.forking = False

    # -- learning ------------------------------------------------------------------------

    def can_learn(self) -> bool:
        """A ready zygote that forks standbys, and no learner under way."""
        return self.zygote is not None and self.zygote.ready and self.forking \
            and self.learner is None

    def start_learning(self, names: list[str]) -> str | None:
        """Ask the zygote to fork a learner for ``names``; why not, when it cannot. The
        names travel in an anonymous file (no size limit on a packet), the learner's own
        control socket with them."""
        assert self.zygote is not None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listing = os.memfd_create("ft-learn", os.MFD_CLOEXEC)
        try:
            os.write(listing, "".join(f"{n}\n" for n in names).encode())
            os.lseek(listing, 0, os.SEEK_SET)
            socket.send_fds(self.zygote.ctl, [b"learn"], [theirs.fileno(), listing])
        except OSError as exc:
            ours.close()
            return f"cannot reach the zygote: {exc}"
        finally:
            theirs.close()
            os.close(listing)
        ours.setblocking(False)
        self.learner = Learner(ours, time.monotonic())
        return None

    def learner_tick(self, now: float) -> LearnResult | None:
        """Act on the learner's messages; the round's result once it is over (a learner
        that succeeded has taken over as the zygote by then)."""
        if self.retired:
            self._reap_retired()
        learner = self.learner
        if learner is None:
            return None
        messages, closed = read_packets(learner.ctl)
        for message in messages:
            result = self._on_learner_message(learner, message, now)
            if result is not None:
                return result
        if learner.done is not None:
            return self._take_over(learner)
        if closed or (learner.proc is not None and learner.proc.poll() is not None):
            code = learner.proc.returncode if learner.proc is not None else None
            return self._learner_failed(f"the learner exited (exit code {code}) while "
                                        "importing it")
        if now - learner.last_news > LEARN_STALL_S:
            return self._learner_failed(f"its import took more than {LEARN_STALL_S:.0f} s")
        return None

    def _on_learner_message(self, learner: Learner, message: str,
                            now: float) -> LearnResult | None:
        kind, _, rest = message.partition(" ")
        learner.last_news = now
        if kind == "pid" and rest.isdigit() and learner.proc is None \
                and parent_of(int(rest)) == os.getpid():
            learner.proc = ChildProcess(int(rest))
            GUARDIAN.register(learner.proc.pid, str(self.run_dir))
        elif kind == "importing":
            learner.importing = rest
        elif kind == "refused":
            name, _, reason = rest.partition(" ")
            self._drop_learner()
            return LearnResult(refused=(name, reason))
        elif kind == "learned" and learner.proc is not None:
            fields = [*rest.split(), "", "", "", ""]
            learner.done = LearnResult(imported=int(fields[0]) if fields[0].isdigit() else 0,
                                       import_s=float_or_none(fields[1]),
                                       cpu_s=float_or_none(fields[2]), pid=learner.proc.pid,
                                       warmed=[n for n in fields[3].split(",")
                                               if valid_name(n)])
        else:
            log.warning("learner: %s", message[:200])
        return None

    def _learner_failed(self, reason: str) -> LearnResult:
        learner = self.learner
        assert learner is not None
        name = learner.importing
        self._drop_learner()
        return LearnResult(refused=(name, reason))

    def _take_over(self, learner: Learner) -> LearnResult | None:
        """The learner becomes the zygote, once the old one owes no answer (a store host it
        was asked for would otherwise be lost); the old one exits when its socket closes."""
        old = self.zygote
        if old is None or self.stores.requested:
            return None
        assert learner.proc is not None
        self.learner = None
        old.ctl.close()  # it forks what it was asked for before it reads the end, then exits
        self.retired.append(old.proc)
        self.zygote = Zygote(learner.proc, learner.ctl, old.pump, time.monotonic(),
                             ready=True, raised=True)
        self.generation += 1
        self._reap_retired()
        return learner.done

    def _drop_learner(self) -> None:
        learner, self.learner = self.learner, None
        if learner is None:
            return
        learner.ctl.close()
        if learner.proc is not None:
            kill_group(learner.proc, wait=False)
            self.retired.append(learner.proc)
        self._reap_retired()

    def _reap_retired(self, wait: bool = False) -> None:
        """Reap the replaced zygotes and given-up learners that exited (``wait``: kill and
        reap them all)."""
        for proc in self.retired:
            if wait:
                kill_group(proc)
            elif proc.poll() is not None:
                GUARDIAN.unregister(proc.pid)
        self.retired = [p for p in self.retired if p.returncode is None]

    def take_store(self) -> tuple[int, int] | None:
        """The spare store host, now the current one, as (port, pid); asks for the next.

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
        taken = self.stores.take()
        if taken is not None:
            self.stores.request(self.zygote)
        return taken

    def kill(self) -> tuple[list[subprocess.Popen | ChildProcess], OutputPump | None]:
        """SIGKILL the zygote and the store hosts without waiting; what to reap, and the
        zygote's pump to join (``StandbyPool.close``)."""
        self.stores.end_current()
        learner, self.learner = self.learner, None
        if learner is not None:
            learner.ctl.close()
        procs: list[subprocess.Popen | ChildProcess] = [
            *self.stores.processes(), *self.retired,
            *([learner.proc] if learner is not None and learner.proc is not None else [])]
        self.retired = []
        zygote, self.zygote = self.zygote, None
        if zygote is not None:
            zygote.ctl.close()
            procs.append(zygote.proc)
        for proc in procs:
            kill_group(proc, wait=False)
        self.forking = False
        return procs, zygote.pump if zygote is not None else None
