"""The node supervisor: a loop over cycles whose decisions come from ``policy.decide``.

One cycle: rendezvous -> start workers -> watch (worker exits, monitor messages and
deadlines, simulated faults, signals, other nodes) -> stop workers -> decide. Everything
runs on the main thread; the watch loop sleeps in one poll on the monitor's socket and a
signal wake-up fd, with a timeout that ends at the next deadline.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq

from ft_launcher import blame, faults, nccl_trace, policy, stacks, straggler_exchange
from ft_launcher.config import LaunchConfig
from ft_launcher.health import count_gpus, run_health_checks
from ft_launcher.ledger import Ledger
from ft_launcher.liveness import HangVerdict
from ft_launcher.metrics import MetricsExporter
from ft_launcher.monitor import Monitor, RankSlot, monotonic_of, wall_of
from ft_launcher.policy import CycleResult, Decision, JobState, Outcome, WorkerExit
from ft_launcher.rendezvous import (
    C10dRendezvous,
    RendezvousClosed,
    RendezvousLost,
    RoundInfo,
    StaticRendezvous,
)
from ft_launcher.rundir import RunDir
from ft_launcher.standby_pool import StandbyPool, await_first_cycle
from ft_launcher.status import StatusTimer, status_line
from ft_launcher.straggler import DETECTED, StragglerDetector
from ft_launcher.throttle import Throttle
from ft_launcher.timeouts import TimeoutBook, load_state
from ft_launcher.worker_env import CycleEnv, visible_gpus, worker_env
from ft_launcher.workers import Worker, WorkerGroup, WorkerSpec, handles_signal

log = logging.getLogger("ft_launcher")

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PASS_THROUGH_SIGNALS = (signal.SIGUSR1,)  # handed to the workers, the job goes on
TERMINATING_SIGNAL_NAMES = {signal.Signals(s).name for s in FORWARDED_SIGNALS}
SIGNAL_SETTLE_S = 0.2
# Outcomes after which this node does not wait at the exit barrier: it was told to stop,
# never joined, or the rendezvous is gone.
NO_EXIT_BARRIER = (Outcome.SIGNALED, Outcome.UNHEALTHY, Outcome.RENDEZVOUS_LOST,
                   Outcome.RENDEZVOUS_CLOSED)
MESSAGE_BATCH_S = 0.25
# With nothing to poll, the loop still wakes this often (each wake-up costs the launcher
# CPU; every wake-up it needs comes from a signal, a message or a deadline).
IDLE_WAKE_S = 1.0
# A flood of messages is read in bounded batches; verdicts wait for the queue to empty, but
# never longer than this (a flood cannot postpone a real hang for ever).
MAX_JUDGE_DELAY_S = 10.0
# A rank's first section times of a cycle are not scored for stragglers (warm-up noise).
STRAGGLER_WARMUP_STEPS = 5
# A rank still working this long after the stop signal ignores it, and is killed at once.
IGNORE_GRACE_S = 0.5
# The first cycle waits this long at most for the warm-restart zygote's forks (its import
# of torch takes seconds); ranks without a ready standby then start cold.
FIRST_CYCLE_WAIT_S = 60.0
STANDBY_POLL_S = 0.01  # standbys say they are ready on a pump thread: polled while waiting


class _Interrupted(Exception):
    """A terminating signal arrived while the supervisor was blocked (rendezvous)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Supervisor:
    """Runs one job on this node until the policy says stop; ``run()`` returns the exit code."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.host = socket.gethostname()
        self.rundir = RunDir(cfg.run_dir, cfg.log_dir)
        self.cycle = 0
        self.group: WorkerGroup | None = None
        self.faults_seen: list[dict[str, Any]] = []
        self.diagnoses: list[dict[str, Any]] = []
        self.worker_exits: list[dict[str, Any]] = []
        self.slots: dict[int, RankSlot] = {}
        self.fault_plan = faults.parse_fault(cfg.ft.simulated_fault) if cfg.ft.simulated_fault \
            else None
        if self.fault_plan is not None:
            faults.validate_world(self.fault_plan, cfg.max_nodes * cfg.nproc_per_node)
        self.gpus = count_gpus()
        self.job = JobState(
            max_restarts=cfg.max_restarts,
            num_devices=max(cfg.nproc_per_node, self.gpus),
            nproc=cfg.nproc_per_node,
            host=self.host,
            skip_bad_iterations=cfg.ft.skip_bad_iterations,
            max_no_progress_cycles=cfg.ft.max_no_progress_cycles,
        )
        self._pending: list[int] = []
        # Pass-through signals (SIGUSR1) not yet handed to these ranks of the cycle.
        self._owed: dict[int, set[int]] = {}
        self._blocking = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.rdzv = self._make_rendezvous()
        state_path = Path(cfg.ft.state_path) if cfg.ft.state_path else \
            self.rundir.path / "ft_state.json"
        self.socket_path = self._socket_path()
        self.monitor = Monitor(
            endpoint=f"ipc://{self.socket_path}",
            book=TimeoutBook(cfg.ft, load_state(state_path)),
            state_path=state_path,
            events=self.event,
        )
        # What the faults cost, live: the status line and the Prometheus metrics read it.
        self.ledger = Ledger()
        self.status = StatusTimer(cfg.ft.status_interval, time.time())
        self.metrics: MetricsExporter | None = None
        if cfg.ft.metrics_port:
            self.metrics = MetricsExporter(cfg.ft.metrics_addr, cfg.ft.metrics_port)
            self.metrics.set_heartbeat_ages(self._heartbeat_ages)
        # The launcher's handlers first: the zygote spawned below must start, as every cold
        # worker does, with those signals at their defaults (exec resets a handled signal;
        # one the launcher inherited ignored, e.g. SIGINT in a shell's background job,
        # would otherwise stay ignored in every warm worker).
        self._install_signals()
        # Warm restart (--ft-warm-restart): standby interpreters; inert when off.
        self.standbys = StandbyPool(cfg, self.rundir.logs / "standby", self.event)
        self.stragglers: StragglerDetector | None = None  # per cycle
        self.straggler_exchange: straggler_exchange.Exchange | None = None  # per cycle
        self.throttle: Throttle | None = None  # a rank_slow fault in progress
        # A node stopped past its keep-alive is dropped by the others: the round it joined,
        # and why a rank's stop fence found it out of that round (reason, seconds stopped).
        self._round_no = 0
        self._fenced_out: tuple[str, float] | None = None
        self.monitor.on_fence = self._answer_fence

    # -- setup -------------------------------------------------------------------------

    def _socket_path(self) -> Path:
        path = self.rundir.private / "monitor.sock"
        # AF_UNIX paths are limited to 107 bytes: else a private (0700) directory in TMPDIR,
        # or in /tmp when TMPDIR's own path is that long too.
        for base in (None, "/tmp"):
            if len(os.fsencode(path)) <= 100:
                break
            if path.parent != self.rundir.private:
                shutil.rmtree(path.parent, ignore_errors=True)
            path = Path(tempfile.mkdtemp(prefix="ft_", dir=base)) / "monitor.sock"
        path.unlink(missing_ok=True)
        return path

    def _remove_socket(self) -> None:
        path = self.socket_path
        path.unlink(missing_ok=True)
        if path.parent != self.rundir.private:
            shutil.rmtree(path.parent, ignore_errors=True)

    def _make_rendezvous(self) -> StaticRendezvous | C10dRendezvous:
        cfg = self.cfg
        if cfg.rdzv_backend in ("c10d", "etcd-v2"):
            # events: spare_waiting / spare_admitted, emitted while next_round() waits.
            return C10dRendezvous(cfg.rdzv_endpoint, cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes,
                                  cfg.rdzv_conf, cfg.master_port, backend=cfg.rdzv_backend,
                                  events=self.event)
        return StaticRendezvous(cfg.node_rank, cfg.max_nodes, cfg.master_addr, cfg.master_port)

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """Record an event in events.jsonl, log it as one line, feed the ledger and metrics."""
        record = self.rundir.event(name, self.cycle, **fields)
        detail = " ".join(f"{k}={v}" for k, v in fields.items() if k != "timeouts")
        log.info("cycle %d: %s %s", self.cycle, name, detail)
        self.ledger.add(record)
        if self.metrics is not None:
            self.metrics.observe(record)
        return record

    def _heartbeat_ages(self) -> dict[int, float]:
        """Seconds since each rank's last activity (read by the metrics' HTTP thread)."""
        now = time.monotonic()
        return {r.rank: round(now - r.floor(), 3)
                for r in list(self.monitor.liveness.ranks.values())}

    def _status(self) -> None:
        """The launcher's own line among the ranks' output, every --ft-status-interval."""
        now = time.time()
        if self.status.due(now):
            for r in self.monitor.liveness.ranks.values():
                if r.iteration is not None:
                    self.ledger.progress(r.rank, r.iteration)
            log.info("status: %s", status_line(self.ledger.summary(now), now))

    # -- signals -----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._pending.append(signum)
        if self._blocking and signum in FORWARDED_SIGNALS:
            raise _Interrupted(signum)

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for s in (*FORWARDED_SIGNALS, *PASS_THROUGH_SIGNALS, signal.SIGCHLD):
            signal.signal(s, self._on_signal)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        self.event("launcher_started", host=self.host, pid=os.getpid(),
                   nproc_per_node=self.cfg.nproc_per_node, max_restarts=self.cfg.max_restarts,
                   entrypoint=self.cfg.entrypoint + self.cfg.script_args,
                   timeouts=self.monitor.book.in_force(),
                   straggler_section=self.cfg.ft.straggler_section)
        log.info("timeouts in force: %s", self.monitor.book.describe())
        decision: Decision | None = None
        result: CycleResult | None = None
        try:
            while True:
                result = self._run_cycle()
                decision = policy.decide(result, self.job)
                self.event("decision", outcome=result.outcome.value, restart=decision.restart,
                           exit_code=decision.exit_code, reason=decision.reason)
                policy.apply(decision, self.job)
                if not decision.restart:
                    if result.outcome not in NO_EXIT_BARRIER:
                        self.rdzv.exit_barrier(wait=result.outcome is Outcome.SUCCEEDED)
                    break
                self.cycle += 1
                self.event("restart", restarts=self.job.restarts, reason=decision.reason,
                           device_map=self.job.device_map())
        except _Interrupted as exc:
            result = CycleResult(self.cycle, Outcome.SIGNALED, signum=exc.signum)
            decision = policy.decide(result, self.job)
        except Exception as exc:  # an internal failure still leaves a summary behind
            log.exception("cycle %d: launcher error", self.cycle)
            decision = policy.stop(policy.EXIT_FAILURE, f"launcher error: {exc}", requeue=True)
        finally:
            if self.group is not None:
                self.group.kill_all()
            self.standbys.close()
            self.monitor.close()
            if self.metrics is not None:
                self.metrics.close()
            # Close the rendezvous only when the job is over for every node; a node that
            # leaves alone (requeued: sick, excluded, lost) lets a spare take its place.
            self.rdzv.shutdown(close=decision is None or decision.next_action is None
                               or not decision.next_action.requeue)
            self._remove_socket()
        assert decision is not None and decision.exit_code is not None
        self._write_summary(decision, result)
        self.event("launcher_exited", exit_code=decision.exit_code, reason=decision.reason)
        self.rundir.close()
        return decision.exit_code

    def _run_cycle(self) -> CycleResult:
        ft = self.cfg.ft
        health = run_health_checks(ft.health_checks, ft.health_check_timeout, self.rundir.path,
                                   ft.min_free_space)
        if not health.ok:  # a sick node does not join: a spare takes its place
            for failure in health.failures:
                self.event("health_check_failed", **failure.event_fields())
            return CycleResult(self.cycle, Outcome.UNHEALTHY, reason=health.summary())
        signum = self._await_standbys()
        if signum is not None:
            self.event("signal_received", signal=signal.Signals(signum).name)
            return CycleResult(self.cycle, Outcome.SIGNALED, signum=signum)
        self._blocking = True
        try:
            rnd = self.rdzv.next_round()
        except RendezvousLost as exc:
            return CycleResult(self.cycle, Outcome.RENDEZVOUS_LOST, reason=str(exc))
        except RendezvousClosed as exc:
            return CycleResult(self.cycle, Outcome.RENDEZVOUS_CLOSED, reason=str(exc),
                               was_spare=exc.was_spare)
        finally:
            self._blocking = False
        self._round_no, self._fenced_out = rnd.round, None
        world = rnd.group_world_size * self.cfg.nproc_per_node
        self.event("rendezvous_done", group_rank=rnd.group_rank, round=rnd.round,
                   group_world_size=rnd.group_world_size, world_size=world,
                   master_addr=rnd.master_addr, master_port=rnd.master_port)
        armed = None
        if self.fault_plan is not None:
            armed = faults.arm(self.fault_plan, self.cycle, world, self.cfg.run_id)
            first = rnd.group_rank * self.cfg.nproc_per_node
            if armed is not None and not first <= armed.rank < first + self.cfg.nproc_per_node:
                armed = None  # the victim lives on another node
        group = self.group = WorkerGroup(events=self.event)
        specs = self._worker_specs(rnd, armed)
        # Warm restart keeps a TCPStore listening for the next single-node cycle, so no rank
        # waits out the store client's retry back-off while rank 0's store comes up.
        port = self.standbys.take_store() if rnd.group_world_size == 1 else None
        if port is not None:
            for spec in specs:
                spec.env.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
        group.start(specs, warm=self.standbys.take)
        self.standbys.cycle_started()
        # A pass-through signal that some rank of the last cycle never got is owed to the
        # new ranks (Slurm's time-limit warning still stands).
        self._pending.extend(signum for signum, ranks in self._owed.items() if ranks)
        self._owed.clear()
        for w in group.workers:
            self.slots[w.rank].pid = w.pid
        spawned = {w.rank: monotonic_of(w.started_at) for w in group.workers}
        self.monitor.start_cycle(self.cycle, [self.slots[w.rank] for w in group.workers],
                                 spawned, self.rundir.private)
        ft = self.cfg.ft
        self.stragglers = StragglerDetector(ft.straggler_threshold, ft.straggler_window,
                                            ft.straggler_section, host=self.host,
                                            warmup_steps=STRAGGLER_WARMUP_STEPS)
        self.monitor.liveness.on_section_closed = self.stragglers.observe
        self.monitor.on_device_time = self.stragglers.observe_device
        # Other nodes' medians through the rendezvous store (several nodes only).
        self.straggler_exchange = straggler_exchange.for_round(
            self.rdzv, rnd.group_rank, rnd.group_world_size, self.host)
        self.event("workers_started", ranks=[w.rank for w in group.workers],
                   pids=[w.pid for w in group.workers], device_map=self.job.device_map(),
                   warm=[w.warm for w in group.workers])
        result = self._watch(group, armed if armed is not None and armed.by_launcher else None)
        if self.throttle is not None:  # before the teardown: a stopped worker cannot exit
            self.throttle.stop()
            self.throttle = None
        if result.outcome is Outcome.SUCCEEDED:
            group.kill_all()  # exited leaders may have left children in their groups
        else:
            grace = self.cfg.term_timeout if result.outcome is Outcome.SIGNALED \
                else self.cfg.workers_stop_timeout
            # After a fault a rank that carries on is not waited for; when the launcher itself
            # is told to stop, every rank keeps the whole --term-timeout (a checkpoint).
            signaled = result.outcome is Outcome.SIGNALED
            signum = result.signum if signaled else signal.SIGTERM
            ignoring = None if signaled else self._ignoring_since(time.monotonic())
            group.stop(grace, signum, ignoring)  # ends with kill_all
        self.monitor.drain(time.monotonic())  # reports sent while the group was stopping
        late = self._check_controls() if result.outcome is Outcome.FAILED else None
        if late is not None:  # asked for just before exiting, read after the exit
            late.failures = result.failures
            result = late
        for w in group.workers:
            if w.exit_code is not None and not w.reported:
                self._report_exit(w)
        self._record_progress()
        for rank, per_kind in self.monitor.end_cycle().items():
            for kind, stats in per_kind.items():
                self.event("interval_stats", rank=rank, kind=kind, **stats)
        result.diagnoses = list(self.monitor.diagnoses)
        self.diagnoses.extend(result.diagnoses)
        result.progress_iteration = self._progress_iteration()
        self.group = None
        return result

    def _ignoring_since(self, signalled_at: float) -> Callable[[list[Worker]], list[Worker]]:
        """Which live workers ignore the stop signal: still active (heartbeats, sections,
        steps) ``IGNORE_GRACE_S`` after it. A rank that saves a checkpoint on SIGTERM goes
        quiet while it does and keeps the whole grace."""
        def ignoring(alive: list[Worker]) -> list[Worker]:
            now = time.monotonic()
            if now < signalled_at + IGNORE_GRACE_S:
                return []
            self.monitor.drain(now)
            ranks = self.monitor.liveness.ranks
            return [w for w in alive if w.rank in ranks
                    and ranks[w.rank].floor() > signalled_at + IGNORE_GRACE_S]
        return ignoring

    def _worker_specs(self, rnd: RoundInfo, armed: faults.ArmedFault | None) -> list[WorkerSpec]:
        cfg = self.cfg
        cycle = CycleEnv(
            world_size=rnd.group_world_size * cfg.nproc_per_node,
            nproc_per_node=cfg.nproc_per_node,
            group_rank=rnd.group_rank,
            group_world_size=rnd.group_world_size,
            role=cfg.role,
            master_addr=rnd.master_addr,
            master_port=rnd.master_port,
            restarts=self.job.restarts,
            max_restarts=cfg.max_restarts,
            run_id=cfg.run_id,
            endpoint=self.monitor.endpoint,
            run_dir=str(self.rundir.path),
            cycle=self.cycle,
            device_map=self.job.device_map(),
            gpus=visible_gpus(os.environ, self.gpus) if self.gpus else (),
        )
        specs, self.slots = [], {}
        for local_rank in range(cfg.nproc_per_node):
            rank = rnd.group_rank * cfg.nproc_per_node + local_rank
            # A token per rank and cycle: a hello can only claim the rank it was given to.
            token = secrets.token_hex(16)
            stack_file = self.rundir.private / f"stack_c{self.cycle}_r{rank}.raw"
            self.slots[rank] = RankSlot(rank, local_rank, pid=0, token=token,
                                        stack_file=stack_file)
            fault = armed.env_value() if armed is not None and armed.rank == rank \
                and armed.fault_type == "rank_exit" else None
            env = worker_env(
                os.environ, cycle, local_rank, token=token, stack_file=str(stack_file),
                error_file=str(self.rundir.cycle_log_dir(self.cycle) / f"rank_{rank}_error.json"),
                simulated_fault=fault)
            # NCCL's flight recorder, when the user turned it on: dumps land in ipc/.
            traces = nccl_trace.worker_env(env, self.rundir.private)
            if traces:
                nccl_trace.trace_dir(self.rundir.private)
                env.update(traces)
            env.update(self._rendezvous_env(rnd))
            echo = cfg.redirects.get(local_rank, 0) == 0 or cfg.tee.get(local_rank, 0) != 0
            if cfg.local_ranks_filter is not None and local_rank not in cfg.local_ranks_filter:
                echo = False
            specs.append(WorkerSpec(local_rank, rank, cfg.entrypoint + cfg.script_args, env,
                                    self.rundir.rank_log(self.cycle, rank), echo))
        return specs

    def _rendezvous_env(self, rnd: RoundInfo) -> dict[str, str]:
        """Where a node can be dropped (dynamic rendezvous): the stop a rank asks about
        before going on (FT_STOP_FENCE_S, see ft_agent.stop_fence) and its round."""
        fence_s = self.rdzv.stop_fence_s
        if fence_s is None:
            return {}
        return {"FT_STOP_FENCE_S": f"{fence_s:g}", "FT_RDZV_ROUND": str(rnd.round)}

    def _watch(self, group: WorkerGroup, armed: faults.ArmedFault | None) -> CycleResult:
        """Sleep until something happens, then check in a fixed order what ended the cycle."""
        everything, signals_only = zmq.Poller(), zmq.Poller()
        everything.register(self.monitor.socket, zmq.POLLIN)
        for poller in (everything, signals_only):
            poller.register(self._wake_r.fileno(), zmq.POLLIN)
        interval = self.cfg.monitor_interval
        next_peer_check = time.monotonic() + interval
        batch_until = 0.0
        queued_since: float | None = None  # when the socket last had more than one batch
        training_at: float | None = None  # wall clock: every rank showed activity
        spawned_at = max(w.started_at for w in group.workers)
        while True:
            timeout = interval if self._polls() else IDLE_WAKE_S
            deadline = self.monitor.next_deadline()
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
            if armed is not None and not armed.fired:
                due = armed.at if armed.at is not None else armed.no_agent_due(spawned_at)
                timeout = min(timeout, due - time.time())
            status_due = self.status.next_due()
            if status_due is not None:
                timeout = min(timeout, status_due - time.time())
            # Messages carry their send time, so they can wait a moment and be drained
            # in batches: one wake-up per MESSAGE_BATCH_S instead of one per heartbeat.
            # Signals (a worker's death) and deadlines still wake the loop at once.
            poller = everything
            if time.monotonic() < batch_until:
                poller, timeout = signals_only, min(timeout, batch_until - time.monotonic())
            timeout = max(0.0, timeout)
            planned = time.monotonic() + timeout
            poller.poll(timeout * 1000)
            now = time.monotonic()
            if self.monitor.woke(planned, now):
                # First of all: stopped this long, the node may have been dropped, and then
                # its workers must not run on (and write) a moment longer.
                dropped = self._out_after_stall(group, now - planned)
                self.event("launcher_stalled", late_s=round(now - planned, 3), cause="paused")
                if dropped is not None:
                    return self._dropped(dropped, now - planned)
            self._drain_wakeups()
            # Read what is queued before judging anyone: a rank's own heartbeats may wait
            # behind a burst, or behind the launcher's stall.
            read, empty = self.monitor.drain(now)
            if self._fenced_out is not None:  # a rank's stop fence found this node out
                group.kill_all()
                return self._dropped(*self._fenced_out)
            if read and self.monitor.all_connected():
                batch_until = now + MESSAGE_BATCH_S
            if empty and queued_since is not None and \
                    self.monitor.behind(now - queued_since, now):
                self.event("launcher_stalled", late_s=round(now - queued_since, 3),
                           cause="backlog")
            queued_since = None if empty else (queued_since or now)
            may_judge = queued_since is None or now - queued_since > MAX_JUDGE_DELAY_S
            if training_at is None:
                training_at = self.monitor.training_since()
                if training_at is not None:
                    self.event("training_started", at=round(training_at, 6))
            if armed is not None and not armed.fired:
                armed.start_clock(spawned_at, training_at, self.monitor.any_connected(),
                                  time.time())
                if armed.at is not None and time.time() >= armed.at:
                    self._inject(group, armed)
            # A rank's own request (exclude this node, shut down) explains its exit after it.
            result = (self._check_signals(group) or self._check_controls()
                      or self._check_exits(group) or (may_judge and self._check_hang(group))
                      or self._check_stragglers())
            if result:
                return result
            self._status()
            # Standbys are spawned once every rank is training (first heartbeat or section).
            self.standbys.tick(training_at is not None)
            if time.monotonic() >= next_peer_check:
                next_peer_check = time.monotonic() + interval
                try:
                    view = self.rdzv.poll_round()
                except RendezvousLost as exc:
                    return CycleResult(self.cycle, Outcome.RENDEZVOUS_LOST, reason=str(exc))
                if view.dropped is not None:  # stopped inside this pass, or too slow to
                    group.kill_all()  # keep alive: stale workers stop before they write
                    return self._dropped(view.dropped, time.monotonic() - now)
                if view.waiting > 0 or view.lost:
                    # lost: a node of this round stopped keeping alive (dead or frozen); its
                    # ranks are gone from the collectives, so the round re-forms without it.
                    self.event("peers_waiting", waiting=view.waiting, lost=list(view.lost))
                    return CycleResult(self.cycle, Outcome.PEER_CHANGED)

    def _await_standbys(self) -> int | None:
        """Before the first cycle with warm restart: wait until the zygote forked a ready
        standby per local rank (``StandbyPool.first_cycle_waits``), at most
        ``FIRST_CYCLE_WAIT_S``. Returns a terminating signal that arrived meanwhile."""
        def pause() -> None:
            select.select([self._wake_r], [], [], STANDBY_POLL_S)
            self._drain_wakeups()
            self.standbys.tick(True)

        wait = await_first_cycle(
            self.standbys.first_cycle_waits, pause,
            lambda: next((s for s in self._pending if s in FORWARDED_SIGNALS), None),
            FIRST_CYCLE_WAIT_S)
        if wait.timed_out:
            log.warning("cycle %d: standbys not ready after %.0f s; ranks without one "
                        "start cold", self.cycle, FIRST_CYCLE_WAIT_S)
        return wait.signum

    def _polls(self) -> bool:
        """Whether something must be polled every ``--monitor-interval``: other nodes (the
        rendezvous, the straggler exchange), the standby pool, or a rank that a SIGUSR1 is
        owed to (until it installs a handler). Worker exits and signals
        wake the loop at once (SIGCHLD), messages and deadlines by themselves."""
        return (self.rdzv.polls_peers or self.straggler_exchange is not None
                or self.standbys.needs_ticks or any(self._owed.values()))

    # -- a node dropped while it was stopped --------------------------------------------

    def _out_after_stall(self, group: WorkerGroup, stalled_s: float) -> str | None:
        """After the launcher did not run for ``stalled_s``: why this node is out of its
        round (its workers are SIGKILLed at once, before they can write a checkpoint or a
        progress file: a script without ft_agent has no stop fence), or None."""
        standing = self.rdzv.standing(stalled_s)
        if standing.current:
            return None
        group.kill_all()
        return standing.reason

    def _answer_fence(self, rank: int, stopped_s: float) -> tuple[bool, str]:
        """A rank was stopped ``stopped_s`` and asks whether its round is still current."""
        standing = self.rdzv.standing(stopped_s)
        self.event("stop_fence", rank=rank, stopped_s=round(stopped_s, 3),
                   current=standing.current, reason=standing.reason)
        if not standing.current and self._fenced_out is None:
            self._fenced_out = (standing.reason, stopped_s)
        return standing.current, standing.reason

    def _dropped(self, reason: str, frozen_s: float) -> CycleResult:
        """The others went on without this node: its workers are stopped already; it
        re-joins the rendezvous, as a hot spare when the round is full, or ends with the
        job (``RendezvousClosed``)."""
        self.rdzv.mark_dropped()
        self.event("node_dropped", round=self._round_no, reason=reason,
                   frozen_s=round(max(0.0, frozen_s), 3), next="rejoin")
        return CycleResult(self.cycle, Outcome.PEER_CHANGED, reason=f"node dropped: {reason}")

    def _check_signals(self, group: WorkerGroup) -> CycleResult | None:
        received: set[int] = set()  # offered to the ranks just now: no second look below
        for signum in self._take_signals():
            if signum in PASS_THROUGH_SIGNALS:
                received.add(signum)
                owed = self._owed.setdefault(signum, set())
                owed.update(w.rank for w in group.alive())
                if not self._pass_on(group, signum, owed) and owed:
                    self.event("signal_held", signal=signal.Signals(signum).name,
                               ranks=sorted(owed), reason="no handler installed yet")
            else:
                self.event("signal_received", signal=signal.Signals(signum).name)
                return CycleResult(self.cycle, Outcome.SIGNALED, signum=signum)
        for signum, owed in self._owed.items():
            if owed and signum not in received:
                self._pass_on(group, signum, owed)
        return None

    def _pass_on(self, group: WorkerGroup, signum: int, owed: set[int]) -> bool:
        """Hand an owed pass-through signal to each rank in ``owed`` that handles it by now
        (it leaves ``owed``); True when one did.

        Its default action kills a process, and a rank started a moment ago (the signal
        came during a restart, or while it imported) has no handler yet: it gets the signal
        once it installs one, and the job goes on meanwhile."""
        ready = [w for w in group.alive()
                 if w.rank in owed and handles_signal(w.pid, signum)]
        for w in ready:
            group.signal_process(w, w.pid, signum)
            owed.discard(w.rank)
        if ready:
            self.event("signal_forwarded", signal=signal.Signals(signum).name,
                       ranks=[w.rank for w in ready], waiting=sorted(owed))
        return bool(ready)

    def _check_exits(self, group: WorkerGroup) -> CycleResult | None:
        exits = [(w, self._report_exit(w)) for w in group.poll()]
        failures = [info for w, info in exits if w.exit_code != 0]
        if not failures:
            return None if group.alive() else CycleResult(self.cycle, Outcome.SUCCEEDED)
        if any(f.signal in TERMINATING_SIGNAL_NAMES for f in failures):
            # A scheduler (scancel, time limit) signals every process of the job at once:
            # the workers' deaths may be seen before the launcher's own signal arrives.
            time.sleep(SIGNAL_SETTLE_S)
            signaled = self._check_signals(group)
            if signaled is not None:
                return signaled
        group.poll()  # collect ranks that died in the same instant
        failures += [self._report_exit(w) for w in group.workers
                     if w.exit_code not in (None, 0) and not w.reported]
        for f in failures:
            self.faults_seen.append({"cycle": self.cycle, "kind": "worker_failed", **asdict(f)})
        return CycleResult(self.cycle, Outcome.FAILED, failures=failures)

    def _check_stragglers(self) -> CycleResult | None:
        if self.stragglers is None:
            return None
        if self.straggler_exchange is not None:
            det = self.stragglers
            for node in self.straggler_exchange.poll(det.local_medians(), det.active_clock()):
                for rank, median_s in node.medians.items():
                    det.observe_remote(rank, node.host, median_s, node.clock)
        for ev in self.stragglers.evaluate():
            self.event(ev.event, **ev.fields())
            action = self.cfg.ft.straggler_action
            if ev.event == DETECTED and action != "report":
                return CycleResult(self.cycle, Outcome.STRAGGLER, straggler=ev.fields(),
                                   action=action)
        return None

    def _check_controls(self) -> CycleResult | None:
        for _rank, action in self.monitor.take_controls():
            if action != "continue":
                return CycleResult(self.cycle, Outcome.CONTROL, control=action)
        return None

    def _check_hang(self, group: WorkerGroup) -> CycleResult | None:
        verdict = self.monitor.check(time.monotonic())
        if verdict is None:
            return None
        verdict = self._handle_hang(group, verdict)
        return CycleResult(self.cycle, Outcome.HUNG, hang=verdict)

    def _take_signals(self) -> list[int]:
        taken = [s for s in self._pending if s != signal.SIGCHLD]
        self._pending.clear()
        return taken

    def _report_exit(self, w: Worker) -> WorkerExit:
        w.reported = True
        self.monitor.rank_exited(w.rank)
        if self.stragglers is not None:
            self.stragglers.forget(w.rank)
        how = w.describe_exit()
        info = WorkerExit(w.rank, w.local_rank, w.pid, how["exit_code"], how["signal"], w.warm)
        # Stopped by the launcher only when it signalled the worker while it ran: one that
        # exited by itself during the teardown keeps its own code and cause.
        record = {"stopped_by_launcher": w.signalled, **asdict(info)}
        if how.get("output_dropped_bytes"):  # its log lost output (a full disk)
            record["output_dropped_bytes"] = how["output_dropped_bytes"]
        self.event("worker_exited", **record)
        self.worker_exits.append({"cycle": self.cycle, **record})
        return info

    # -- faults and hangs --------------------------------------------------------------

    def _inject(self, group: WorkerGroup, armed: faults.ArmedFault) -> None:
        armed.fired = True
        victim = next((w for w in group.workers if w.rank == armed.rank), None)
        if victim is None or not victim.alive:
            return
        extra: dict[str, Any] = {}
        if armed.fault_type == "rank_slow":
            # A SIGSTOP/SIGCONT budget on the victim alone (throttle.py holds a pidfd, so a
            # reused pid is never signalled); its peers' CPU use is only read.
            peers = [w.pid for w in group.workers if w is not victim and w.alive]
            try:
                self.throttle = Throttle(victim.pid, armed.factor, duration_s=armed.duration,
                                         peers=peers)
            except ProcessLookupError:
                return
            self.throttle.start()
            extra = {"factor": armed.factor, "duration": armed.duration,
                     "period_s": self.throttle.cycle.period_s}
        else:
            group.signal_process(victim, victim.pid, armed.signum)
        self.faults_seen.append({"cycle": self.cycle, "kind": "injected",
                                 "fault_type": armed.fault_type, "rank": armed.rank})
        self.event("fault_injected", rank=armed.rank, fault_type=armed.fault_type,
                   pid=victim.pid, at=round(armed.at or time.time(), 6), delay=armed.delay,
                   **extra)

    def _handle_hang(self, group: WorkerGroup, verdict: HangVerdict) -> HangVerdict:
        """Capture every rank's stacks, choose the culprit among the silent ranks, kill it.

        Returns the verdict about the culprit (it may differ from the rank whose deadline
        expired first: in a collective, every rank goes silent with the one that stopped).
        """
        detected_at, checked = time.time(), time.monotonic()
        texts = self._dump_stacks(group)
        # Silences as of the verdict, not after the stacks were taken (tens of ms).
        silent = self.monitor.liveness.silent_ranks(verdict, checked)
        alive = {w.rank: w for w in group.alive()}
        suspects = [blame.Suspect(rank, age, stacks.is_stopped(alive[rank].pid),
                                  blame.in_collective(texts.get(rank)))
                    for rank, age in silent.items() if rank in alive]
        culprit = blame.choose(suspects) if suspects else None
        expired = verdict
        if culprit is not None and culprit.rank != verdict.rank:
            r = self.monitor.liveness.ranks[culprit.rank]
            verdict = HangVerdict(culprit.rank, r.local_rank, verdict.timeout_kind,
                                  verdict.timeout_s, silent[culprit.rank])
        self.event("hang_detected", rank=verdict.rank, timeout_kind=verdict.timeout_kind,
                   timeout_s=verdict.timeout_s, silence_s=verdict.silence_s,
                   expired_rank=expired.rank, expired_silence_s=expired.silence_s,
                   detected_at=round(detected_at, 6),
                   blame=culprit.why if culprit else "expired_first",
                   suspects=culprit.suspects if culprit else [])
        self.faults_seen.append({"cycle": self.cycle, "kind": "hang", **asdict(verdict)})
        victim = alive.get(verdict.rank)
        if victim is not None:
            signum = self.cfg.ft.rank_termination_signal
            group.send_signal(victim, signal.SIGCONT)
            group.send_signal(victim, signum)
            self.event("rank_killed", rank=victim.rank, pid=victim.pid,
                       signal=signal.Signals(signum).name, reason="hang")
        return verdict

    def _dump_stacks(self, group: WorkerGroup) -> dict[int, str]:
        """Stacks of every live local rank, written to stacks/; returns them by rank."""
        alive = group.alive()
        targets = [stacks.StackTarget(w.rank, w.pid, self.monitor.agent_pid(w.rank),
                                      self.monitor.stack_file(w.rank)) for w in alive]
        by_rank = {w.rank: w for w in alive}
        # NCCL's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE set) dumps on a pipe request,
        # collected below next to the Python stacks.
        traces = nccl_trace.trace_settings(alive[0].spec.env) if alive else None
        asked_at = time.time()
        asked = nccl_trace.request_dumps(traces, list(by_rank)) if traces else []

        def signal_agent(t: stacks.StackTarget) -> bool:
            return t.agent_pid is not None and group.signal_process(
                by_rank[t.rank], t.agent_pid, stacks.STACK_SIGNAL)

        texts = stacks.capture(targets, signal_agent, stacks.find_py_spy())
        dumped = stacks.write(self.rundir.stacks, self.cycle, texts)
        self.event("stacks_dumped", ranks=dumped,
                   missing=[w.rank for w in alive if w.rank not in dumped])
        if traces is not None:
            got = nccl_trace.collect_traces(
                self.rundir.stacks, self.cycle, traces.dump_prefix, list(by_rank),
                since=asked_at, wait_s=max(0.0, asked_at + nccl_trace.WAIT_S - time.time()))
            self.event("nccl_traces_collected", ranks=sorted(got.collected), asked=asked,
                       missing=got.missing)
        return texts

    # -- end of job --------------------------------------------------------------------

    def _record_progress(self) -> None:
        """Each rank's last reported step, on record for the goodput ledger."""
        for r in self.monitor.liveness.ranks.values():
            if r.iteration is not None and r.progress_at is not None:
                self.event("last_progress", rank=r.rank, iteration=r.iteration,
                           at=round(wall_of(r.progress_at), 6))

    def _progress_iteration(self) -> int | None:
        """The checkpoint progress of this cycle, for --ft-max-no-progress-cycles: the
        checkpoint-iteration file when given, else the checkpoints the ranks reported."""
        path = self.cfg.ft.checkpoint_iteration_file
        if path:
            try:
                return int(Path(path).read_text().strip())
            except (OSError, ValueError):
                return None
        saved = [r.checkpoint for r in self.monitor.liveness.ranks.values()
                 if r.checkpoint is not None]
        return max(saved) if saved else self.job.last_iteration

    def _write_summary(self, decision: Decision, result: CycleResult | None) -> None:
        assert decision.next_action is not None
        summary = {
            "version": 1,
            "run_id": self.cfg.run_id,
            "host": self.host,
            "exit_code": decision.exit_code,
            "reason": decision.reason,
            # How the last cycle ended: a scheduler wrapper tells a node's own failure from
            # one caused by another node (rendezvous_lost: the store's host left).
            "outcome": result.outcome.value if result is not None else None,
            "cycles": self.cycle + 1,
            "restarts": self.job.restarts,
            "faults": self.faults_seen,
            "workers": self.worker_exits,
            "diagnoses": self.diagnoses,
            "device_map": self.job.device_map(),
            "protocol_errors": self.monitor.protocol_errors(),
            "next_action": vars(decision.next_action),
        }
        self.rundir.write_summary(summary)  # never raises: printed to stderr if it must
