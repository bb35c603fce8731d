"""The supervisor's loop, driven from inside: fakes for the worker group, the monitor, the
rendezvous and the standby pool, a fake clock and a scripted wait (as torch elastic's
tests drive its agent with scripted run results). No process, socket or real sleep: each
case runs in milliseconds. The real RunDir records the events, read back from events.jsonl;
the job's real services (services.job.for_job) run over the fakes, and a recording service
shows the cycle calls each hook of the seam.

The end-to-end tests (test_launcher.py, test_stalls.py, multinode/...) prove the wiring;
these prove the order of the checks and what each path records.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ft_launcher.config import FaultToleranceConfig, LaunchConfig
from ft_launcher.hang import response as hang
from ft_launcher.hang.liveness import HangVerdict
from ft_launcher.nodes.records import Verdict
from ft_launcher.nodes.rendezvous import RoundInfo, RoundView, Standing
from ft_launcher.policy import CycleResult
from ft_launcher.process.workers import Worker, WorkerSpec
from ft_launcher.rundir import read_events
from ft_launcher.services.seam import CycleService, CycleStart, RankFeeds, Services
from ft_launcher.signals import SignalBox
from ft_launcher.supervisor import Parts, Supervisor
from ft_launcher.watch import IDLE_WAKE_S, MESSAGE_BATCH_S, WakeInputs, must_poll, next_wake

T0_WALL = 1_700_000_000.0


# -- fakes -------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.after_sleep: Callable[[], Any] = lambda: None

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return T0_WALL + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.after_sleep()


@dataclass
class FakeProc:
    pid: int
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


class FakeGroup:
    """The WorkerGroup API over fake processes; a test ends them with ``exit``."""

    pids = iter(range(40_000, 50_000))

    def __init__(self, events: Callable[..., Any] | None = None, clock: FakeClock | None = None,
                 log: list[Any] | None = None) -> None:
        self.workers: list[Worker] = []
        self.clock = clock
        self.log = log if log is not None else []
        self.stopped = False

    def start(self, specs: list[WorkerSpec], warm: Any = None) -> None:
        started = self.clock.time() if self.clock else T0_WALL
        for s in specs:  # as WorkerGroup.start: a warm source first, else a cold spawn
            taken = warm(s, lambda spec: None) if warm is not None else None
            self.workers.append(taken or Worker(spec=s, proc=FakeProc(next(self.pids)),
                                                started_at=started))  # type: ignore[arg-type]

    def exit(self, rank: int, code: int) -> None:
        next(w for w in self.workers if w.rank == rank).proc.code = code  # type: ignore

    def poll(self) -> list[Worker]:
        exited = []
        for w in self.workers:
            if w.alive and w.proc.poll() is not None:
                w.exit_code = w.proc.poll()
                exited.append(w)
        return exited

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.alive]

    def send_signal(self, worker: Worker, signum: int) -> None:
        self.log.append(("killpg", worker.rank, signum))

    def signal_process(self, worker: Worker, pid: int, signum: int) -> bool:
        self.log.append(("kill", worker.rank, signum))
        return True

    def stop(self, grace: float, signum: int = signal.SIGTERM, ignoring: Any = None) -> None:
        self.log.append(("stop", signum))
        self.stopped = True
        self.kill_all(-signum)

    def kill_all(self, code: int = -signal.SIGKILL) -> None:
        self.poll()
        for w in self.workers:
            if w.alive:
                w.signalled = True
                w.proc.code = code  # type: ignore[attr-defined]
        self.poll()
        self.stopped = True


class FakeMonitor:
    endpoint = "ipc:///nowhere"
    socket = None

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.controls: list[tuple[int, str]] = []
        self.controls_after_stop: list[tuple[int, str]] = []
        self.verdict: HangVerdict | None = None
        self.verdict_at: float | None = None
        self.stall_over = 1.0  # a wake this much after the planned one is a stall
        self.callbacks: dict[str, Any] = {}
        self.report_handlers: dict[str, Any] = {}
        self.diagnoses: list[dict[str, Any]] = []
        self.group: FakeGroup | None = None
        self.training = True
        self.silent: dict[int, float] = {}
        self.goodbyes: set[int] = set()
        self.stop_after_read_at: float | None = None  # the launcher stopped after a read
        self.unread = False

    def start_cycle(self, cycle: int, slots: list[Any], spawned: dict[int, float],
                    private_dir: Path, **callbacks: Any) -> None:
        self.slots = slots
        self.callbacks = callbacks

    def drain(self, clock: Callable[[], float], budget: int = 0) -> tuple[int, bool]:
        if self.group is not None and self.group.stopped and self.controls_after_stop:
            self.controls += self.controls_after_stop
            self.controls_after_stop = []
        if self.stop_after_read_at is not None and self.clock.now >= self.stop_after_read_at:
            # SIGSTOPped right after this read, for 5 s: the rank's heartbeat read last is
            # then past its timeout, and the ones it sent meanwhile wait unread.
            self.stop_after_read_at = None
            self.clock.now += 5.0
            self.verdict_at, self.unread = self.clock.now, True
        elif self.unread:
            self.unread, self.verdict, self.verdict_at = False, None, None  # read now
        return 0, True

    def woke(self, planned: float, now: float) -> bool:
        return self.behind(now - planned, now)

    def behind(self, seconds: float, now: float) -> bool:
        return seconds > self.stall_over

    def next_deadline(self) -> float | None:
        return self.verdict_at

    def check(self, now: float) -> HangVerdict | None:
        if self.verdict_at is not None and now >= self.verdict_at:
            return self.verdict
        return None

    def training_since(self) -> float | None:
        return T0_WALL if self.training else None

    def any_connected(self) -> bool:
        return self.training  # a script that never trains here never said hello either

    def closed_a_section(self, rank: int) -> bool:
        return False

    def all_connected(self) -> bool:
        return True

    def goodbye_ranks(self) -> set[int]:
        return set(self.goodbyes)

    def take_controls(self) -> list[tuple[int, str]]:
        taken, self.controls = self.controls, []
        return taken

    def rank_exited(self, rank: int) -> None:
        pass

    def end_cycle(self) -> dict[int, Any]:
        return {}

    def last_progress(self) -> dict[int, tuple[int, float]]:
        return {}

    def last_activity(self) -> dict[int, float]:
        return {}

    def checkpoints(self) -> list[int]:
        return []

    def silent_ranks(self, verdict: HangVerdict, now: float) -> dict[int, float]:
        return self.silent or {verdict.rank: verdict.silence_s}

    def local_rank(self, rank: int) -> int:
        return rank % 2

    def agent_pid(self, rank: int) -> int | None:
        return None

    def stack_file(self, rank: int) -> Path | None:
        return None

    def timeouts_in_force(self) -> dict[str, Any]:
        return {}

    def describe_timeouts(self) -> str:
        return ""

    def protocol_errors(self) -> dict[str, Any]:
        return {}

    def progress(self) -> dict[int, int]:
        return {}

    def heartbeat_ages(self) -> dict[int, float]:
        return {}

    def close(self) -> None:
        pass


class FakeRendezvous:
    stop_fence_s = None
    round_store = None
    job_store = None
    local_addr = "127.0.0.1"
    node_name = "fake-node"
    verdicts: Any = None  # a FakeVerdicts: the round's hang verdict is shared

    def __init__(self) -> None:
        self.polls_peers = False
        self.rounds = 0
        self.standing_answer = Standing(True)
        self.views: list[RoundView] = []
        self.dropped = 0
        self.barrier: list[bool] = []
        self.closed: bool | None = None

    def next_round(self) -> RoundInfo:
        self.rounds += 1
        return RoundInfo(0, 1, "127.0.0.1", 29500, round=self.rounds)

    def standing(self, stalled_s: float) -> Standing:
        return self.standing_answer

    def poll_round(self) -> RoundView:
        return self.views.pop(0) if self.views else RoundView()

    def mark_dropped(self) -> None:
        self.dropped += 1

    def verdict_channel(self, rnd: RoundInfo) -> Any:
        return self.verdicts

    def exit_barrier(self, wait: bool, timeout: float = 300.0) -> None:
        self.barrier.append(wait)

    def shutdown(self, close: bool = True) -> None:
        self.closed = close


class FakeStandbys:
    def tick_due(self, now: float) -> None:
        return None

    def take_store(self) -> None:
        return None

    def take(self, spec: WorkerSpec, sink: Any) -> None:
        return None

    def cycle_started(self) -> None:
        pass

    def tick(self, training: bool) -> None:
        pass

    def first_cycle_waits(self) -> bool:
        return False

    def close(self) -> None:
        pass


class QuietSignals(SignalBox):
    """The real signal box, minus the process-wide handlers (a test delivers by hand)."""

    def install(self) -> None:
        pass


@dataclass
class Harness:
    """One supervisor on fakes; ``script`` maps a time (seconds after the start) to what
    happens then, run by the fake wait when the clock passes it."""

    tmp_path: Path
    nproc: int = 2
    max_restarts: int = 0
    ft: dict[str, Any] = field(default_factory=dict)
    clock: FakeClock = field(default_factory=FakeClock)
    log: list[Any] = field(default_factory=list)
    waits: list[tuple[float, bool]] = field(default_factory=list)
    script: list[tuple[float, Callable[[], Any]]] = field(default_factory=list)
    stalls: dict[int, float] = field(default_factory=dict)  # wait number -> extra seconds
    handles: Callable[[int, int], bool] = lambda pid, signum: True  # noqa: E731
    services: Any = None  # None: the job's own (services.job.for_job)

    def __post_init__(self) -> None:
        self.monitor = FakeMonitor(self.clock)
        self.rdzv = FakeRendezvous()
        self.signals = QuietSignals()
        self.groups: list[FakeGroup] = []
        self.start = self.clock.now
        self.clock.after_sleep = self.run_due

    def at(self, t: float, action: Callable[[], Any]) -> None:
        self.script.append((self.start + t, action))
        self.script.sort(key=lambda x: x[0])

    @property
    def group(self) -> FakeGroup:
        return self.groups[-1]

    def new_group(self, events: Any = None) -> FakeGroup:
        group = FakeGroup(events, self.clock, self.log)
        self.groups.append(group)
        self.monitor.group = group
        return group

    def wait(self, timeout: float, signals_only: bool) -> None:
        self.waits.append((timeout, signals_only))
        assert len(self.waits) < 20_000, "the loop never ended"
        until = self.clock.now + timeout
        if self.script and self.script[0][0] < until:
            until = max(self.clock.now, self.script[0][0])
        self.clock.now = until + self.stalls.pop(len(self.waits), 0.0)
        self.run_due()

    def run_due(self) -> None:
        while self.script and self.script[0][0] <= self.clock.now:
            self.script.pop(0)[1]()

    def run(self) -> tuple[int, list[dict[str, Any]]]:
        cfg = LaunchConfig(entrypoint=["python", "train.py"], script_args=[],
                           nproc_per_node=self.nproc, max_restarts=self.max_restarts,
                           run_id="loop", run_dir=self.tmp_path / "run",
                           ft=FaultToleranceConfig(**self.ft))
        parts = Parts(monitor=self.monitor, rdzv=self.rdzv, standbys=FakeStandbys(),
                      signals=self.signals, gpus=lambda: 0, clock=self.clock,
                      wait=self.wait, new_group=self.new_group, handles_signal=self.handles,
                      services=self.services)
        sup = Supervisor(cfg, parts)
        code = sup.run()
        return code, read_events(sup.rundir.path)


def names(events: list[dict[str, Any]], *wanted: str) -> list[str]:
    return [e["event"] for e in events if not wanted or e["event"] in wanted]


def only(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


@pytest.fixture(autouse=True)
def _no_stack_capture(monkeypatch):
    """No py-spy or agent signal for the fake pids: stacks come back empty."""
    monkeypatch.setattr(hang.stacks, "capture", lambda targets, signal_agent, py_spy: {})
    monkeypatch.setattr(hang.stacks, "find_py_spy", lambda: None)


# -- the cycle's outcomes ------------------------------------------------------------------


def test_all_ranks_exit_zero_succeeds_and_waits_at_the_exit_barrier(tmp_path):
    h = Harness(tmp_path)
    h.at(3.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0
    assert names(events) == [
        "launcher_started", "rendezvous_done", "snapshots_ready", "snapshot_picked",
        "workers_started", "training_started", "worker_exited", "worker_exited", "decision",
        "launcher_exited"]
    assert h.rdzv.barrier == [True] and h.rdzv.closed is True


def test_a_crash_restarts_and_the_next_cycle_succeeds(tmp_path):
    h = Harness(tmp_path, max_restarts=1)
    h.at(1.0, lambda: h.group.exit(1, 3))
    h.at(5.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0
    first = only(events, "worker_exited")[0]
    assert (first["rank"], first["exit_code"], first["stopped_by_launcher"]) == (1, 3, False)
    # The survivor was stopped with SIGTERM by the launcher, then the restart.
    assert ("stop", signal.SIGTERM) in h.log
    assert [e["outcome"] for e in only(events, "decision")] == ["failed", "succeeded"]
    assert names(events, "decision", "restart", "workers_started") == [
        "workers_started", "decision", "restart", "workers_started", "decision"]
    assert [e["cycle"] for e in only(events, "workers_started")] == [0, 1]


def test_the_restart_budget_exhausted_ends_the_job_with_the_failure(tmp_path):
    h = Harness(tmp_path, max_restarts=2)
    for t in (1.0, 2.0, 3.0):
        h.at(t, lambda: h.group.exit(0, 1))
    code, events = h.run()
    assert code == 1
    decisions = only(events, "decision")
    assert [d["restart"] for d in decisions] == [True, True, False]
    assert len(only(events, "restart")) == 2
    assert h.rdzv.barrier == [False]  # a failed node still waits for the others' exit
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"restarts": 2' in summary and '"cycles": 3' in summary


def test_a_hang_is_answered_with_stacks_blame_and_a_kill_of_the_culprit(tmp_path):
    h = Harness(tmp_path)
    h.monitor.verdict = HangVerdict(0, 0, "heartbeat", 2.0, 2.5)
    h.monitor.verdict_at = h.start + 2.0
    # Both silent; rank 1 longer: in a collective the one that stopped first is blamed.
    h.monitor.silent = {0: 2.5, 1: 7.0}
    code, events = h.run()
    assert names(events, "stacks_dumped", "hang_detected", "rank_killed", "decision") == [
        "stacks_dumped", "hang_detected", "rank_killed", "decision"]
    hung = only(events, "hang_detected")[0]
    assert (hung["rank"], hung["expired_rank"]) == (1, 0)
    assert only(events, "rank_killed")[0]["rank"] == 1
    assert ("killpg", 1, signal.SIGKILL) in h.log  # the default --ft-rank-termination-signal
    assert only(events, "decision")[0]["outcome"] == "hung"
    # The loop woke at the deadline, not a poll interval later.
    assert h.clock.now - h.start == pytest.approx(2.0)


class FakeVerdicts:
    """The round's shared verdict (``nodes.verdicts.VerdictChannel``'s shape): ``decide``
    returns ``winner`` (None: this node's own claim), and every call is logged."""

    nodes = 2

    def __init__(self, log: list[Any], winner: Verdict | None = None,
                 on_decide: Callable[[], Any] = lambda: None) -> None:
        self.log, self.winner, self.on_decide = log, winner, on_decide

    def claim(self, rank: int, blame: str, timeout_kind: str, silence_s: float) -> Verdict:
        return Verdict(rank, "me", "here", 0, blame, timeout_kind, silence_s)

    def decide(self, claim: Verdict) -> Verdict:
        self.log.append(("decide", claim.rank, claim.blame))
        self.on_decide()
        return self.winner or claim

    def announce(self, verdict: Verdict) -> None:
        self.log.append(("announce", verdict.rank))

    def await_answers(self) -> int:
        self.log.append(("answers",))
        return 1

    def answer(self) -> None:
        self.log.append(("answer",))


OTHERS = Verdict(3, "peer-node", "elsewhere", 1, "stopped", "heartbeat", 4.0)


def test_with_several_nodes_the_culprits_node_tells_the_others_before_it_kills(tmp_path):
    h = Harness(tmp_path)
    h.rdzv.verdicts = FakeVerdicts(h.log)
    h.monitor.verdict = HangVerdict(1, 1, "heartbeat", 2.0, 2.5)
    h.monitor.verdict_at = h.start + 2.0
    h.monitor.silent = {1: 2.5}
    code, events = h.run()
    steps = [e for e in h.log if e[0] in ("decide", "announce", "answers", "killpg")]
    assert steps == [("decide", 1, "oldest_activity"), ("announce", 1), ("answers",),
                     ("killpg", 1, signal.SIGCONT), ("killpg", 1, signal.SIGKILL)]
    assert only(events, "rank_killed")[0]["peers_answered"] == 1
    assert only(events, "decision")[0]["outcome"] == "hung"


def test_another_nodes_stronger_verdict_kills_nothing_here(tmp_path):
    h = Harness(tmp_path, max_restarts=0)
    # The new round trains on: this node's monitor judges nobody again.
    h.rdzv.verdicts = FakeVerdicts(h.log, winner=OTHERS, on_decide=lambda: (
        setattr(h.monitor, "verdict", None), setattr(h.monitor, "verdict_at", None)))
    h.monitor.verdict = HangVerdict(0, 0, "heartbeat", 2.0, 2.5)
    h.monitor.verdict_at = h.start + 2.0
    h.monitor.silent = {0: 2.5, 1: 2.4}
    h.at(3.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)) if len(h.groups) == 2
         else None)
    code, events = h.run()
    assert code == 0  # the restart for the new round is not counted against --max-restarts
    assert names(events, "hang_detected", "rank_killed") == []
    peer = only(events, "peer_verdict")[0]
    assert (peer["rank"], peer["host"], peer["blame"]) == (3, "elsewhere", "stopped")
    assert ("answer",) in h.log and not [e for e in h.log if e[0] == "killpg" and e[2] ==
                                         signal.SIGKILL]
    assert [e["outcome"] for e in only(events, "decision")] == ["peer_changed", "succeeded"]
    faults = json.loads((tmp_path / "run" / "summary.json").read_text())["faults"]
    assert [(f["kind"], f["host"], f["rank"]) for f in faults] == [
        ("peer_hang", "elsewhere", 3)]


