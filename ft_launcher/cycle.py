"""One cycle on this node: start the workers of a round, watch them, stop them.

A ``Cycle`` owns everything that dies with the cycle: the worker group, the rank slots,
the armed fault and its throttle, the hang response, the ranks stuck at their exit, its
standing among the other nodes (``peers.PeerWatch``), the round. Its ``run()`` returns a
``CycleResult`` for ``policy.decide``; what outlives the cycle (the job's records of
faults, worker exits and diagnoses) goes to the ``JobRecord`` it is given.

What the cycle only calls (snapshots, stragglers, the warm standby pool, the status line,
NCCL traces) are the job's services, reached through one seam (``services.seam``): the
cycle calls ``CycleDeps.services`` at each hook and imports none of them.

One pass of the watch loop reads, then judges in a fixed order: a launcher stall (this
node may have been dropped), the queued messages, then signals -> controls -> exits ->
hang -> the services' checks (stragglers) -> the services' ticks -> peers. A rank's own
request (exclude this node, shut down) thus explains its exit after it, and a signal from
the scheduler explains the workers' deaths.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ft_launcher import faults
from ft_launcher.hang.exit_watch import ExitWatch
from ft_launcher.hang.monitor import RankSlot, monotonic_of, wall_of
from ft_launcher.hang.response import HangResponse
from ft_launcher.peers import PeerWatch
from ft_launcher.policy import (
    CycleResult,
    JobState,
    Outcome,
    WorkerExit,
    announced_exits,
)
from ft_launcher.process.workers import Worker, WorkerGroup, handles_signal
from ft_launcher.rank_plan import cycle_env, plan_workers
from ft_launcher.services.seam import CycleStart
from ft_launcher.watch import (
    MESSAGE_BATCH_S,
    Clock,
    Wait,
    WakeInputs,
    WatchState,
    must_poll,
    next_wake,
    socket_wait,
)

if TYPE_CHECKING:
    from ft_launcher.config import LaunchConfig
    from ft_launcher.hang.liveness import HangVerdict
    from ft_launcher.nodes.rendezvous import RoundInfo
    from ft_launcher.ports import GroupPort, MonitorPort, RendezvousPort
    from ft_launcher.rundir import RunDir
    from ft_launcher.services.seam import CycleService
    from ft_launcher.signals import SignalBox

SIGNAL_SETTLE_S = 0.2
# A rank still working this long after the stop signal ignores it, and is killed at once.
IGNORE_GRACE_S = 0.5


@dataclass
class JobRecord:
    """What the job's summary lists, appended to by each cycle."""

    faults: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    diagnoses: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CycleDeps:
    """The job-lifetime collaborators a cycle uses (tests pass fakes for the monitor, the
    rendezvous, the services, the worker group, the clock and the wait)."""

    cfg: LaunchConfig
    rundir: RunDir
    monitor: MonitorPort  # monitor.Monitor
    rdzv: RendezvousPort  # rendezvous.StaticRendezvous | C10dRendezvous
    services: CycleService  # services.job.for_job: what the cycle only calls
    signals: SignalBox
    events: Callable[..., Any]
    job: JobState
    record: JobRecord
    fault_plan: faults.FaultPlan | None = None  # --ft-simulated-fault
    wait: Wait | None = None  # None: a poll on the monitor's socket and the signal fd
    gpus: int = 0
    clock: Clock = field(default_factory=Clock)
    new_group: Callable[..., GroupPort] = WorkerGroup
    handles_signal: Callable[[int, int], bool] = handles_signal

    def __post_init__(self) -> None:
        if self.wait is None:
            self.wait = socket_wait(self.monitor.socket, self.signals.wake_fd())


def arm_fault(plan: faults.FaultPlan | None, cycle: int, rnd: RoundInfo,
              cfg: LaunchConfig) -> faults.ArmedFault | None:
    """The simulated fault of this cycle when its victim is one of this node's ranks."""
    if plan is None:
        return None
    armed = faults.arm(plan, cycle, rnd.group_world_size * cfg.nproc_per_node, cfg.run_id)
    first = rnd.group_rank * cfg.nproc_per_node
    if armed is not None and not first <= armed.rank < first + cfg.nproc_per_node:
        return None  # the victim lives on another node
    return armed


