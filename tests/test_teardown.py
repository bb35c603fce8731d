"""How long a teardown takes: the rules on a fake clock, the last steps with real processes.

The fake-clock cases drive the real ``WorkerGroup.stop`` (workers.py) with stand-in processes
and the real rule that names a rank ignoring the stop signal (``cycle.ignoring_since``
with ``IGNORE_GRACE_S``), so each bound below is the code's, not a loaded machine's. The
real-process cases prove the steps a fake cannot: a SIGSTOPped process acts on SIGCONT +
SIGTERM at once, and the guardian kills the groups it holds as soon as its pipe closes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from launch_helpers import freeze

from ft_launcher import cycle
from ft_launcher.process.guardian import Guardian
from ft_launcher.process.workers import STOP_POLL_S, Worker, WorkerGroup, WorkerSpec

T0 = 1000.0  # the fake clock at the stop signal
FAKE_PID = 99_000_000  # above any pid_max: a signal to it could reach no real process


class Clock:
    """Time that moves only when the teardown sleeps."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeProc:
    """A worker process: exits on SIGKILL, on ``signum`` unless it ``traps`` it, or by
    itself at ``exits_at`` (a rank that saves a checkpoint first)."""

    pid: int
    clock: Clock
    traps: bool = True
    exits_at: float | None = None
    stopped: bool = False
    code: int | None = None
    received: list[tuple[float, int]] = field(default_factory=list)

    def poll(self) -> int | None:
        if self.code is None and self.exits_at is not None and self.clock() >= self.exits_at \
                and not self.stopped:
            self.code = 0
        return self.code

    def deliver(self, signum: int) -> None:
        self.received.append((self.clock(), signum))
        if self.code is not None:
            return
        if signum == signal.SIGKILL:
            self.code = -signal.SIGKILL
        elif signum == signal.SIGSTOP:
            self.stopped = True
        elif signum == signal.SIGCONT:
            self.stopped = False
        elif not self.traps and not self.stopped:
            self.code = -signum  # a stopped process acts on a signal only once continued


class FakeGroup(WorkerGroup):
    """The real teardown; signals go to the stand-ins instead of process groups."""

    def send_signal(self, worker: Worker, signum: int) -> None:
        worker.proc.deliver(signum)


def _group(clock: Clock, *procs: FakeProc) -> FakeGroup:
    group = FakeGroup(clock=clock, sleep=clock.sleep)
    for rank, proc in enumerate(procs):
        spec = WorkerSpec(rank, rank, ["train.py"], {}, Path("/dev/null"), False)
        group.workers.append(Worker(spec=spec, proc=proc, started_at=0.0))
    return group


class Activity:
    """The monitor's view of each rank: a rank that carries on heartbeats every
    ``interval`` s; ``drain`` reads what arrived by ``now``."""

    def __init__(self, busy: dict[int, float | None]) -> None:
        self.busy = busy  # rank -> heartbeat interval, None = quiet after the signal
        self.last = dict.fromkeys(busy, T0 - 0.01)

    def last_activity(self) -> dict[int, float]:
        return dict(self.last)

    def drain(self, clock: Callable[[], float]) -> None:
        now = clock()
        for rank, interval in self.busy.items():
            if interval is not None:
                beats = int((now - T0) / interval)
                self.last[rank] = max(self.last[rank], T0 + beats * interval)


def _stop(clock: Clock, group: FakeGroup, activity: Activity, grace: float):
    # The cycle's own rule, on the fake clock.
    ignoring = cycle.ignoring_since(activity, SimpleNamespace(monotonic=clock), clock())
    group.stop(grace, signal.SIGTERM, ignoring)


def _first(proc: FakeProc, signum: int) -> float:
    return next(t for t, s in proc.received if s == signum) - T0


@pytest.mark.parametrize("interval", [0.05, 0.2, 0.4])
def test_a_rank_that_traps_sigterm_and_carries_on_is_killed_half_a_second_after(interval):
    """Killed at the first check after IGNORE_GRACE_S at which it has been heard from since
    then: within IGNORE_GRACE_S + one heartbeat interval + one poll, under 1 s for any
    heartbeat interval up to 0.45 s; the --workers-stop-timeout of 30 s is not waited."""
    clock = Clock()
    trapper = FakeProc(FAKE_PID, clock, traps=True)
    group = _group(clock, trapper)
    _stop(clock, group, Activity({0: interval}), grace=30.0)
    killed = _first(trapper, signal.SIGKILL)
    assert cycle.IGNORE_GRACE_S == 0.5
    assert 0.5 < killed <= 0.5 + interval + STOP_POLL_S + 1e-9, killed
    assert killed < 1.0
    assert clock() - T0 == pytest.approx(killed, abs=2 * STOP_POLL_S)  # the teardown's end