def test_a_verdict_that_reaches_this_node_through_the_round_is_answered(tmp_path):
    h = Harness(tmp_path)
    h.rdzv.polls_peers = True
    h.rdzv.verdicts = FakeVerdicts(h.log)
    h.at(1.0, lambda: h.rdzv.views.append(RoundView(why="hang", verdict=asdict(OTHERS))))
    h.at(3.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)) if len(h.groups) == 2
         else None)
    code, events = h.run()
    assert code == 0
    assert names(events, "stacks_dumped", "peer_verdict", "decision")[:3] == [
        "stacks_dumped", "peer_verdict", "decision"]
    assert ("answer",) in h.log and names(events, "rank_killed") == []


def test_a_control_message_ends_the_cycle_before_an_exit_in_the_same_pass(tmp_path):
    h = Harness(tmp_path)

    def both() -> None:
        h.monitor.controls.append((0, "shutdown"))
        h.group.exit(0, 1)
    h.at(1.0, both)
    code, events = h.run()
    decision = only(events, "decision")[0]
    assert decision["outcome"] == "control"


def test_a_control_message_read_after_the_exit_explains_it(tmp_path):
    h = Harness(tmp_path, max_restarts=3)
    h.monitor.controls_after_stop.append((0, "exclude_node"))
    h.at(1.0, lambda: h.group.exit(0, 1))
    code, events = h.run()
    decision = only(events, "decision")[0]
    assert decision["outcome"] == "control"  # not "failed": no restart of this node
    assert not decision["restart"]
    assert only(events, "worker_exited")[0]["rank"] == 0


