"""Warm restart: one standby process per local rank, ready to become the next worker.

With warm restart on (the default; ``--no-ft-warm-restart`` or YAML ``warm_restart: false``
turn it off) the launcher keeps one standby per local rank that already imported the
``--ft-preload`` modules (default ``torch`` and ``torch._dynamo``) and waits
(``worker_side/activation.py`` runs inside it). A restart hands each ready standby the new
cycle's argv and environment; it runs the training script in place, so the worker skips the
interpreter start and the imports. Local ranks without a ready standby start cold.

Where standbys come from:

- **The zygote** (``worker_side/zygote.py``; the launcher's end is ``zygote_link.py``): one
  process per node, spawned when the pool is created (at launcher start), that imports the
  preloads once. Once it is ready
  (``zygote_ready``) it forks a standby per local rank, and a fresh one whenever one dies or
  was taken for a restart (as soon as the new cycle's ranks sent their first heartbeats, at
  most ``REFILL_DELAY_S`` later), so a second fault soon after a restart finds standbys
  again. A forked standby shares the imported pages copy-on-write and is ready in
  milliseconds. The first cycle waits for them (``first_cycle_waits``), so its workers are
  forks too and the node imports torch once: the zygote then imports at full priority.
  The zygote imports with ``OMP_NUM_THREADS=1``, so torch starts no OpenMP pool in it (a
  thread there would make forking unsafe); each worker made from a fork sets torch's thread
  count back to what a cold worker gets for its own environment
  (``activation.restore_thread_count``). The launcher is a child
  subreaper (``PR_SET_CHILD_SUBREAPER``) and adopts each standby, so a worker made from one
  is the launcher's own child like a cold worker (exit status, SIGCHLD, PDEATHSIG relative
  to the launcher), and the zygote's death costs no worker anything.
- **Learned preloads** (``learned_preloads.py``, ``--no-ft-preload-learn`` turns them off):
  the workers made from forks record which installed modules their script imported; ``tick``
  reads those lists when due and has the zygote fork a learner that imports them and takes
  its place (``preload_learned``; a module that fails its checks: ``preload_refused``).
  Standbys forked before are then replaced by forks of the new zygote once the cycle runs,
  each old one serving until its replacement is ready (``upgrades``).
- **Spawned standbys** (the fallback, after one ``zygote_fallback`` event saying why: the
  preloads started threads or a CUDA context, the launcher cannot adopt processes, or the
  zygote or its forks died): a fresh interpreter per local rank (``workers.spawn_process``)
  that imports the preloads itself, spawned once every rank of a cycle sent its first
  heartbeat (or ``SPAWN_DELAY_S`` passed), at most ``max(1, cores // 2)`` importing at once.

Life cycle, driven by the supervisor's loop through six calls:

- ``first_cycle_waits()``: before the first cycle, whether its start should wait (the
  supervisor ticks meanwhile, bounded, and stops on a terminating signal);
- ``take(spec)``: at a cycle's start, activate the local rank's ready standby (a Worker
  whose ``started_at`` is the activation time, so the initial-heartbeat clock starts then);
- ``cycle_started()``: the cycle's workers were started;
- ``tick(training_started)``: every loop iteration; reads the zygote's messages, reports
  ready standbys (``standby_ready`` with pid, time to ready and memory), replaces dead ones
  (``standby_died``), forks or spawns missing ones and reaps adopted orphans;
- ``tick_due(now)``: when the loop must wake for ``tick`` at the latest (``next_tick``).
  The pool is event-driven: a standby's messages and the end of its output wake the loop
  (``wake``), exits of standbys, store hosts and orphans wake it by SIGCHLD; only the
  zygote's socket is polled, while an answer from it is due. A full pool costs an idle
  launcher no wake-up;
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

import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_launcher.config import LaunchConfig
from ft_launcher.process.output import Sink
from ft_launcher.process.workers import Worker, WorkerSpec
from ft_launcher.rundir import PRIVATE_DIR, STATE_FILE
from ft_launcher.warm.learned_preloads import PreloadLearning
from ft_launcher.warm.standby_process import (
    ChildProcess,
    PythonEntry,
    Standby,
    encode_record,
    kill_group,
    reap,
    reap_orphans,
    spawn_standby,
)
from ft_launcher.warm.zygote_link import LEARN_POLL_S, StoreHosts, Zygote, ZygoteSide

log = logging.getLogger("ft_launcher")

SPAWN_DELAY_S = 5.0  # spawn standbys (raise the zygote) this long after a cycle started
# Replacement forks wait for the new cycle's first heartbeats (or this long): a fork copies
# the zygote's page tables, CPU better left to the workers that are starting.
REFILL_DELAY_S = 1.0
MAX_EARLY_DEATHS = 3  # standbys of one local rank dying before ready, in a row
STANDBY_ENV_KEYS = ("OMP_NUM_THREADS",)  # worker settings that libraries read at load time


class StandbyPool:
    """The standbys of this node; every method is a no-op when warm restart is off."""

    def __init__(self, cfg: LaunchConfig, log_dir: Path, event: Callable[..., Any],
                 wake: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``wake()`` wakes the supervisor's loop (called on a standby's output thread);
        ``clock`` times the refill and spawn delays (a test's fake clock)."""
        self.cfg, self.log_dir, self.event, self.wake, self.clock = cfg, log_dir, event, wake, clock
        self.entry = PythonEntry.parse(cfg.entrypoint)
        self.enabled = cfg.ft.warm_restart
        # Without warm restart the zygote only hosts cycle stores (single node: other nodes
        # cannot know the port), and needs nothing but torch for that.
        self.stores_only = not self.enabled and cfg.ft.agent_store and cfg.max_nodes == 1
        self.standbys: dict[int, Standby] = {}
        self.env = dict(os.environ)
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in self.env:
            self.env["OMP_NUM_THREADS"] = "1"  # what the workers get (worker_env's rule)
        self._cycle_start = clock()
        self._early_deaths: dict[int, int] = {}
        self.max_starting = max(1, (os.cpu_count() or 1) // 2)
        self._held: list[tuple[str, dict[str, Any]]] | None = []  # events before the first call
        self.zygotes = ZygoteSide(cfg.run_dir, log_dir, self._preload(), self.stores_only)
        # The first cycle's workers come from the zygote's forks (see first_cycle_waits),
        # so the zygote imports at full priority from its start.
        self.warm_first_cycle = self.enabled and forks_expected(self.entry)
        self._first_cycle = True
        # Standbys forked before the zygote learned more, being replaced: local rank -> fork.
        self.upgrades: dict[int, Standby] = {}
        self.learning = self._learning()
        if (self.enabled or self.stores_only) and self.entry is not None:
            why = self.zygotes.start(self.entry, self.env, idle=not self.warm_first_cycle,
                                     learn_dir=self.learning.directory if self.learning else None)
            if why is not None:
                self._fallback(why)

    def _learning(self) -> PreloadLearning | None:
        """Learned preloads (``--ft-preload-learn``, on by default) for a forking pool."""
        if not (self.warm_first_cycle and self.cfg.ft.preload_learn):
            return None
        run_dir = Path(self.cfg.run_dir).absolute()
        ft = self.cfg.ft
        return PreloadLearning(run_dir / PRIVATE_DIR, self.cfg.nproc_per_node,
                               Path(ft.state_path) if ft.state_path else run_dir / STATE_FILE,
                               self._preload(), self._emit, self.clock)

    @property
    def zygote(self) -> Zygote | None:
        """The zygote, while standbys or stores may come from it."""
        return self.zygotes.zygote

    @property
    def stores(self) -> StoreHosts:
        return self.zygotes.stores

    # -- the supervisor's calls ----------------------------------------------------------

    def take(self, spec: WorkerSpec, sink: Callable[[WorkerSpec], Sink]) -> Worker | None:
        """Activate the ready standby of ``spec.local_rank`` as this cycle's worker, its output
        to ``sink(spec)`` (``WorkerGroup.sink``: log, echo, drops reported as a cold worker's);
        ``tick`` forks its replacement once the new cycle trains."""
        if not self.enabled:
            return None
        self._release_events()
        self.env = standby_env(spec)
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
        record = encode_record(os.getcwd(), entry, spec.argv[n:], spec.env)
        sb.cycle_sink = sink(spec)
        try:
            sb.stdin.write(record)
            sb.stdin.close()
        except OSError:  # it died just now: tick() reports it, this rank starts cold
            sb.cycle_sink.close()
            sb.cycle_sink = None
            return None
        del self.standbys[spec.local_rank]  # tick() forks its replacement (REFILL_DELAY_S)
        upgrade = self.upgrades.pop(spec.local_rank, None)
        if upgrade is not None:  # on its way already: the rank's next standby
            self.standbys[spec.local_rank] = upgrade
        if self.learning is not None:
            self.learning.activated()
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
        if not zygote.ready or (self.learning is not None and self.learning.holds_first_cycle()):
            return True
        for local_rank in range(self.cfg.nproc_per_node):
            sb = self.standbys.get(local_rank)
            if sb is None or sb.ready_at is None or sb.told_pid is None:
                return True
        return self.stores.requested and self.cfg.max_nodes == 1

    def cycle_started(self) -> None:
        """The cycle's workers are up (spawned standbys wait until it runs, see ``tick``)."""
        self._first_cycle = False
        self._cycle_start = self.clock()
        self._release_events()
        if self.enabled and self.entry is None:
            self._disable("the training program is not a Python script (--no-python); "
                          "workers start cold")

    def tick_due(self, now: float) -> float | None:
        """When (``clock``) ``tick`` must run next at the latest; None when only news wakes
        it: SIGCHLD (a standby, store host or adopted orphan exited), or ``wake`` (a
        standby's message, the end of its output). See ``next_tick`` for the rule."""
        if not self.enabled and not self.stores_only:
            return None
        return next_tick(wants_of(self), now, self._cycle_start, self.cfg.monitor_interval)

    def tick(self, training_started: bool) -> None:
        """Zygote messages; report ready and dead standbys; fork or spawn missing ones."""
        if self.zygotes.adopting:
            reap_orphans()  # one waitid() when there is nothing to reap
        if not (self.enabled or self.stores_only):
            return
        self.stores.reap_dying()
        self._release_events()
        since_start = self.clock() - self._cycle_start
        running = training_started or since_start >= SPAWN_DELAY_S
        if self.zygote is not None:
            self._zygote_tick(running)
        if self.learning is not None and self.zygotes.forking:
            self.learning.tick(self.zygotes)
        self._check_standbys()
        self._check_upgrades()
        if not self.enabled:
            return
        holding = self.learning is not None and self.learning.holds_first_cycle()
        if self.zygotes.forking and (training_started or since_start >= REFILL_DELAY_S) \
                and not holding:
            for local_rank in range(self.cfg.nproc_per_node):
                if local_rank not in self.standbys and self.zygotes.forking:
                    self._fork(local_rank)
            self._upgrade()
        elif self.zygote is None and running:
            self._spawn_missing()

    def close(self) -> None:
        """SIGKILL every standby's process group, the store hosts and the zygote, and reap
        them. Every group is killed before the first wait, so their teardowns (tens of ms
        each for a process that holds torch) overlap instead of adding up at the job's end."""
        standbys = [*self.standbys.values(), *self.upgrades.values()]
        self.standbys.clear()
        self.upgrades.clear()
        procs: list[subprocess.Popen | ChildProcess] = [
            sb.proc for sb in standbys if self._adopt(sb) and sb.proc is not None]
        for proc in procs:
            kill_group(proc, wait=False)
        more, zygote_pump = self.zygotes.kill()
        for sb in standbys:
            sb.stdin.close()  # a forked one not yet adopted exits when it reads EOF
        for proc in procs + more:
            reap(proc)
        for pump in [sb.pump for sb in standbys] + [zygote_pump]:
            if pump is not None:
                pump.join(timeout=2.0)
        self.stores.forget()
        if self.zygotes.adopting:
            reap_orphans()

    def take_store(self) -> int | None:
        """The port of a TCPStore server that already listens, for the single-node cycle
        about to start, or None (see ``ZygoteSide.take_store`` for why and when)."""
        taken = self.zygotes.take_store()
        if taken is None:
            return None
        port, pid = taken
        self._emit("store_taken", port=port, pid=pid)
        return port

    # -- the zygote ----------------------------------------------------------------------

    def _zygote_tick(self, running: bool) -> None:
        verdict = self.zygotes.poll(self.enabled, self.event)
        if verdict is not None and verdict.action == "fallback":
            self._fallback(verdict.reason)
        elif verdict is not None:
            self._disable(verdict.reason)
        zygote = self.zygote
        # A store-only zygote stays idle until it is ready (it then raises itself): it
        # is not asked for, so it must cost a busy machine nothing (measured on 2 cores:
        # raised 5 s after the start, it cost the first step 2 s and a clean run 10 %).
        if zygote is not None and running and not zygote.raised and self.enabled:
            zygote.raise_priority()

    def _fork(self, local_rank: int, upgrade: bool = False) -> None:
        """Ask the zygote for a standby of ``local_rank`` (``upgrade``: to replace one that
        an older zygote forked, once it is ready)."""
        assert self.zygote is not None
        try:
            sb = self.zygote.request_fork(local_rank, self.log_dir)
        except OSError as exc:
            self._fallback(f"cannot reach the zygote: {exc}")
            return
        sb.generation = self.zygotes.generation
        if upgrade:
            sb.start_pump(self.wake)
            self.upgrades[local_rank] = sb
        else:
            self._start_pump(sb)

    def _upgrade(self) -> None:
        """The zygote learned preloads since these ready standbys were forked: fork their
        replacements (each old one serves until its replacement is ready)."""
        for local_rank, sb in list(self.standbys.items()):
            if sb.generation < self.zygotes.generation and sb.reported \
                    and local_rank not in self.upgrades and self.zygotes.forking:
                self._fork(local_rank, upgrade=True)

    def _check_upgrades(self) -> None:
        """A replacement that is ready takes its rank's place; the old standby goes."""
        for local_rank, sb in list(self.upgrades.items()):
            if not self.enabled or local_rank not in self.upgrades:
                return
            if sb.ready_at is not None or sb.told_pid is not None:
                self._adopt(sb)
            if sb.exited():  # the old one stays; counted as any standby's death
                self._on_exit(sb, self.upgrades)
            elif sb.failure:
                self._fallback(sb.failure)
            elif sb.ready_at is not None and sb.proc is not None:
                del self.upgrades[local_rank]
                old = self.standbys.get(local_rank)
                self.standbys[local_rank] = sb
                self._report_ready(sb)
                if old is not None and old.proc is not None:  # reaped by a later tick
                    kill_group(old.proc, wait=False)
                    self.zygotes.retired.append(old.proc)
                if old is not None:
                    old.stdin.close()

    def _adopt(self, sb: Standby) -> bool:
        return sb.adopt(str(self.cfg.run_dir))

    def _fallback(self, reason: str) -> None:
        """Forking is out for this job: say why once, spawn standbys from now on. Forked
        standbys the launcher adopted stay (they need no zygote); the others go."""
        forked = [sb for sb in self.standbys.values()
                  if sb.forked and (sb.failure or not self._adopt(sb) or sb.ready_at is None)]
        for sb in forked:
            del self.standbys[sb.local_rank]
        forked += self.upgrades.values()
        self.upgrades.clear()
        self.zygotes.stop()
        self._emit("zygote_fallback", reason=reason, preload=self._preload())
        for sb in forked:
            self._kill(sb)

    # -- inside ----------------------------------------------------------------------------

    def _preload(self) -> list[str]:
        return ["torch"] if self.stores_only else self.cfg.ft.preload

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

    def _check_standbys(self) -> None:
        """Adopt, report ready, replace dead and give up on failed standbys."""
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

    def _spawn_missing(self) -> None:
        assert self.entry is not None
        starting = sum(1 for sb in self.standbys.values() if sb.ready_at is None)
        for local_rank in range(self.cfg.nproc_per_node):
            if starting >= self.max_starting:
                return
            if local_rank not in self.standbys:
                try:
                    sb = spawn_standby(self.entry, local_rank, self.cfg.run_dir,
                                       self.cfg.ft.preload, self.env, self.log_dir)
                except OSError as exc:  # out of processes or files: the job goes on cold
                    self._disable(f"cannot spawn a standby: {exc}")
                    return
                self._start_pump(sb)
                starting += 1

    def _start_pump(self, sb: Standby) -> None:
        sb.start_pump(self.wake)
        self.standbys[sb.local_rank] = sb
        log.debug("standby for local rank %d %s", sb.local_rank,
                  "requested from the zygote" if sb.forked else f"spawned: pid {sb.pid}")

    def _report_ready(self, sb: Standby) -> None:
        sb.reported = True
        self._early_deaths[sb.local_rank] = 0
        self.event("standby_ready", local_rank=sb.local_rank, pid=sb.pid,
                   preload=self.cfg.ft.preload, generation=sb.generation, **sb.ready_fields())

    def _on_exit(self, sb: Standby, pool: dict[int, Standby] | None = None) -> None:
        """A standby (of ``pool``: the standbys, or the upgrades) exited: say so, and give up
        on a local rank whose standbys keep dying before they are ready."""
        del (self.standbys if pool is None else pool)[sb.local_rank]
        if sb.proc is not None:
            kill_group(sb.proc, wait=False)  # what it may have left in its group
        if sb.pump is not None:
            sb.pump.join(timeout=1.0)  # its last lines may say why (a failed preload)
        if sb.failure:
            self._disable(f"preload failed: {sb.failure}")
            return
        self.event("standby_died", **sb.death_fields())
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
            kill_group(sb.proc)
        sb.stdin.close()

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self._emit("warm_restart_disabled", reason=reason)
        self.close()


@dataclass(frozen=True)
class TickWants:
    """What the pool is waiting for, as far as its next ``tick`` goes."""

    zygote_answer: bool  # the zygote's readiness, a store host, a learner: polled
    refill: bool  # a local rank lacks a standby (or has a stale one), and the zygote forks
    spawn: bool  # a local rank lacks a standby, to be spawned (no zygote; under the cap)
    raise_zygote: bool  # the zygote imports at idle priority until the cycle runs
    scan_at: float | None = None  # when to read the workers' learned-preload lists
    learner: bool = False  # a learner imports: its socket is polled, every LEARN_POLL_S


def wants_of(pool: StandbyPool) -> TickWants:
    """What ``pool`` is waiting for now."""
    zygote = pool.zygote
    missing = pool.enabled and pool.entry is not None and \
        len(pool.standbys) < pool.cfg.nproc_per_node
    stale = any(sb.generation < pool.zygotes.generation and local_rank not in pool.upgrades
                for local_rank, sb in pool.standbys.items())
    starting = sum(1 for sb in pool.standbys.values() if sb.ready_at is None)
    learning = pool.learning if pool.zygotes.forking else None
    return TickWants(
        zygote_answer=pool.zygotes.answer_due(),
        refill=(missing or stale) and pool.zygotes.forking,
        spawn=missing and zygote is None and starting < pool.max_starting,
        raise_zygote=pool.enabled and zygote is not None and not zygote.raised,
        scan_at=learning.due() if learning is not None else None,
        learner=pool.zygotes.learner is not None)


def next_tick(wants: TickWants, now: float, cycle_start: float,
              interval: float) -> float | None:
    """When the pool's ``tick`` must run next at the latest (None: only on news).

    Only the zygote's socket is polled, every ``interval`` while an answer is due (its
    import at start, a store host asked for at a cycle's start), and a learner's, every
    ``LEARN_POLL_S``. The other steps have a time: a refill ``REFILL_DELAY_S`` after the
    cycle started, spawned standbys and the zygote's priority ``SPAWN_DELAY_S`` after it
    (the ranks' first heartbeats, which bring them forward, wake the loop by themselves),
    the looks at the workers' learned-preload lists at ``scan_at``. A full pool waits for
    nothing: the loop then sleeps as long as without warm restart. A step past its time
    that the last tick could not take is retried every ``interval``, never in a busy
    loop."""
    due: list[float] = []
    if wants.zygote_answer:
        due.append(now + interval)
    if wants.refill:
        due.append(cycle_start + REFILL_DELAY_S)
    if wants.spawn or wants.raise_zygote:
        due.append(cycle_start + SPAWN_DELAY_S)
    if wants.scan_at is not None:
        due.append(wants.scan_at)
    if wants.learner:
        due.append(now + max(interval, LEARN_POLL_S))
    if not due:
        return None
    first = min(due)
    return first if first > now else now + interval


def forks_expected(entry: PythonEntry | None) -> bool:
    """Whether the zygote is expected to be safe to fork, so that the first cycle may
    wait for it: whenever the training program is a Python script. The zygote imports
    with ``OMP_NUM_THREADS=1`` (``ZygoteSide.start``), so torch starts no OpenMP pool there
    whatever the workers' setting; unsafe preloads are found out by the zygote."""
    return entry is not None


def standby_env(spec: WorkerSpec) -> dict[str, str]:
    """The environment for new standbys: the launcher's, plus the worker settings that
    libraries read when they load (``STANDBY_ENV_KEYS``) as this cycle's workers got them."""
    env = dict(os.environ)
    env.update({k: spec.env[k] for k in STANDBY_ENV_KEYS if k in spec.env})
    return env


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
