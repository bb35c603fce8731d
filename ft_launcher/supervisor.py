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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import zmq

from ft_launcher import faults, policy
from ft_launcher.config import LaunchConfig
from ft_launcher.monitor import HangVerdict, Monitor
from ft_launcher.policy import CycleResult, Decision, JobState, Outcome
from ft_launcher.rendezvous import C10dRendezvous, RoundInfo, StaticRendezvous
from ft_launcher.rundir import RunDir
from ft_launcher.standby import StandbyPool
from ft_launcher.workers import Worker, WorkerGroup, WorkerSpec

log = logging.getLogger("ft_launcher")

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PASS_THROUGH_SIGNALS = (signal.SIGUSR1,)  # handed to the workers, the job goes on
TERMINATING_SIGNAL_NAMES = {signal.Signals(s).name for s in FORWARDED_SIGNALS}
SIGNAL_SETTLE_S = 0.2
MESSAGE_BATCH_S = 0.05
STACK_WAIT_S = 1.5


class _Interrupted(Exception):
    """A terminating signal arrived while the supervisor was blocked (rendezvous)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def count_gpus() -> int:
    """GPUs visible on this node, without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


class Supervisor:
    """Runs one job on this node until the policy says stop; ``run()`` returns the exit code."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.host = socket.gethostname()
        self.rundir = RunDir(cfg.run_dir, cfg.log_dir)
        self.token = secrets.token_hex(16)
        self.cycle = 0
        self.group: WorkerGroup | None = None
        self.faults_seen: list[dict[str, Any]] = []
        self.diagnoses: list[dict[str, Any]] = []
        self.worker_exits: list[dict[str, Any]] = []
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
        self._blocking = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.rdzv = self._make_rendezvous()
        state_path = Path(cfg.ft.state_path) if cfg.ft.state_path else \
            self.rundir.path / "ft_state.json"
        self.monitor = Monitor(
            endpoint=f"ipc://{self._socket_path()}",
            token=self.token,
            cfg=cfg.ft,
            state_path=state_path,
            events=lambda name, **f: self.event(name, **f),
        )
        # Warm restart (--ft-warm-restart): standby interpreters; inert when off.
        self.standbys = StandbyPool(cfg, self.rundir.logs / "standby", self.event)

    # -- setup -------------------------------------------------------------------------

    def _socket_path(self) -> Path:
        path = self.rundir.private / "monitor.sock"
        if len(str(path)) > 100:  # AF_UNIX paths are limited to about 107 bytes
            path = Path(tempfile.mkdtemp(prefix="ft_")) / "monitor.sock"  # private (0700)
        path.unlink(missing_ok=True)
        return path

    def _remove_socket(self) -> None:
        path = Path(self.monitor.endpoint[len("ipc://"):])
        path.unlink(missing_ok=True)
        if path.parent != self.rundir.private:
            shutil.rmtree(path.parent, ignore_errors=True)

    def _make_rendezvous(self) -> StaticRendezvous | C10dRendezvous:
        cfg = self.cfg
        if cfg.rdzv_backend == "c10d":
            return C10dRendezvous(cfg.rdzv_endpoint, cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes,
                                  cfg.rdzv_conf, cfg.master_port)
        return StaticRendezvous(cfg.node_rank, cfg.max_nodes, cfg.master_addr, cfg.master_port)

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """Record an event in events.jsonl and log it as one line."""
        record = self.rundir.event(name, self.cycle, **fields)
        detail = " ".join(f"{k}={v}" for k, v in fields.items() if k != "timeouts")
        log.info("cycle %d: %s %s", self.cycle, name, detail)
        return record

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
        self._install_signals()
        self.event("launcher_started", host=self.host, pid=os.getpid(),
                   nproc_per_node=self.cfg.nproc_per_node, max_restarts=self.cfg.max_restarts,
                   entrypoint=self.cfg.entrypoint + self.cfg.script_args,
                   timeouts=self.monitor.timeouts_in_force())
        decision: Decision | None = None
        result: CycleResult | None = None
        try:
            while True:
                result = self._run_cycle()
                decision = policy.decide(result, self.job)
                self.event("decision", outcome=result.outcome.value, restart=decision.restart,
                           exit_code=decision.exit_code, reason=decision.reason)
                if not decision.restart:
                    if result.outcome is not Outcome.SIGNALED:
                        self.rdzv.exit_barrier(wait=result.outcome is Outcome.SUCCEEDED)
                    break
                policy.apply(decision, self.job)
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
            self.rdzv.shutdown()
            self._remove_socket()
        assert decision is not None and decision.exit_code is not None
        self._write_summary(decision, result)
        self.event("launcher_exited", exit_code=decision.exit_code, reason=decision.reason)
        self.rundir.close()
        return decision.exit_code

    def _run_cycle(self) -> CycleResult:
        self._blocking = True
        try:
            rnd = self.rdzv.next_round()
        finally:
            self._blocking = False
        world = rnd.group_world_size * self.cfg.nproc_per_node
        self.event("rendezvous_done", group_rank=rnd.group_rank,
                   group_world_size=rnd.group_world_size, world_size=world,
                   master_addr=rnd.master_addr, master_port=rnd.master_port)
        armed = None
        if self.fault_plan is not None:
            armed = faults.arm(self.fault_plan, self.cycle, world, self.cfg.run_id)
            first = rnd.group_rank * self.cfg.nproc_per_node
            if armed is not None and not first <= armed.rank < first + self.cfg.nproc_per_node:
                armed = None  # the victim lives on another node
        group = self.group = WorkerGroup()
        group.start(self._worker_specs(rnd, armed), warm=self.standbys.take)
        self.standbys.cycle_started()
        self.monitor.start_cycle(self.cycle, group.workers, self.rundir.private)
        self.event("workers_started", ranks=[w.rank for w in group.workers],
                   pids=[w.pid for w in group.workers], device_map=self.job.device_map(),
                   warm=[w.warm for w in group.workers])
        result = self._watch(group, armed)
        if result.outcome is Outcome.SUCCEEDED:
            group.kill_all()  # exited leaders may have left children in their groups
        else:
            grace = self.cfg.term_timeout if result.outcome is Outcome.SIGNALED \
                else self.cfg.workers_stop_timeout
            signum = result.signum if result.outcome is Outcome.SIGNALED else signal.SIGTERM
            group.stop(grace, signum)  # ends with kill_all
        self.monitor.handle_messages()  # reports sent while the group was being stopped
        for w in group.workers:
            if w.exit_code is not None and not w.reported:
                self._report_exit(w, stopped=True)
        for rank, per_kind in self.monitor.end_cycle().items():
            for kind, stats in per_kind.items():
                self.event("interval_stats", rank=rank, kind=kind, **stats)
        result.diagnoses = list(self.monitor.diagnoses)
        self.diagnoses.extend(result.diagnoses)
        result.progress_iteration = self._read_progress()
        self.group = None
        return result

    def _worker_specs(self, rnd: RoundInfo, armed: faults.ArmedFault | None) -> list[WorkerSpec]:
        cfg = self.cfg
        world = rnd.group_world_size * cfg.nproc_per_node
        device_map = self.job.device_map()
        gpus = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                if d.strip()] or [str(i) for i in range(self.gpus)]
        specs = []
        for local_rank in range(cfg.nproc_per_node):
            rank = rnd.group_rank * cfg.nproc_per_node + local_rank
            env = dict(os.environ)
            env.update({
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
                "GROUP_RANK": str(rnd.group_rank),
                "GROUP_WORLD_SIZE": str(rnd.group_world_size),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(world),
                "ROLE_NAME": cfg.role,
                "MASTER_ADDR": rnd.master_addr,
                "MASTER_PORT": str(rnd.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(self.job.restarts),
                "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
                "TORCHELASTIC_RUN_ID": cfg.run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "TORCHELASTIC_ERROR_FILE": str(
                    self.rundir.cycle_log_dir(self.cycle) / f"rank_{rank}_error.json"),
                "FT_ENDPOINT": self.monitor.endpoint,
                "FT_TOKEN": self.token,
                "FT_RUN_DIR": str(self.rundir.path),
                "FT_CYCLE": str(self.cycle),
                "FT_DEVICE_ID": str(device_map[local_rank]),
            })
            env.pop("FT_SIMULATED_FAULT", None)
            if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
                env["OMP_NUM_THREADS"] = "1"
            env.setdefault("PYTHONUNBUFFERED", "1")  # output reaches the log as it happens
            if gpus:
                # cuda:LOCAL_RANK becomes the rotated device, with no change to the script.
                env["CUDA_VISIBLE_DEVICES"] = self._rotated_gpus(gpus, device_map, local_rank)
            if armed is not None and armed.rank == rank and armed.fault_type == "rank_exit":
                env["FT_SIMULATED_FAULT"] = armed.env_value()
            echo = cfg.redirects.get(local_rank, 0) == 0 or cfg.tee.get(local_rank, 0) != 0
            if cfg.local_ranks_filter is not None and local_rank not in cfg.local_ranks_filter:
                echo = False
            specs.append(WorkerSpec(local_rank, rank, cfg.entrypoint + cfg.script_args, env,
                                    self.rundir.rank_log(self.cycle, rank), echo))
        return specs

    @staticmethod
    def _rotated_gpus(gpus: list[str], device_map: list[int], local_rank: int) -> str:
        """CUDA_VISIBLE_DEVICES for a rank: its index LOCAL_RANK names device_map's device."""
        order = list(gpus)
        target = gpus[device_map[local_rank] % len(gpus)]
        order.remove(target)
        order.insert(min(local_rank, len(order)), target)
        return ",".join(order)

    def _watch(self, group: WorkerGroup, armed: faults.ArmedFault | None) -> CycleResult:
        """Sleep until something happens, then check in a fixed order what ended the cycle."""
        everything, signals_only = zmq.Poller(), zmq.Poller()
        everything.register(self.monitor.sock, zmq.POLLIN)
        for poller in (everything, signals_only):
            poller.register(self._wake_r.fileno(), zmq.POLLIN)
        interval = self.cfg.monitor_interval
        next_peer_check = time.monotonic() + interval
        batch_until = 0.0
        while True:
            timeout = interval
            deadline = self.monitor.next_deadline()
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
            if armed is not None and not armed.fired:
                timeout = min(timeout, armed.at - time.time())
            # Messages carry their send time, so they can wait a moment and be drained
            # in batches: one wake-up per MESSAGE_BATCH_S instead of one per heartbeat.
            # Signals (a worker's death) and deadlines still wake the loop at once.
            poller = everything
            if time.monotonic() < batch_until:
                poller, timeout = signals_only, min(timeout, batch_until - time.monotonic())
            poller.poll(max(0.0, timeout) * 1000)
            self._drain_wakeups()
            if self.monitor.handle_messages() and self.monitor.all_connected():
                batch_until = time.monotonic() + MESSAGE_BATCH_S
            # Before exits: a rank_exit fault and the rank's own exit happen at the same time.
            if armed is not None and not armed.fired and time.time() >= armed.at:
                self._inject(group, armed)
            result = (self._check_signals(group) or self._check_exits(group)
                      or self._check_controls() or self._check_hang(group))
            if result is not None:
                return result
            # Standbys are spawned once every rank is training (first heartbeat or section).
            self.standbys.tick(all(r.first_activity is not None
                                   for r in self.monitor.ranks.values()))
            if time.monotonic() >= next_peer_check:
                next_peer_check = time.monotonic() + interval
                if self.rdzv.num_nodes_waiting() > 0:
                    self.event("peers_waiting")
                    return CycleResult(self.cycle, Outcome.PEER_CHANGED)

    def _check_signals(self, group: WorkerGroup) -> CycleResult | None:
        for signum in self._take_signals():
            if signum in PASS_THROUGH_SIGNALS:
                for w in group.alive():
                    os.kill(w.pid, signum)
                self.event("signal_forwarded", signal=signal.Signals(signum).name)
            else:
                self.event("signal_received", signal=signal.Signals(signum).name)
                return CycleResult(self.cycle, Outcome.SIGNALED, signum=signum)
        return None

    def _check_exits(self, group: WorkerGroup) -> CycleResult | None:
        exits = [(w, self._report_exit(w)) for w in group.poll()]
        failures = [info for w, info in exits if w.exit_code != 0]
        if not failures:
            return None if group.alive() else CycleResult(self.cycle, Outcome.SUCCEEDED)
        if any(f["signal"] in TERMINATING_SIGNAL_NAMES for f in failures):
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
            self.faults_seen.append({"cycle": self.cycle, "kind": "worker_failed", **f})
        return CycleResult(self.cycle, Outcome.FAILED, failures=failures)

    def _check_controls(self) -> CycleResult | None:
        for _rank, action in self.monitor.controls:
            if action != "continue":
                return CycleResult(self.cycle, Outcome.CONTROL, control=action)
        self.monitor.controls.clear()
        return None

    def _check_hang(self, group: WorkerGroup) -> CycleResult | None:
        verdict = self.monitor.check_deadlines()
        if verdict is None:
            return None
        self._handle_hang(group, verdict)
        return CycleResult(self.cycle, Outcome.HUNG, hang=vars(verdict))

    def _take_signals(self) -> list[int]:
        taken = [s for s in self._pending if s != signal.SIGCHLD]
        self._pending.clear()
        return taken

    def _report_exit(self, w: Worker, stopped: bool = False) -> dict[str, Any]:
        w.reported = True
        self.monitor.rank_exited(w.rank)
        info = {"rank": w.rank, "local_rank": w.local_rank, "pid": w.pid, "warm": w.warm,
                **w.describe_exit()}
        self.event("worker_exited", stopped_by_launcher=stopped, **info)
        self.worker_exits.append({"cycle": self.cycle, "stopped_by_launcher": stopped, **info})
        return info

    # -- faults and hangs --------------------------------------------------------------

    def _inject(self, group: WorkerGroup, armed: faults.ArmedFault) -> None:
        armed.fired = True
        victim = next((w for w in group.workers if w.rank == armed.rank), None)
        if victim is None or not victim.alive:
            return
        if armed.fault_type != "rank_exit":
            os.kill(victim.pid, armed.signum)
        self.faults_seen.append({"cycle": self.cycle, "kind": "injected",
                                 "fault_type": armed.fault_type, "rank": armed.rank})
        self.event("fault_injected", rank=armed.rank, fault_type=armed.fault_type,
                   pid=victim.pid, at=round(armed.at, 6),
                   **({"code": armed.code} if armed.fault_type == "rank_exit" else {}))

    def _handle_hang(self, group: WorkerGroup, verdict: HangVerdict) -> None:
        self.event("hang_detected", rank=verdict.rank, timeout_kind=verdict.timeout_kind,
                   timeout_s=verdict.timeout_s, silence_s=verdict.silence_s)
        self.faults_seen.append({"cycle": self.cycle, "kind": "hang", **vars(verdict)})
        self._dump_stacks(group)
        victim = next(w for w in group.workers if w.rank == verdict.rank)
        signum = self.cfg.ft.rank_termination_signal
        group.send_signal(victim, signal.SIGCONT)
        group.send_signal(victim, signum)
        self.event("rank_killed", rank=victim.rank, pid=victim.pid,
                   signal=signal.Signals(signum).name, reason="hang")

    def _dump_stacks(self, group: WorkerGroup) -> None:
        """Stacks of every local rank: in a collective all go silent, and the culprit is
        the one whose stack is elsewhere. faulthandler where the agent armed it, py-spy for
        the others (a stopped process, or one that never connected)."""
        pyspy_procs = {}
        py_spy = shutil.which("py-spy") or shutil.which(
            "py-spy", path=os.path.dirname(sys.executable))
        # A stopped process cannot run its faulthandler; py-spy reads its memory instead.
        stopped = {w.rank for w in group.alive() if _is_stopped(w.pid)}
        offsets = self.monitor.request_stacks(skip=stopped)
        for w in group.alive():
            if w.rank not in offsets and py_spy:
                pyspy_procs[w.rank] = subprocess.Popen(
                    [py_spy, "dump", "--nonblocking", "--pid", str(w.pid)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        texts: dict[int, str] = {}
        deadline = time.monotonic() + STACK_WAIT_S
        for rank, offset in offsets.items():
            texts[rank] = _wait_for_text(lambda r=rank, o=offset: self.monitor.read_stacks(r, o),
                                         deadline)
        for rank, proc in pyspy_procs.items():
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic() + 5))
                texts[rank] = texts.get(rank) or "py-spy dump:\n" + out.decode(errors="replace")
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        dumped = []
        for rank, text in sorted(texts.items()):
            if text.strip():
                path = self.rundir.stack_file(self.cycle, rank)
                path.write_text(f"# rank {rank}, cycle {self.cycle}, "
                                f"{time.strftime('%Y-%m-%dT%H:%M:%S')}\n{text}")
                dumped.append(rank)
        self.event("stacks_dumped", ranks=dumped,
                   missing=[w.rank for w in group.alive() if w.rank not in dumped])

    # -- end of job --------------------------------------------------------------------

    def _read_progress(self) -> int | None:
        path = self.cfg.ft.checkpoint_iteration_file
        if not path:
            return None
        try:
            return int(Path(path).read_text().strip())
        except (OSError, ValueError):
            return None

    def _write_summary(self, decision: Decision, result: CycleResult | None) -> None:
        assert decision.next_action is not None
        summary = {
            "version": 1,
            "run_id": self.cfg.run_id,
            "host": self.host,
            "exit_code": decision.exit_code,
            "reason": decision.reason,
            "cycles": self.cycle + 1,
            "restarts": self.job.restarts,
            "faults": self.faults_seen,
            "workers": self.worker_exits,
            "diagnoses": self.diagnoses,
            "device_map": self.job.device_map(),
            "protocol_errors": dict(self.monitor.counters),
            "next_action": vars(decision.next_action),
        }
        try:
            self.rundir.write_summary(summary)
        except OSError as exc:
            log.error("cannot write summary.json: %s", exc)


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _wait_for_text(read: Any, deadline: float) -> str:
    """Poll a growing file until its content stops growing or the deadline passes."""
    text, stable_since = "", None
    while time.monotonic() < deadline:
        new = read()
        if new and new == text:
            if stable_since and time.monotonic() - stable_since > 0.05:
                return text
            stable_since = stable_since or time.monotonic()
        else:
            text, stable_since = new, None
        time.sleep(0.01)
    return read() or text
