"""The rank_slow throttle (ft_launcher/stragglers/throttle.py): stops of (F-1) x the work.

The rule is tested on a fake clock with a fake process (exact); the throughput of a
throttled busy loop is measured against an unthrottled one on this (noisy, 2-core) machine,
so its bounds are generous.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft_launcher import faults
from ft_launcher.config import ConfigError
from ft_launcher.stragglers.throttle import (
    DEBT_CAP_S,
    DEFAULT_MAX_STOP_S,
    MIN_STOP_S,
    CpuDebt,
    ProcessCpu,
    Throttle,
    schedstat,
)

pytestmark = pytest.mark.timeout(60)

# Counts loop iterations; prints the count on each line of stdin ("?"), exits on EOF.
BUSY = """
import sys, threading
n = 0
def spin():
    global n
    while True:
        n += 1
threading.Thread(target=spin, daemon=True).start()
for line in sys.stdin:
    print(n, flush=True)
"""


# -- the debt rule, on a fake clock ------------------------------------------------------


class FakeRank:
    """A process on a fake clock running ``phases`` in a loop: ("work", CPU seconds) runs
    at ``share`` of a CPU while runnable (waiting for one the rest of the time); ("sleep",
    s) wants no CPU and its timer runs on while the process is stopped, as a real one's.
    Records each phase's wall duration."""

    def __init__(self, phases, share: float = 1.0, threads: int = 1, tick: float = 0.0
                 ) -> None:
        self.phases, self.share, self.threads, self.tick = phases, share, threads, tick
        self.now, self.runnable, self.i = 0.0, 0.0, 0
        self.left = phases[0][1]
        self.began = 0.0
        self.took: dict[str, list[float]] = {"work": [], "sleep": []}

    def _next_phase(self) -> None:
        kind = self.phases[self.i][0]
        self.took[kind].append(self.now - self.began)
        self.i = (self.i + 1) % len(self.phases)
        self.left, self.began = self.phases[self.i][1], self.now

    @property
    def working(self) -> bool:
        return self.phases[self.i][0] == "work"

    def read(self) -> float:
        """The runnable seconds as /proc shows them: with ``tick``, only whole ticks."""
        return self.runnable if not self.tick else self.runnable // self.tick * self.tick

    def run(self, dt: float) -> None:
        """Advance ``dt`` wall seconds running."""
        end = self.now + dt
        while self.now < end - 1e-12:
            kind = self.phases[self.i][0]
            rate = self.share if kind == "work" else 1.0
            step = min(end - self.now, self.left / rate)
            if kind == "work":
                self.runnable += step * self.threads
            self.left -= step * rate
            self.now += step
            if self.left <= 1e-12:
                self._next_phase()

    def stopped(self, dt: float) -> None:
        """Advance ``dt`` wall seconds stopped: work waits, a sleep's timer runs on."""
        end = self.now + dt
        while self.phases[self.i][0] == "sleep" and self.now + self.left <= end:
            self.now += self.left
            self._next_phase()
        if self.phases[self.i][0] == "sleep":
            self.left -= end - self.now
        self.now = end


def drive(debt: CpuDebt, rank: FakeRank, seconds: float, poll_s: float = 0.001) -> list:
    """The throttle's loop on a fake clock; returns the stops it made."""
    stops = []
    while rank.now < seconds:
        debt.observe(rank.now, rank.read(), rank.working)
        stop = debt.stop_for()
        if stop > 0:
            rank.stopped(stop)
            stops.append(stop)
            debt.resumed(stop)
        else:
            rank.run(poll_s)
    return stops


def mean(xs) -> float:
    xs = xs[5:]  # the first steps, before the first stop, are not slowed
    return sum(xs) / len(xs)


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0, 4.0])
@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_busy_rank_s_work_takes_factor_times_as_long(factor, share):
    """Pure work, each item 10 ms of CPU; on a loaded machine (share 0.5) each item takes
    20 ms unthrottled and factor x 20 ms throttled: the wait for a CPU is work time too."""
    rank = FakeRank([("work", 0.010)], share=share, tick=0.004)
    stops = drive(CpuDebt(factor), rank, 20.0)
    assert mean(rank.took["work"]) == pytest.approx(factor * 0.010 / share, rel=0.05)
    assert max(stops) <= DEFAULT_MAX_STOP_S