def test_signals_come_before_exits_in_one_pass(tmp_path):
    h = Harness(tmp_path, max_restarts=3)

    def scancel() -> None:  # a scheduler stops the job as a rank fails
        h.group.exit(0, 1)
        h.signals.on_signal(signal.SIGTERM)
    h.at(1.0, scancel)
    code, events = h.run()
    assert only(events, "decision")[0]["outcome"] == "signaled"
    assert only(events, "signal_received")[0]["signal"] == "SIGTERM"
    assert h.rdzv.barrier == []  # told to stop: no exit barrier


def test_a_rank_killed_by_sigterm_waits_a_moment_for_the_launchers_own_signal(tmp_path):
    h = Harness(tmp_path, max_restarts=3)
    h.at(1.0, lambda: h.group.exit(0, -signal.SIGTERM))  # scancel reached the rank first
    h.at(1.1, lambda: h.signals.on_signal(signal.SIGTERM))  # within SIGNAL_SETTLE_S
    code, events = h.run()
    assert only(events, "decision")[0]["outcome"] == "signaled"
    assert names(events, "worker_exited", "signal_received") == [
        "worker_exited", "signal_received", "worker_exited"]


def test_a_rank_killed_by_sigterm_without_the_launchers_signal_is_a_failure(tmp_path):
    h = Harness(tmp_path)
    h.at(1.0, lambda: h.group.exit(0, -signal.SIGTERM))
    code, events = h.run()
    assert only(events, "decision")[0]["outcome"] == "failed"
    assert h.clock.now - h.start == pytest.approx(1.0 + 0.2)  # the settle, then judged


