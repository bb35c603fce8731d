"""SIGSTOP/SIGCONT duty-cycle throttle (ft_launcher/stragglers/throttle.py) on real processes.

The arithmetic is exact; the throughput of a throttled busy loop is measured against an
unthrottled one on this (noisy, 2-core) machine, so its bounds are generous.
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
    CpuBudget,
    ProcessCpu,
    Throttle,
    cpu_share,
    duty_cycle,
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


@given(factor=st.floats(1.01, 1000), period=st.floats(0.002, 1.0))
def test_duty_cycle_runs_one_factor_th_of_each_period(factor, period):
    c = duty_cycle(factor, period)
    assert c.stopped_s + c.running_s == pytest.approx(period)
    assert c.speed == pytest.approx(1 / factor)
    assert 0 < c.running_s < period and c.stopped_s > 0


def test_duty_cycle_examples():
    c = duty_cycle(2, 0.05)
    assert (c.stopped_s, c.running_s) == pytest.approx((0.025, 0.025))
    c = duty_cycle(4, 0.1)
    assert (c.stopped_s, c.running_s) == pytest.approx((0.075, 0.025))


@pytest.mark.parametrize("factor, period, words", [
    (1.0, 0.05, "factor must be a finite number > 1"),
    (0.5, 0.05, "factor must be a finite number > 1"),
    (float("inf"), 0.05, "factor must be a finite number > 1"),
    (float("nan"), 0.05, "factor must be a finite number > 1"),
    (2.0, 0.0, "period_s must be at least"),
    (2.0, float("nan"), "period_s must be at least"),
])
def test_bad_settings(factor, period, words):
    with pytest.raises(ValueError, match=words):
        duty_cycle(factor, period)


def simulate(budget: CpuBudget, victim_share: float, peer_share: float, seconds: float
             ) -> float:
    """Drive a budget with an injected clock: the process gets ``victim_share`` of a CPU
    whenever it is allowed to run. Returns the CPU seconds it used per second."""
    now, used = 0.0, 0.0
    while now < seconds:
        run = budget.step(now, used, peer_share)
        dt = budget.next_check_s(peer_share)
        used += victim_share * dt if run else 0.0
        now += dt
    return used / seconds


@pytest.mark.parametrize("factor", [1.5, 2.0, 4.0])
@pytest.mark.parametrize("victim_share, peer_share", [(1.0, 1.0), (1.0, 0.5), (0.8, 0.25)])
def test_the_budget_gives_one_factor_th_of_a_peers_share(factor, victim_share, peer_share):
    """A scheduler that favours the resumed process (victim_share > peer_share) does not
    make it faster: it gets peer_share / factor of a CPU."""
    rate = simulate(CpuBudget(factor, 0.05), victim_share, peer_share, 60.0)
    assert rate == pytest.approx(peer_share / factor, rel=0.05)


def test_the_budget_stops_and_resumes_about_once_a_period():
    budget = CpuBudget(2.0, 0.05)
    now, used, switches, last = 0.0, 0.0, 0, True
    while now < 10.0:
        run = budget.step(now, used, 1.0)
        switches += run != last
        last = run
        dt = budget.next_check_s(1.0)
        used += dt if run else 0.0
        now += dt
    assert 10 / 0.05 * 0.5 < switches / 2 < 10 / 0.05 * 2  # one stop per period or so


def test_a_process_that_uses_no_cpu_is_never_stopped():
    budget = CpuBudget(3.0, 0.05)
    assert all(budget.step(t / 100, 0.0, 1.0) for t in range(1000))


def test_cpu_share_from_schedstat_samples():
    assert cpu_share((1.0, 1.0), (1.5, 1.5), 1.0) == 0.5
    assert cpu_share((1.0, 1.0), (2.0, 1.0), 1.0) == 1.0
    assert cpu_share((1.0, 1.0), (1.01, 1.01), 1.0) is None  # runnable 2 % of the time
    assert cpu_share((1.0, 1.0), (0.5, 1.0), 1.0) is None  # counters went backwards


def test_process_cpu_counts_every_thread(busy):
    """The busy loop spins in a second thread: a main-thread-only reading would see ~0."""
    threads = schedstat(busy.pid)
    assert threads is not None and len(threads) >= 2
    meter = ProcessCpu(busy.pid)
    assert meter.refresh()
    start = meter.used()
    time.sleep(0.5)
    assert 0.05 < meter.used() - start < 1.5  # ns-exact; a share of a loaded CPU
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
    """Loop iterations per wall second of each process over the same ``seconds``."""
    before = [count(p) for p in procs]
    time.sleep(seconds)
    return [(count(p) - b) / seconds for p, b in zip(procs, before, strict=True)]


def status(pid: int) -> str:
    return psutil.Process(pid).status()


@pytest.mark.parametrize("factor, ranks", [(2.0, 2), (4.0, 2), (2.0, 4)])
def test_a_throttled_busy_loop_runs_at_about_one_factor_th_of_its_peers(spawn, factor,
                                                                       ranks):
    """Busy loops side by side, one throttled: its rate over the others' median. Four
    loops on two cores is the oversubscribed case a plain duty cycle gets wrong."""
    victim, *peers = spawn(ranks)
    throttle = Throttle(victim.pid, factor, peers=[p.pid for p in peers])
    throttle.start()
    try:
        time.sleep(0.5)  # the first peer share is measured
        spells = [rates([victim, *peers], 1.0) for _ in range(4)]
    finally:
        throttle.stop()
    ratio = statistics.median(statistics.median(m[1:]) / m[0] for m in spells)
    print(f"factor {factor}, {ranks} loops: measured slowdown {ratio:.2f}")
    # Generous: other work shares the 2 cores (a second test worker in CI); a plain
    # wall-clock duty cycle measured 1.2-1.4 at factor 2 with 4 loops (too little), and
    # the budget over-throttled to 3.5 at factor 2 once while another test ran beside it.
    assert factor * 0.65 < ratio < factor * 2.0, (ratio, spells)
    assert status(victim.pid) != psutil.STATUS_STOPPED
    assert throttle.stopped_total_s > 0.3


def test_stop_leaves_the_process_continued_whenever_it_is_called(busy):
    count(busy)
    for _ in range(20):  # stop at random points of the cycle, often mid-SIGSTOP
        throttle = Throttle(busy.pid, 10.0, period_s=0.01)
        throttle.start()
        time.sleep(0.013)
        throttle.stop()
        assert status(busy.pid) != psutil.STATUS_STOPPED
        count(busy)  # answers: really running
    throttle.stop()  # twice: harmless


def test_duration_ends_the_slowdown_by_itself(busy):
    count(busy)
    throttle = Throttle(busy.pid, 3.0, period_s=0.02, duration_s=0.3)
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
    throttle = Throttle(busy.pid, 10.0, period_s=0.02, until=sections.is_set)
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
    throttle = Throttle(busy.pid, 2.0, period_s=0.02)
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