def test_a_rank_the_scheduler_favours_is_stretched_from_its_peers_pace():
    """On a loaded machine the scheduler runs a just-resumed process at once (share 1.0)
    while its peers get half a CPU: 10 ms of CPU takes a peer 20 ms, so the victim's
    takes 3 x 20 ms, not 3 x 10."""
    rank = FakeRank([("work", 0.010)], share=1.0)
    debt, stops = CpuDebt(3.0), []
    while rank.now < 20.0:
        debt.observe(rank.now, rank.read(), rank.working, speedup=1.0 / 0.5)
        stop = debt.stop_for()
        if stop > 0:
            rank.stopped(stop)
            stops.append(stop)
            debt.resumed(stop)
        else:
            rank.run(0.001)
    assert mean(rank.took["work"]) == pytest.approx(0.060, rel=0.05)


@pytest.mark.parametrize("tick", [0.0, 0.004])
@pytest.mark.parametrize("work_s", [0.010, 0.002])
def test_work_is_stretched_and_sleeps_are_not(work_s, tick):
    """The issue's loop: work, then 10 ms that want no CPU (a sleep, or a wait in a
    collective). The work takes 3x; the sleep stays about 10 ms (a stop that begins in the
    work may overrun into it by at most one look). Also with the runnable time read in
    4 ms lumps, as the kernel updates a running task's at its tick (HZ=250)."""
    rank = FakeRank([("work", work_s), ("sleep", 0.010)], tick=tick)
    drive(CpuDebt(3.0), rank, 20.0)
    assert mean(rank.took["work"]) == pytest.approx(3 * work_s, rel=0.15)
    assert mean(rank.took["sleep"]) == pytest.approx(0.010, abs=0.0015)


def test_an_idle_rank_is_never_stopped():
    rank = FakeRank([("sleep", 0.010)])
    debt = CpuDebt(3.0)
    assert drive(debt, rank, 10.0) == [] and debt.debt_s == 0.0


def test_threads_working_side_by_side_are_one_process_s_work():
    """4 threads busy together for 10 ms: 40 ms of CPU, but 10 ms of the process's work;
    it is stretched to 30 ms, not 130."""
    rank = FakeRank([("work", 0.010)], threads=4)
    drive(CpuDebt(3.0), rank, 10.0)
    assert mean(rank.took["work"]) == pytest.approx(0.030, rel=0.05)


@given(reads=st.lists(st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 2.0)), max_size=200),
       factor=st.floats(1.01, 100), max_stop=st.floats(0.002, 1.0))
def test_stops_are_bounded_and_the_debt_never_runs_away(reads, factor, max_stop):
    """Any clock steps and runnable readings (even ones that go backwards): every stop is
    between the minimum and ``max_stop_s``, the debt stays in [0, DEBT_CAP_S]."""
    debt = CpuDebt(factor, max_stop)
    now, runnable = 0.0, 0.0
    for dt, grew in reads:
        now += dt
        runnable += grew - 0.3
        debt.observe(now, runnable, grew > 0.3)
        stop = debt.stop_for()
        assert stop == 0.0 or MIN_STOP_S <= stop <= max_stop
        if stop:
            now += stop
            debt.resumed(stop)
        assert 0.0 <= debt.debt_s <= DEBT_CAP_S


@pytest.mark.parametrize("factor, max_stop, words", [
    (1.0, 0.05, "factor must be a finite number > 1"),
    (0.5, 0.05, "factor must be a finite number > 1"),
    (float("inf"), 0.05, "factor must be a finite number > 1"),
    (float("nan"), 0.05, "factor must be a finite number > 1"),
    (2.0, 0.0, "max_stop_s must be at least"),
    (2.0, float("nan"), "max_stop_s must be at least"),
])
def test_bad_settings(factor, max_stop, words):
    with pytest.raises(ValueError, match=words):
        CpuDebt(factor, max_stop)


# -- on real processes --------------------------------------------------------------------


def test_process_cpu_counts_every_thread(busy):
    """The busy loop spins in a second thread: a main-thread-only reading would see ~0."""
    threads = schedstat(busy.pid)
    assert threads is not None and len(threads) >= 2
    # Waits for the spinner's CPU, not a fixed time: on a loaded machine half a second of
    # wall gave it 0.04 s of CPU. The kernel's per-process count (psutil, in clock ticks)
    # is read around the meter's readings, so the meter's window lies inside its window.
    proc, meter = psutil.Process(busy.pid), ProcessCpu(busy.pid)
    before = sum(proc.cpu_times()[:2])
    assert meter.refresh()
    start = meter.used()
    deadline = time.monotonic() + 60
    while sum(proc.cpu_times()[:2]) - before < 0.3 and time.monotonic() < deadline:
        time.sleep(0.05)
    used = meter.used() - start
    kernel = sum(proc.cpu_times()[:2]) - before
    assert kernel >= 0.3, "the spinner got no CPU within 60 s"
    # A main-thread-only reading would see ~0 of it; a few clock ticks of rounding allowed.
    assert 0.5 * kernel < used <= kernel + 0.05, (used, kernel)
    assert schedstat(2**22 + 12345) is None and not ProcessCpu(2**22 + 12345).refresh()