def test_sigusr1_is_held_until_a_rank_has_a_handler_and_the_job_goes_on(tmp_path):
    handler_since = 100.0 + 3.0
    clock = FakeClock()
    h = Harness(tmp_path, clock=clock,
                handles=lambda pid, signum: clock.now >= handler_since)
    h.at(1.0, lambda: h.signals.on_signal(signal.SIGUSR1))
    h.at(6.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0
    held = only(events, "signal_held")
    assert [(e["signal"], e["ranks"]) for e in held] == [("SIGUSR1", [0, 1])]
    forwarded = only(events, "signal_forwarded")
    assert [(e["ranks"], e["waiting"]) for e in forwarded] == [([0, 1], [])]
    assert ("kill", 0, signal.SIGUSR1) in h.log and ("kill", 1, signal.SIGUSR1) in h.log
    # While owed, the loop polls every --monitor-interval (no exit or message would wake it).
    held_waits = [t for t, _ in h.waits[1:]]
    assert held_waits and max(held_waits[:5]) <= 0.1 + 1e-9


def test_sigusr1_to_a_rank_that_handles_it_is_forwarded_at_once(tmp_path):
    h = Harness(tmp_path)
    h.at(1.0, lambda: h.signals.on_signal(signal.SIGUSR1))
    h.at(2.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert names(events, "signal_held", "signal_forwarded") == ["signal_forwarded"]


def test_a_launcher_stall_is_recorded_and_the_cycle_goes_on_while_the_round_stands(tmp_path):
    h = Harness(tmp_path)
    h.stalls[3] = 5.0  # the third sleep lasts 5 s longer (SIGSTOP, a loaded host)
    h.at(20.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0
    stalled = only(events, "launcher_stalled")
    assert [(e["cause"], e["late_s"]) for e in stalled] == [("paused", 5.0)]
    assert names(events, "node_dropped") == []


def test_a_stall_between_reading_and_judging_judges_no_one(tmp_path):
    h = Harness(tmp_path)
    h.monitor.verdict = HangVerdict(0, 0, "heartbeat", 2.0, 5.0)
    h.monitor.stop_after_read_at = h.start + 1.0
    h.at(10.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0 and names(events, "hang_detected") == []
    stalled = only(events, "launcher_stalled")
    assert [(e["cause"], e["late_s"]) for e in stalled] == [("paused", 5.0)]


def test_a_node_dropped_during_a_stall_kills_its_workers_and_rejoins(tmp_path):
    h = Harness(tmp_path)
    h.stalls[3] = 30.0
    h.rdzv.standing_answer = Standing(False, "round 1 is over")

    def next_cycle_ends() -> None:
        if len(h.groups) == 2:
            h.group.exit(0, 0)
            h.group.exit(1, 0)
    h.at(60.0, next_cycle_ends)
    code, events = h.run()
    assert code == 0
    # Killed before anything else happens: the stall is recorded, then the drop.
    assert names(events, "launcher_stalled", "node_dropped", "decision", "restart") == [
        "launcher_stalled", "node_dropped", "decision", "restart", "decision"]
    dropped = only(events, "node_dropped")[0]
    assert (dropped["round"], dropped["frozen_s"], dropped["next"]) == (1, 30.0, "rejoin")
    assert only(events, "decision")[0]["outcome"] == "peer_changed"
    assert h.rdzv.dropped == 1 and h.rdzv.rounds == 2
    assert all(w.signalled for w in h.groups[0].workers)  # SIGKILLed by kill_all


def test_a_node_dropped_while_it_ran_is_seen_by_the_peer_poll(tmp_path):
    h = Harness(tmp_path)
    h.rdzv.polls_peers = True
    h.at(1.0, lambda: h.rdzv.views.append(RoundView(dropped="keep-alive lapsed")))
    h.at(3.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)) if len(h.groups) == 2
         else None)
    code, events = h.run()
    assert only(events, "node_dropped")[0]["reason"] == "keep-alive lapsed"
    assert code == 0


def test_peers_waiting_end_the_cycle_for_a_new_round(tmp_path):
    h = Harness(tmp_path)
    h.rdzv.polls_peers = True
    h.at(1.0, lambda: h.rdzv.views.append(RoundView(waiting=1)))
    h.at(3.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)) if len(h.groups) == 2
         else None)
    code, events = h.run()
    assert only(events, "peers_waiting")[0]["waiting"] == 1
    assert [e["outcome"] for e in only(events, "decision")] == ["peer_changed", "succeeded"]