def earliest(*times: float | None) -> float | None:
    """The earliest of the times given (None ones ignored), None when there is none."""
    known = [t for t in times if t is not None]
    return min(known) if known else None


def ignoring_since(monitor: Any, clock: Clock,
                   signalled_at: float) -> Callable[[list[Worker]], list[Worker]]:
    """Which live workers ignore the stop signal: still active (heartbeats, sections,
    steps) ``IGNORE_GRACE_S`` after it. A rank that saves a checkpoint on SIGTERM goes
    quiet while it does and keeps the whole grace."""
    def ignoring(alive: list[Worker]) -> list[Worker]:
        now = clock.monotonic()
        if now < signalled_at + IGNORE_GRACE_S:
            return []
        monitor.drain(clock.monotonic)
        active = monitor.last_activity()
        return [w for w in alive if w.rank in active
                and active[w.rank] > signalled_at + IGNORE_GRACE_S]
    return ignoring


def progress_iteration(cfg: LaunchConfig, monitor: Any, job: JobState) -> int | None:
    """The checkpoint progress of a cycle, for --ft-max-no-progress-cycles: the
    checkpoint-iteration file when given, else the checkpoints the ranks reported."""
    path = cfg.ft.checkpoint_iteration_file
    if path:
        try:
            return int(Path(path).read_text().strip())
        except (OSError, ValueError):
            return None
    saved = monitor.checkpoints()
    return max(saved) if saved else job.last_iteration


class StuckExits:
    """Ranks that said goodbye in an ending cycle but do not exit themselves
    (``exit_watch``): their stacks are dumped and the cycle ends (its teardown ends them):
    it succeeded after a peer's clean exit, and failed as announced after an exit 16/17 was
    announced (the policy judges the announcement)."""

    def __init__(self, d: CycleDeps, cycle: int, hang: HangResponse) -> None:
        self.d, self.cycle, self.hang = d, cycle, hang
        self.watch = ExitWatch(d.cfg.workers_exit_timeout)

    def check(self, group: GroupPort) -> CycleResult | None:
        workers = group.workers
        exited_ok = any(w.exit_code == 0 for w in workers)
        announced = bool(announced_exits(self.d.monitor.diagnoses))
        stuck = self.watch.overdue(self.d.clock.monotonic(), exited_ok or announced,
                                   {w.rank for w in workers if w.alive},
                                   self.d.monitor.goodbye_ranks())
        if not stuck:
            return None
        self.hang.dump_stacks(group)
        self.d.events("exit_stuck", ranks=stuck, waited_s=self.watch.grace_s)
        return CycleResult(self.cycle, Outcome.FAILED if announced and not exited_ok
                           else Outcome.SUCCEEDED)


