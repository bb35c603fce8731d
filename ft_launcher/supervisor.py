"""The node supervisor: the job's loop over cycles, whose decisions come from ``policy.decide``.

The job keeps only what lives as long as the job (the journal and ledger, the monitor,
the rendezvous, the standby pool, the services its cycles call, the signals, the policy's
state) and runs one short loop: join a round -> run one cycle (``cycle.Cycle``) -> decide
-> apply -> exit barrier -> summary. Everything runs on the main thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ft_launcher import faults, policy
from ft_launcher.cycle import Cycle, CycleDeps, JobRecord
from ft_launcher.hang.monitor import Monitor
from ft_launcher.join import Joiner, make_rendezvous
from ft_launcher.journal import Journal
from ft_launcher.policy import CycleResult, Decision, JobState, Outcome
from ft_launcher.rundir import RunDir
from ft_launcher.services import job as job_services
from ft_launcher.signals import Interrupted, SignalBox

if TYPE_CHECKING:
    from ft_launcher.config import LaunchConfig

log = logging.getLogger("ft_launcher")

# Outcomes after which this node does not wait at the exit barrier: it was told to stop,
# never joined, or the rendezvous is gone.
NO_EXIT_BARRIER = (Outcome.SIGNALED, Outcome.UNHEALTHY, Outcome.RENDEZVOUS_LOST,
                   Outcome.RENDEZVOUS_CLOSED)


@dataclass
class Parts:
    """The job's collaborators that a test replaces with fakes; None: the real one."""

    monitor: Any = None  # hang.monitor.Monitor
    rdzv: Any = None  # nodes.rendezvous.StaticRendezvous | C10dRendezvous
    standbys: Any = None  # warm.standby_pool.StandbyPool
    signals: SignalBox | None = None
    gpus: Callable[[], int] | None = None  # how many GPUs this node has
    clock: Any = None  # watch.Clock
    wait: Any = None  # watch.Wait: the watch loop's sleep
    new_group: Callable[..., Any] | None = None  # process.workers.WorkerGroup
    handles_signal: Callable[[int, int], bool] | None = None
    services: Any = None  # services.seam.Services: what the cycles call (services.job)