def test_a_stop_fence_that_finds_the_node_out_drops_it(tmp_path):
    h = Harness(tmp_path)
    h.rdzv.standing_answer = Standing(False, "round 1 is over")
    h.at(1.0, lambda: h.monitor.callbacks["on_fence"](1, 12.0))
    h.at(3.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)) if len(h.groups) == 2
         else None)
    code, events = h.run()
    assert names(events, "stop_fence", "node_dropped") == ["stop_fence", "node_dropped"]
    assert only(events, "node_dropped")[0]["frozen_s"] == 12.0


def test_a_straggler_ends_the_cycle_when_the_action_is_restart(tmp_path):
    h = Harness(tmp_path, nproc=4, max_restarts=1,
                ft={"straggler_action": "restart", "straggler_window": 3})

    def step() -> None:
        closed = h.monitor.callbacks.get("on_section_closed")
        if closed is not None and len(h.groups) == 1:
            for rank in range(4):
                closed(rank, "compute", 3.0 if rank == 3 else 1.0)
    for i in range(200):
        h.at(0.5 + i * 0.1, step)
    h.at(60.0, lambda: [h.group.exit(r, 0) for r in range(4)])
    code, events = h.run()
    detected = only(events, "straggler_detected")
    assert detected and detected[0]["rank"] == 3
    assert [e["outcome"] for e in only(events, "decision")][0] == "straggler"