@pytest.fixture
def spawn():
    """Start processes spinning a counter; the test reads it by writing a line."""
    procs = []

    def start(n: int) -> list[subprocess.Popen]:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
        for p in procs[-n:]:
            count(p)  # started
        return procs[-n:]

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def busy(spawn):
    return spawn(1)[0]


def count(proc) -> int:
    proc.stdin.write("?\n")
    proc.stdin.flush()
    return int(proc.stdout.readline())


def rates(procs, seconds: float) -> list[float]:
    """CPU seconds per wall second of each (busy-looping) process over the same
    ``seconds``: its work. Read from /proc, not by asking the loop for its count (a stopped
    loop would hold the question up, and answering takes the loop's GIL from its spinner)."""
    meters = [psutil.Process(p.pid) for p in procs]
    before = [sum(m.cpu_times()[:2]) for m in meters]
    time.sleep(seconds)
    return [(sum(m.cpu_times()[:2]) - b) / seconds for m, b in zip(meters, before, strict=True)]


def status(pid: int) -> str:
    return psutil.Process(pid).status()


# Seconds of real time each; the rule is exact on the fake clock above, and the fast tier's
# end-to-end throttle is test_rank_slow.py's plain script.
@pytest.mark.slow
@pytest.mark.parametrize("factor, ranks", [(2.0, 2), (4.0, 2), (2.0, 4)])
def test_a_throttled_busy_loop_runs_at_about_one_factor_th_of_its_peers(spawn, factor,
                                                                       ranks):
    """Busy loops side by side, one throttled: its rate over the others' median. Four
    loops on two cores is the oversubscribed case a plain duty cycle gets wrong (the time a
    loop waits for a CPU is charged as work)."""
    victim, *peers = spawn(ranks)
    throttle = Throttle(victim.pid, factor, peers=[p.pid for p in peers])
    throttle.start()
    try:
        spells = [rates([victim, *peers], 1.0) for _ in range(6)]
    finally:
        throttle.stop()
    # Over the whole 6 s, not per spell: with every core busy a 1 s spell can give the
    # throttled loop no CPU tick at all (seen under the suite), and a ratio of one spell
    # then means nothing.
    victim_cpu = sum(m[0] for m in spells)
    assert victim_cpu > 0, f"the throttled loop got no CPU in 6 s: {spells}"
    peer_cpu = statistics.median(sum(m[k] for m in spells) for k in range(1, ranks))
    ratio = peer_cpu / victim_cpu
    print(f"factor {factor}, {ranks} loops: measured slowdown {ratio:.2f}")
    if peer_cpu / len(spells) >= 0.5:
        # The peers had half a core or more: alone on the 2 cores this measured 2.14-2.16
        # at factor 2, 4.12-4.17 at factor 4 and 2.27-2.39 at factor 2 with 4 loops (a
        # plain wall-clock duty cycle: 1.2-1.4 at factor 2 with 4 loops).
        lower = factor * 0.75
    else:
        # An overloaded machine (the suite beside busy loops gave each loop 0.1-0.2 of a
        # core): the run-queue waits reach the throttle in lumps larger than it banks, and
        # it stops the rank for about half its debt (docs/stragglers.md): 1.73 at factor
        # 4 was seen there. Still well apart from no throttle (1.0).
        lower = 1 + (factor - 1) / 6
    assert lower < ratio < factor * 2.5, (ratio, lower, spells)
    assert status(victim.pid) != psutil.STATUS_STOPPED
    assert throttle.stopped_total_s > 0.3


def test_stop_leaves_the_process_continued_whenever_it_is_called(busy):
    count(busy)
    for _ in range(20):  # stop at random points of the cycle, often mid-SIGSTOP
        throttle = Throttle(busy.pid, 10.0, max_stop_s=0.01)
        throttle.start()
        time.sleep(0.013)
        throttle.stop()
        assert status(busy.pid) != psutil.STATUS_STOPPED
        count(busy)  # answers: really running
    throttle.stop()  # twice: harmless