class Supervisor:
    """Runs one job on this node until the policy says stop; ``run()`` returns the exit code.

    The collaborators default to the real ones; a test passes fakes in ``parts``."""

    def __init__(self, cfg: LaunchConfig, parts: Parts | None = None) -> None:
        parts = parts or Parts()
        self.cfg = cfg
        self.host = socket.gethostname()
        self.rundir = RunDir(cfg.run_dir, cfg.log_dir)
        self.journal = Journal(self.rundir, cfg.ft)
        self.record = JobRecord()
        self.fault_plan = faults.plan_for(cfg.ft.simulated_fault,
                                          cfg.max_nodes * cfg.nproc_per_node)
        self.signals = parts.signals or SignalBox(cfg.signals_to_handle)
        self.rdzv = parts.rdzv or make_rendezvous(cfg, self.event)
        self.socket_path: Path | None = None
        self.monitor = parts.monitor or self._make_monitor()
        self.journal.watch_heartbeats(self.monitor.heartbeat_ages)
        # The launcher's handlers first: the zygote spawned below must start, as every cold
        # worker does, with those signals at their defaults (exec resets a handled signal;
        # one the launcher inherited ignored, e.g. SIGINT in a shell's background job,
        # would otherwise stay ignored in every warm worker).
        self.signals.install()
        # Warm restart (--ft-warm-restart): standby interpreters; inert when off.
        self.standbys = parts.standbys or \
            job_services.standby_pool(cfg, self.rundir, self.event, wake=self.signals.poke)
        self.joiner = Joiner(cfg, self.rdzv, self.standbys, self.signals, self.event,
                             self.rundir.path, parts.gpus)
        self.job = JobState(
            max_restarts=cfg.max_restarts,
            num_devices=max(cfg.nproc_per_node, self.joiner.gpus),
            nproc=cfg.nproc_per_node, host=self.host,
            skip_bad_iterations=cfg.ft.skip_bad_iterations,
            max_no_progress_cycles=cfg.ft.max_no_progress_cycles,
        )
        self.services = parts.services or job_services.for_job(
            cfg, self.rundir, self.event, journal=self.journal, monitor=self.monitor,
            rdzv=self.rdzv, standbys=self.standbys, host=self.host)
        self.deps = self._cycle_deps(parts)
        self.current: Cycle | None = None

    @property
    def cycle(self) -> int:
        return self.journal.cycle

    def _make_monitor(self) -> Monitor:
        ft = self.cfg.ft
        state_path = Path(ft.state_path) if ft.state_path else self.rundir.path / "ft_state.json"
        self.socket_path = self._socket_path()
        return Monitor.for_job(f"ipc://{self.socket_path}", ft, state_path, self.event)

    def _cycle_deps(self, parts: Parts) -> CycleDeps:
        optional = {k: v for k, v in (("new_group", parts.new_group), ("clock", parts.clock),
                                      ("handles_signal", parts.handles_signal)) if v}
        return CycleDeps(
            cfg=self.cfg, rundir=self.rundir, monitor=self.monitor, rdzv=self.rdzv,
            services=self.services, signals=self.signals, events=self.event, job=self.job,
            record=self.record, fault_plan=self.fault_plan, wait=parts.wait,
            gpus=self.joiner.gpus, **optional)

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
        if path is None:
            return
        path.unlink(missing_ok=True)
        if path.parent != self.rundir.private:
            shutil.rmtree(path.parent, ignore_errors=True)

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """Record an event in events.jsonl, log it as one line, feed the ledger and metrics."""
        return self.journal.event(name, **fields)

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> int:
        self.event("launcher_started", host=self.host, pid=os.getpid(),
                   nproc_per_node=self.cfg.nproc_per_node, max_restarts=self.cfg.max_restarts,
                   entrypoint=self.cfg.entrypoint + self.cfg.script_args,
                   timeouts=self.monitor.timeouts_in_force(),
                   straggler_section=self.cfg.ft.straggler_section)
        log.info("timeouts in force: %s", self.monitor.describe_timeouts())
        decision: Decision | None = None
        result: CycleResult | None = None
        try:
            decision, result = self._loop()
        except Interrupted as exc:
            result = CycleResult(self.cycle, Outcome.SIGNALED, signum=exc.signum)
            decision = policy.decide(result, self.job)
        except Exception as exc:  # an internal failure still leaves a summary behind
            log.exception("cycle %d: launcher error", self.cycle)
            decision = policy.stop(policy.EXIT_FAILURE, f"launcher error: {exc}", requeue=True)
        finally:
            self._close(decision)
        assert decision is not None and decision.exit_code is not None
        self._write_summary(decision, result)
        self.event("launcher_exited", exit_code=decision.exit_code, reason=decision.reason)
        self.rundir.close()
        return decision.exit_code

    def _loop(self) -> tuple[Decision, CycleResult]:
        """join -> one cycle -> decide -> apply, until the policy says stop; then the exit
        barrier."""
        while True:
            result = self._run_cycle()
            decision = policy.decide(result, self.job)
            self.event("decision", outcome=result.outcome.value, restart=decision.restart,
                       exit_code=decision.exit_code, reason=decision.reason)
            policy.apply(decision, self.job)
            if not decision.restart:
                if result.outcome not in NO_EXIT_BARRIER:
                    self.rdzv.exit_barrier(wait=result.outcome is Outcome.SUCCEEDED)
                return decision, result
            self.journal.cycle += 1
            self.event("restart", restarts=self.job.restarts, reason=decision.reason,
                       device_map=self.job.device_map())

    def _run_cycle(self) -> CycleResult:
        joined = self.joiner.join(self.cycle)
        if isinstance(joined, CycleResult):
            return joined
        self.current = Cycle(self.deps, self.cycle, joined)
        result = self.current.run()
        self.current = None
        return result

    def _close(self, decision: Decision | None) -> None:
        if self.current is not None:
            self.current.abort()
        self.services.close()  # the standby pool, the job's snapshots, ...
        self.monitor.close()
        self.journal.close()
        # Close the rendezvous only when the job is over for every node; a node that
        # leaves alone (requeued: sick, excluded, lost) lets a spare take its place.
        self.rdzv.shutdown(close=decision is None or decision.next_action is None
                           or not decision.next_action.requeue)
        self._remove_socket()

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
            "faults": self.record.faults,
            "workers": self.record.workers,
            "diagnoses": self.record.diagnoses,
            "device_map": self.job.device_map(),
            "protocol_errors": self.monitor.protocol_errors(),
            "next_action": vars(decision.next_action),
        }
        self.rundir.write_summary(summary)  # never raises: printed to stderr if it must