def test_an_injected_fault_fires_at_its_time_and_is_on_record(tmp_path):
    h = Harness(tmp_path, max_restarts=1,
                ft={"simulated_fault": "rank_killed:base_delay=2,rank=1"})
    h.at(2.5, lambda: h.group.exit(1, -signal.SIGKILL))
    h.at(5.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)) if len(h.groups) == 2
         else None)
    code, events = h.run()
    assert code == 0
    injected = only(events, "fault_injected")[0]
    assert (injected["rank"], injected["fault_type"]) == (1, "rank_killed")
    assert injected["at"] == pytest.approx(T0_WALL + h.start + 2.0)
    assert ("kill", 1, signal.SIGKILL) in h.log
    assert injected["counted_from"] == "training" and not only(events, "fault_not_fired")


def test_a_script_that_never_says_hello_is_hit_base_delay_after_its_spawn(tmp_path):
    h = Harness(tmp_path, max_restarts=1,
                ft={"simulated_fault": "rank_killed:base_delay=3,rank=1"})
    h.monitor.training = False  # no hello, no heartbeat: a plain script
    h.at(3.3, lambda: h.group.exit(1, -signal.SIGKILL) if len(h.groups) == 1 else None)
    h.at(5.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)) if len(h.groups) == 2
         else None)
    code, events = h.run()
    assert code == 0
    injected = only(events, "fault_injected")[0]
    spawned = max(w.started_at for w in h.groups[0].workers)
    assert (injected["counted_from"], injected["at"]) == ("spawn", pytest.approx(spawned + 3))
    assert ("kill", 1, signal.SIGKILL) in h.log
    assert only(events, "restart") and not only(events, "fault_not_fired")