def test_a_quiet_rank_keeps_the_whole_grace_and_a_busy_one_does_not():
    """A rank that goes quiet after SIGTERM (saving a checkpoint) is never taken for one
    that ignores it: it exits by itself at 3 s of a 30 s grace; its busy peer dies at 0.5 s."""
    clock = Clock()
    busy = FakeProc(FAKE_PID, clock, traps=True)
    saver = FakeProc(FAKE_PID + 1, clock, traps=True, exits_at=T0 + 3.0)
    group = _group(clock, busy, saver)
    _stop(clock, group, Activity({0: 0.05, 1: None}), grace=30.0)
    assert _first(busy, signal.SIGKILL) < 0.6
    assert group.workers[1].exit_code == 0  # its own exit, not the teardown's SIGKILL
    assert _first(saver, signal.SIGKILL) >= 3.0  # only kill_all's sweep of its group


def test_a_quiet_rank_that_never_exits_is_killed_at_the_grace():
    clock = Clock()
    stuck = FakeProc(FAKE_PID, clock, traps=True)
    _group(clock, stuck).stop(30.0, signal.SIGTERM, lambda alive: [])
    assert 30.0 <= _first(stuck, signal.SIGKILL) <= 30.0 + STOP_POLL_S + 1e-9


def test_a_stopped_worker_is_continued_before_the_signal_and_gone_at_the_next_poll():
    """SIGCONT goes to a group before SIGTERM, so a SIGSTOPped worker acts on it at once
    rather than after the grace: the teardown of 30 s grace ends one poll (10 ms) later."""
    clock = Clock()
    frozen = FakeProc(FAKE_PID, clock, traps=False, stopped=True)
    running = FakeProc(FAKE_PID + 1, clock, traps=False)
    group = _group(clock, frozen, running)
    group.stop(30.0)
    for proc in (frozen, running):
        assert [s for _, s in proc.received][:2] == [signal.SIGCONT, signal.SIGTERM]
        assert proc.code == -signal.SIGTERM
    assert clock() - T0 <= STOP_POLL_S + 1e-9


def _dead(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _wait_dead(pids: list[int], limit: float) -> float:
    t0 = time.monotonic()
    while not _dead(pids) and time.monotonic() - t0 < limit:
        time.sleep(0.005)
    return time.monotonic() - t0


def test_a_sigstopped_real_worker_is_torn_down_under_a_second(tmp_path):
    spec = WorkerSpec(0, 0, [sys.executable, "-c", "import time; time.sleep(60)"],
                      {"PATH": "/usr/bin:/bin", "FT_RUN_DIR": str(tmp_path)},
                      tmp_path / "r0.log", False)
    group = WorkerGroup()
    group.start([spec])
    try:
        worker = group.workers[0]
        freeze(worker.pid)
        t0 = time.monotonic()
        group.stop(grace=30.0)
        took = time.monotonic() - t0
    finally:
        group.kill_all()
    assert worker.exit_code == -signal.SIGTERM, worker.exit_code
    assert took < 1.0, f"teardown took {took:.2f} s"


def test_the_guardian_kills_a_group_under_a_second_after_its_pipe_closes(tmp_path):
    """The launcher's death closes the guardian's pipe (the kernel does it, even after a
    SIGKILL); the guardian blocks reading it, so the kill follows the EOF without a poll."""
    guardian = Guardian()
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        child = int(leader.stdout.readline())
        guardian.register(leader.pid, str(tmp_path))
        assert guardian.pid is not None
        time.sleep(0.5)  # started and reading, as it is long before a launcher dies
        assert not _dead([leader.pid, child])
        guardian.close()
        took = _wait_dead([leader.pid, child], 10.0)
    finally:
        leader.kill()
        leader.wait()
    assert _dead([leader.pid, child]), "the guardian left the group alive"
    assert took < 1.0, f"the group died {took:.2f} s after the pipe closed"
    assert guardian._proc.wait(timeout=10) == 0
