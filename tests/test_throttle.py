"""SIGSTOP/SIGCONT duty-cycle throttle (ft_launcher/throttle.py) on real processes.

The arithmetic is exact; the throughput of a throttled busy loop is measured against an
unthrottled one on this (noisy, 2-core) machine, so its bounds are generous.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft_launcher import faults
from ft_launcher.config import ConfigError
from ft_launcher.throttle import Throttle, duty_cycle

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


@pytest.fixture
def busy():
    """A process spinning a counter; the test reads it by writing a line."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    yield proc
    proc.kill()
    proc.wait()


def count(proc) -> int:
    proc.stdin.write("?\n")
    proc.stdin.flush()
    return int(proc.stdout.readline())


def rate(proc, seconds: float) -> float:
    """Iterations per second of CPU the process was *allowed*: measured on the wall clock."""
    before, t0 = count(proc), time.monotonic()
    time.sleep(seconds)
    after, t1 = count(proc), time.monotonic()
    return (after - before) / (t1 - t0)


def status(pid: int) -> str:
    return psutil.Process(pid).status()


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_a_throttled_busy_loop_runs_at_about_one_factor_th(busy, factor):
    """Free and throttled spells alternate, so both see the same load on the machine."""
    count(busy)  # started
    free, slowed, stopped = [], [], []
    for _ in range(4):
        free.append(rate(busy, 0.4))
        throttle = Throttle(busy.pid, factor, period_s=0.05)
        throttle.start()
        try:
            slowed.append(rate(busy, 0.5))
        finally:
            throttle.stop()
        stopped.append(throttle.stopped_total_s / (throttle.ended_at - throttle.started_at))
        assert status(busy.pid) != psutil.STATUS_STOPPED
    ratio = statistics.median(f / s for f, s in zip(free, slowed, strict=True))
    print(f"factor {factor}: measured slowdown {ratio:.2f}, stopped {stopped}")
    # Generous: other engineers' processes share the 2 cores; the duty cycle itself is exact.
    assert factor * 0.6 < ratio < factor * 1.6, (free, slowed)
    assert statistics.median(stopped) == pytest.approx(1 - 1 / factor, abs=0.15)


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