def test_a_job_that_ends_before_its_fault_says_so_once(tmp_path):
    h = Harness(tmp_path, ft={"simulated_fault": "rank_killed:base_delay=60,rank=0"})
    h.monitor.training = False
    h.at(2.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0 and not only(events, "fault_injected")
    missed = only(events, "fault_not_fired")
    assert len(missed) == 1 and missed[0] == {
        **missed[0], "cycle": 0, "fault_type": "rank_killed", "rank": 0, "delay": 60.0,
        "counted_from": "spawn", "cycle_s": pytest.approx(2.0, abs=0.6)}
    assert names(events).index("fault_not_fired") < names(events).index("decision")


def test_a_rank_that_said_goodbye_but_never_exits_is_ended_after_the_grace(tmp_path):
    h = Harness(tmp_path)
    h.at(4.0, lambda: h.monitor.goodbyes.update({0, 1}))
    h.at(5.0, lambda: h.group.exit(0, 0))  # rank 1's teardown hangs
    code, events = h.run()
    assert code == 0
    stuck = only(events, "exit_stuck")
    assert len(stuck) == 1 and stuck[0]["ranks"] == [1] and stuck[0]["waited_s"] == 30.0
    # Woken for the grace's end, not a pass later (the idle wake is 1 s).
    assert h.clock.now - h.start == pytest.approx(5.0 + 30.0, abs=0.01)
    assert names(events, "exit_stuck", "stacks_dumped", "worker_exited") == [
        "worker_exited", "stacks_dumped", "exit_stuck", "worker_exited"]
    killed = only(events, "worker_exited")[1]
    assert killed["rank"] == 1 and killed["signal"] == "SIGKILL"
    assert only(events, "decision")[0]["outcome"] == "succeeded"


def test_ranks_that_announced_exit_17_but_never_exit_are_ended_and_judged_as_announced(
        tmp_path):
    # Both ranks of the rerun example deliver their verdict, say goodbye and then hang in
    # their teardown (seen once in CI: no process exited, the job waited for ever).
    h = Harness(tmp_path)
    verdict = {"rank": 1, "state": "RERUNNING_FROM_CHECKPOINT", "exit_code": 17,
               "fatal": True, "diagnostic": "CORRECT_RESULT", "iteration": 5}
    h.at(4.0, lambda: (h.monitor.diagnoses.append(verdict), h.monitor.goodbyes.update({0, 1})))
    code, events = h.run()
    assert code == 17
    stuck = only(events, "exit_stuck")
    assert len(stuck) == 1 and stuck[0]["ranks"] == [0, 1]
    assert h.clock.now - h.start == pytest.approx(4.0 + 30.0, abs=1.1)
    decision = only(events, "decision")[0]
    assert decision["outcome"] == "failed" and "--ft-skip-bad-iterations" in decision["reason"]


def test_no_exit_wait_without_an_announced_exit(tmp_path):
    h = Harness(tmp_path)
    note = {"rank": 1, "state": "VALIDATING", "exit_code": None, "fatal": False}
    h.at(4.0, lambda: (h.monitor.diagnoses.append(note), h.monitor.goodbyes.update({0, 1})))
    h.at(100.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0 and not only(events, "exit_stuck")


def test_a_rank_still_training_after_a_peer_exited_is_not_ended(tmp_path):
    h = Harness(tmp_path)
    h.at(4.0, lambda: h.monitor.goodbyes.add(0))
    h.at(5.0, lambda: h.group.exit(0, 0))  # rank 1 works on without its goodbye
    h.at(100.0, lambda: h.group.exit(1, 0))
    code, events = h.run()
    assert code == 0 and not only(events, "exit_stuck")
    assert h.clock.now - h.start == pytest.approx(100.0, abs=1.1)


# -- the services' seam ----------------------------------------------------------------------


class RecordingService(CycleService):
    """A service the cycle knows nothing of: it records each hook it is called at."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[tuple[str, Any]] = []
        self.due_at: float | None = clock.now + 0.3

    def begin(self, start: CycleStart) -> None:
        self.calls.append(("begin", (start.cycle, start.round.round, start.ranks)))

    def worker_env(self, rank: int, env: Any) -> dict[str, str]:
        self.calls.append(("worker_env", (rank, env["RANK"])))
        return {"FT_RECORDED": str(rank)}

    def feeds(self) -> RankFeeds:
        self.calls.append(("feeds", None))
        return RankFeeds(section_closed=lambda *a: self.calls.append(("section", a)),
                         reports={"recorded": lambda *a: self.calls.append(("report", a))})

    def take_worker(self, spec: WorkerSpec, sink: Any) -> None:
        self.calls.append(("take_worker", spec.rank))

    def started(self, workers: Any) -> None:
        self.calls.append(("started", [w.rank for w in workers]))

    def due(self, now: float, wall: float) -> float | None:
        self.calls.append(("due", None))
        return self.due_at

    def polls(self) -> bool:
        self.calls.append(("polls", None))
        return False

    def check(self) -> None:
        self.calls.append(("check", None))

    def tick(self, now: float, training: bool) -> None:
        self.calls.append(("tick", training))
        self.due_at = None  # one timed step, then only the idle wake

    def worker_exited(self, worker: Worker) -> None:
        self.calls.append(("worker_exited", worker.rank))

    def ended(self, result: CycleResult) -> None:
        self.calls.append(("ended", result.outcome.value))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_a_service_in_the_list_is_called_at_each_hook_in_order(tmp_path):
    h = Harness(tmp_path)
    recorder = RecordingService(h.clock)
    h.services = Services([recorder])
    h.at(1.0, lambda: (h.monitor.callbacks["on_section_closed"](1, "step", 0.5),
                       h.monitor.report_handlers["recorded"](0, "hello")))
    h.at(2.0, lambda: (h.group.exit(0, 0), h.group.exit(1, 0)))
    code, events = h.run()
    assert code == 0
    calls = recorder.calls
    hooks = [name for name, _ in calls if name not in ("section", "report")]
    assert list(dict.fromkeys(hooks)) == [  # each hook, by its first call
        "begin", "feeds", "worker_env", "take_worker", "started", "polls", "due", "check",
        "tick", "worker_exited", "ended", "close"]
    assert calls[0] == ("begin", (0, 1, (0, 1)))
    assert ("worker_env", (1, "1")) in calls and ("started", [0, 1]) in calls
    assert [w.spec.env["FT_RECORDED"] for w in h.group.workers] == ["0", "1"]
    assert ("section", (1, "step", 0.5)) in calls and ("report", (0, "hello")) in calls
    assert ("tick", True) in calls
    assert [c for c in calls if c[0] == "worker_exited"] == [
        ("worker_exited", 0), ("worker_exited", 1)]
    assert calls[-2:] == [("ended", "succeeded"), ("close", None)]
    # Its due time woke the loop (the idle wake is 1 s).
    assert h.waits[0][0] == pytest.approx(0.3)


# -- when to wake: a pure function -----------------------------------------------------------


def _inputs(**kw: Any) -> WakeInputs:
    return WakeInputs(**{"now": 10.0, "wall": 1000.0, "interval": 0.5, "polls": False, **kw})


def test_with_nothing_to_poll_the_loop_sleeps_until_its_idle_wake():
    assert next_wake(_inputs()).timeout == IDLE_WAKE_S
    assert next_wake(_inputs(polls=True)).timeout == 0.5


def test_the_earliest_deadline_ends_the_sleep():
    assert next_wake(_inputs(deadline=10.2)).timeout == pytest.approx(0.2)
    assert next_wake(_inputs(fault_due=1000.3)).timeout == pytest.approx(0.3)
    assert next_wake(_inputs(services_due=10.1, deadline=10.2)).timeout == pytest.approx(0.1)
    assert next_wake(_inputs(deadline=9.0)).timeout == 0.0  # overdue: at once


def test_within_a_message_batch_only_signals_wake_the_loop():
    wake = next_wake(_inputs(batch_until=10.0 + MESSAGE_BATCH_S / 2))
    assert wake.signals_only and wake.timeout == pytest.approx(MESSAGE_BATCH_S / 2)
    assert not next_wake(_inputs(batch_until=10.0)).signals_only


def test_an_owed_signal_or_another_node_makes_the_loop_poll():
    assert not must_poll(False, False, False)
    for i in range(3):
        flags = [False] * 3
        flags[i] = True
        assert must_poll(*flags)


def test_a_services_next_step_ends_the_sleep_and_none_leaves_the_idle_wake():
    assert next_wake(_inputs(services_due=10.3)).timeout == pytest.approx(0.3)
    assert next_wake(_inputs(services_due=12.0)).timeout == IDLE_WAKE_S
    assert next_wake(_inputs(services_due=None)).timeout == IDLE_WAKE_S