def test_duration_ends_the_slowdown_by_itself(busy):
    count(busy)
    throttle = Throttle(busy.pid, 3.0, max_stop_s=0.02, duration_s=0.3)
    throttle.start()
    deadline = time.monotonic() + 10
    while throttle.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not throttle.running
    assert 0.25 < throttle.ended_at - throttle.started_at < 5
    assert status(busy.pid) != psutil.STATUS_STOPPED
    throttle.stop()


def test_the_throttle_ends_when_the_rank_starts_slowing_its_own_sections(busy):
    count(busy)
    sections = threading.Event()  # the rank closed a section: it stretches them itself
    throttle = Throttle(busy.pid, 10.0, max_stop_s=0.02, until=sections.is_set)
    throttle.start()
    time.sleep(0.2)
    assert throttle.running
    sections.set()
    deadline = time.monotonic() + 10
    while throttle.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not throttle.running and status(busy.pid) != psutil.STATUS_STOPPED
    count(busy)
    throttle.stop()


def test_a_dead_process_ends_the_throttle_and_is_never_signalled_again(busy):
    count(busy)
    throttle = Throttle(busy.pid, 2.0, max_stop_s=0.02)
    throttle.start()
    time.sleep(0.1)
    busy.kill()
    busy.wait()  # reaped: the pid may now be reused; the pidfd still names the dead one
    deadline = time.monotonic() + 5
    while throttle.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not throttle.running
    throttle.stop()  # no error, nothing signalled
    assert throttle._target.send(19) is False  # closed: can never signal a reused pid


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_error_in_the_throttle_s_thread_still_leaves_the_process_continued(busy):
    count(busy)
    looks = [0]

    def until() -> bool:  # fails after ~50 looks: the thread dies of it
        looks[0] += 1
        if looks[0] > 50:
            raise RuntimeError("boom")
        return False

    throttle = Throttle(busy.pid, 10.0, max_stop_s=0.02, until=until)
    throttle.start()
    deadline = time.monotonic() + 10
    while throttle.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not throttle.running and throttle.stops > 0
    assert status(busy.pid) != psutil.STATUS_STOPPED
    count(busy)  # answers: really running
    throttle.stop()


def test_a_pid_that_is_already_gone_is_refused():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        Throttle(proc.pid, 2.0)


def test_stop_before_start_continues_and_disarms(busy):
    count(busy)
    throttle = Throttle(busy.pid, 2.0)
    throttle.stop()
    throttle.start()  # after stop: nothing starts
    assert not throttle.running
    count(busy)


# -- --ft-simulated-fault rank_slow:factor=F (ft_launcher/faults.py) ----------------------


def test_rank_slow_is_parsed_and_armed_with_its_factor():
    plan = faults.parse_fault("rank_slow:factor=2.5,rank=1,base_delay=3,duration=4")
    assert (plan.fault_type, plan.factor, plan.rank, plan.base_delay, plan.duration) == (
        "rank_slow", 2.5, 1, 3.0, 4.0)
    armed = faults.arm(plan, 0, 2, "run")
    assert (armed.fault_type, armed.rank, armed.factor, armed.duration) == (
        "rank_slow", 1, 2.5, 4.0)
    assert faults.parse_fault("rank_slow:factor=2").duration is None  # until the cycle ends


@pytest.mark.parametrize("text, words", [
    ("rank_slow", "rank_slow needs factor=F > 1"),
    ("rank_slow:rank=1", "rank_slow needs factor=F > 1"),
    ("rank_slow:factor=1", "factor='1' must be a finite number > 1"),
    ("rank_slow:factor=0.5", "factor='0.5' must be a finite number > 1"),
    ("rank_slow:factor=inf", "factor='inf' must be a finite number > 1"),
    ("rank_slow:factor=nan", "factor='nan' must be a finite number > 1"),
    ("rank_slow:factor=fast", "factor='fast' is not a number"),
    ("rank_slow:factor=2,duration=0", "duration='0' must be a finite number > 0"),
    ("rank_killed:factor=2", "factor= applies to rank_slow only, not to rank_killed"),
    ("rank_hung:duration=2", "duration= applies to rank_slow only, not to rank_hung"),
    ("rank_slow:factor=2,code=3", "code= applies to rank_exit only"),
    ("rank_slow:factor=2,speed=3", "key one of base_delay, rand_delay, rank, cycles, seed, "
                                   "code, factor, duration"),
])
def test_rank_slow_errors_name_the_option(text, words):
    with pytest.raises(ConfigError) as err:
        faults.parse_fault(text)
    assert str(err.value).startswith("--ft-simulated-fault: ")
    assert words in str(err.value)