class Cycle:
    """One cycle of one round on this node; ``run()`` returns how it ended."""

    def __init__(self, d: CycleDeps, number: int, rnd: RoundInfo) -> None:
        self.d, self.number, self.rnd = d, number, rnd
        self.armed = arm_fault(d.fault_plan, number, rnd, d.cfg)
        self.services = d.services
        self.group: GroupPort = d.new_group(events=d.events)
        self.slots: dict[int, RankSlot] = {}
        self.throttle: Any = None  # a rank_slow fault in progress
        self.hang = HangResponse(d.monitor, d.rundir.stacks, number,
                                 d.cfg.ft.rank_termination_signal, d.events, host=d.job.host,
                                 verdicts=d.rdzv.verdict_channel(rnd))
        self.peers = PeerWatch(d.rdzv, d.events, d.clock.monotonic, number, rnd,
                               answer=lambda v: self.hang.answer_peer(self.group, v),
                               faults=d.record.faults)
        self.stuck = StuckExits(d, number, self.hang)

    def run(self) -> CycleResult:
        self.start()
        return self.finish(self.watch())

    def abort(self) -> None:
        """The launcher itself failed: kill whatever this cycle started."""
        self.group.kill_all()

    # -- start and teardown ------------------------------------------------------------

    def start(self) -> None:
        d, rnd, services = self.d, self.rnd, self.services
        n = d.cfg.nproc_per_node
        services.begin(CycleStart(self.number, rnd,
                                  tuple(rnd.group_rank * n + i for i in range(n))))
        feeds = services.feeds()
        d.monitor.report_handlers.update(feeds.reports)
        shared = cycle_env(d.cfg, d.rundir, d.job, d.monitor.endpoint, d.gpus, self.number,
                           rnd)
        plans = plan_workers(d.cfg, d.rundir, shared, self.armed, self.worker_env)
        self.group.start([p.spec for p in plans], warm=services.take_worker)
        services.started(self.group.workers)
        d.signals.carry_over()
        by_rank = {p.spec.rank: p for p in plans}
        self.slots = {w.rank: RankSlot(w.rank, w.local_rank, pid=w.pid,
                                       token=by_rank[w.rank].token,
                                       stack_file=by_rank[w.rank].stack_file)
                      for w in self.group.workers}
        spawned = {w.rank: monotonic_of(w.started_at) for w in self.group.workers}
        d.monitor.start_cycle(self.number, [self.slots[w.rank] for w in self.group.workers],
                              spawned, d.rundir.private,
                              on_section_closed=feeds.section_closed,
                              on_device_time=feeds.device_time,
                              on_fence=self.peers.answer_fence)
        workers = self.group.workers
        d.events("workers_started", ranks=[w.rank for w in workers],
                 pids=[w.pid for w in workers], device_map=d.job.device_map(),
                 warm=[w.warm for w in workers])

    def worker_env(self, rank: int, env: Mapping[str, str]) -> dict[str, str]:
        """What the stop fence and the services add to ``rank``'s environment."""
        added = self.peers.worker_env()
        return {**added, **self.services.worker_env(rank, {**env, **added})}

    def finish(self, result: CycleResult) -> CycleResult:
        """Stop the workers, read what they said last, close the cycle's books."""
        d = self.d
        self.stop_workers(result)
        faults.report_not_fired(self.armed, self.group.workers, d.clock.time(), self.number,
                                d.events)
        d.monitor.drain(d.clock.monotonic)  # reports sent while the group was stopping
        late = self.check_controls() if result.outcome is Outcome.FAILED else None
        if late is not None:  # asked for just before exiting, read after the exit
            late.failures = result.failures
            result = late
        for w in self.group.workers:
            if w.exit_code is not None and not w.reported:
                self.report_exit(w)
        for rank, (iteration, at) in d.monitor.last_progress().items():
            d.events("last_progress", rank=rank, iteration=iteration,
                     at=round(wall_of(at), 6))
        for rank, per_kind in d.monitor.end_cycle().items():
            for kind, stats in per_kind.items():
                d.events("interval_stats", rank=rank, kind=kind, **stats)
        result.diagnoses = list(d.monitor.diagnoses)
        d.record.diagnoses.extend(result.diagnoses)
        result.progress_iteration = progress_iteration(d.cfg, d.monitor, d.job)
        self.services.ended(result)
        return result

    def stop_workers(self, result: CycleResult) -> None:
        if self.throttle is not None:  # before the teardown: a stopped worker cannot exit
            self.throttle.stop()
            self.throttle = None
        if result.outcome is Outcome.SUCCEEDED:
            self.group.kill_all()  # exited leaders may have left children in their groups
            return
        # After a fault a rank that carries on is not waited for; when the launcher itself
        # is told to stop, every rank keeps the whole --term-timeout (a checkpoint).
        signaled = result.outcome is Outcome.SIGNALED
        grace = self.d.cfg.term_timeout if signaled else self.d.cfg.workers_stop_timeout
        signum = result.signum if signaled else signal.SIGTERM
        ignoring = None if signaled else \
            ignoring_since(self.d.monitor, self.d.clock, self.d.clock.monotonic())
        self.group.stop(grace, signum, ignoring)  # ends with kill_all

    # -- the watch loop ----------------------------------------------------------------

    def watch(self) -> CycleResult:
        """Sleep until something happens, then check in a fixed order what ended the cycle."""
        clock = self.d.clock
        state = WatchState(spawned_at=max(w.started_at for w in self.group.workers),
                           next_peer_check=clock.monotonic() + self.d.cfg.monitor_interval)
        while True:
            wake = next_wake(self.wake_inputs(state))
            planned = clock.monotonic() + wake.timeout
            self.d.wait(wake.timeout, wake.signals_only)  # type: ignore[misc]
            result = self.one_pass(state, planned)
            if result is not None:
                return result

    def wake_inputs(self, state: WatchState) -> WakeInputs:
        d, armed = self.d, self.armed
        fault_due = None if armed is None else armed.due()
        polls = must_poll(d.rdzv.polls_peers, self.services.polls(), d.signals.any_owed())
        now, wall = d.clock.monotonic(), d.clock.time()
        return WakeInputs(now=now, wall=wall, interval=d.cfg.monitor_interval, polls=polls,
                          deadline=earliest(d.monitor.next_deadline(), self.stuck.watch.deadline()),
                          fault_due=fault_due, batch_until=state.batch_until,
                          services_due=self.services.due(now, wall))

    def one_pass(self, state: WatchState, planned: float) -> CycleResult | None:
        """Read, then judge: signals -> controls -> exits -> hang -> the services' checks;
        then the services' ticks, and the peers every --monitor-interval."""
        now = self.d.clock.monotonic()
        result = self.read(state, planned, now)
        if result is not None:
            return result
        may_judge = self.note_backlog(state, now)
        self.note_training(state)
        self.maybe_inject(state)
        result = (self.check_signals() or self.check_controls() or self.check_exits()
                  or self.stuck.check(self.group) or (may_judge and self.check_hang(now))
                  or self.services.check())
        if result:
            return result
        self.services.tick(now, state.training_at is not None)
        if self.d.clock.monotonic() >= state.next_peer_check:
            state.next_peer_check = self.d.clock.monotonic() + self.d.cfg.monitor_interval
            return self.peers.poll(self.group, now)
        return None

    def read(self, state: WatchState, planned: float, now: float) -> CycleResult | None:
        """A stall first (stopped this long, the node may have been dropped, and then its
        workers must not run on a moment longer); then everything queued, before judging
        anyone: a rank's own heartbeats may wait behind a burst or the launcher's stall."""
        d = self.d
        if d.monitor.woke(planned, now):
            dropped = self.peers.out_after_stall(self.group, now - planned)
            d.events("launcher_stalled", late_s=round(now - planned, 3), cause="paused")
            if dropped is not None:
                return self.peers.dropped(dropped, now - planned)
        d.signals.drain_wakeups()
        read, empty = d.monitor.drain(d.clock.monotonic)
        if self.peers.fenced_out is not None:  # a rank's stop fence found this node out
            self.group.kill_all()
            return self.peers.dropped(*self.peers.fenced_out)
        if read and d.monitor.all_connected():
            state.batch_until = now + MESSAGE_BATCH_S
        state.empty = empty
        return None

    def note_backlog(self, state: WatchState, now: float) -> bool:
        """A queue that was behind and is empty now was a stall; whether to judge now."""
        empty = state.empty
        if empty and state.queued_since is not None and \
                self.d.monitor.behind(now - state.queued_since, now):
            self.d.events("launcher_stalled", late_s=round(now - state.queued_since, 3),
                          cause="backlog")
        return state.note_queue(empty, now)

    def note_training(self, state: WatchState) -> None:
        if state.training_at is None:
            state.training_at = self.d.monitor.training_since()
            if state.training_at is not None:
                self.d.events("training_started", at=round(state.training_at, 6))

    def maybe_inject(self, state: WatchState) -> None:
        armed, d = self.armed, self.d
        if armed is None or not armed.by_launcher or armed.fired:
            return
        armed.start_clock(state.spawned_at, state.training_at, d.monitor.any_connected(),
                          d.clock.time())
        if armed.at is not None and d.clock.time() >= armed.at:
            injected = faults.inject(self.group, armed, self.number, d.events,
                                     times_sections=d.monitor.closed_a_section)
            if injected is not None:
                self.throttle = injected.throttle
                d.record.faults.append(injected.record)

    # -- the checks, in the order of a pass ----------------------------------------------

    def check_signals(self) -> CycleResult | None:
        signals, group = self.d.signals, self.group
        received: set[int] = set()  # offered to the ranks just now: no second look below
        for signum in signals.take():
            if signum not in signals.passed_on:
                self.d.events("signal_received", signal=signal.Signals(signum).name)
                return CycleResult(self.number, Outcome.SIGNALED, signum=signum)
            received.add(signum)
            owed = signals.owe(signum, (w.rank for w in group.alive()))
            if not self.pass_on(signum, owed) and owed:
                self.d.events("signal_held", signal=signal.Signals(signum).name,
                              ranks=sorted(owed), reason="no handler installed yet")
        for signum, owed in signals.owed.items():
            if owed and signum not in received:
                self.pass_on(signum, owed)
        return None

    def pass_on(self, signum: int, owed: set[int]) -> bool:
        """Hand an owed pass-through signal to each rank in ``owed`` that handles it by now
        (it leaves ``owed``); True when one did.

        Its default action kills a process, and a rank started a moment ago (the signal
        came during a restart, or while it imported) has no handler yet: it gets the signal
        once it installs one, and the job goes on meanwhile."""
        ready = [w for w in self.group.alive()
                 if w.rank in owed and self.d.handles_signal(w.pid, signum)]
        for w in ready:
            self.group.signal_process(w, w.pid, signum)
            owed.discard(w.rank)
        if ready:
            self.d.events("signal_forwarded", signal=signal.Signals(signum).name,
                          ranks=[w.rank for w in ready], waiting=sorted(owed))
        return bool(ready)

    def check_controls(self) -> CycleResult | None:
        for _rank, action in self.d.monitor.take_controls():
            if action != "continue":
                return CycleResult(self.number, Outcome.CONTROL, control=action)
        return None

    def check_exits(self) -> CycleResult | None:
        group = self.group
        exits = [(w, self.report_exit(w)) for w in group.poll()]
        failures = [info for w, info in exits if w.exit_code != 0]
        if not failures:
            return None if group.alive() else CycleResult(self.number, Outcome.SUCCEEDED)
        if any(f.signal in self.d.signals.stop_names for f in failures):
            # A scheduler (scancel, time limit) signals every process of the job at once:
            # the workers' deaths may be seen before the launcher's own signal arrives.
            self.d.clock.sleep(SIGNAL_SETTLE_S)
            signaled = self.check_signals()
            if signaled is not None:
                return signaled
        group.poll()  # collect ranks that died in the same instant
        failures += [self.report_exit(w) for w in group.workers
                     if w.exit_code not in (None, 0) and not w.reported]
        for f in failures:
            self.d.record.faults.append({"cycle": self.number, "kind": "worker_failed",
                                         **asdict(f)})
        return CycleResult(self.number, Outcome.FAILED, failures=failures)

    def report_exit(self, w: Worker) -> WorkerExit:
        w.reported = True
        self.d.monitor.rank_exited(w.rank)
        self.services.worker_exited(w)
        how = w.describe_exit()
        info = WorkerExit(w.rank, w.local_rank, w.pid, how["exit_code"], how["signal"], w.warm)
        # Stopped by the launcher only when it signalled the worker while it ran: one that
        # exited by itself during the teardown keeps its own code and cause.
        record = {"stopped_by_launcher": w.signalled, **asdict(info)}
        if how.get("output_dropped_bytes"):  # its log lost output (a full disk)
            record["output_dropped_bytes"] = how["output_dropped_bytes"]
        self.d.events("worker_exited", **record)
        self.d.record.workers.append({"cycle": self.number, **record})
        return info

    def check_hang(self, read_at: float) -> CycleResult | None:
        """A verdict on the ranks, unless the launcher itself was stopped since it began
        reading its socket at ``read_at``: what the ranks sent meanwhile is still unread."""
        now = self.d.clock.monotonic()
        if self.d.monitor.behind(now - read_at, now):
            self.d.events("launcher_stalled", late_s=round(now - read_at, 3), cause="paused")
            return None
        verdict: HangVerdict | None = self.d.monitor.check(now)
        if verdict is None:
            return None
        named = self.hang.respond(self.group, verdict)
        if self.peers.is_peer(named):  # another node's rank: nothing was killed here
            return self.peers.peer_result(named)
        self.d.record.faults.append({"cycle": self.number, "kind": "hang",
                                     "host": self.d.job.host, **asdict(named)})
        return CycleResult(self.number, Outcome.HUNG, hang=named)
