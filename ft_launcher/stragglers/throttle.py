"""Slow a worker down from outside: SIGSTOP / SIGCONT at a fine duty cycle.

The ``rank_slow:factor=F`` simulated fault of a rank that times no sections (one that does
stretches its sections itself: ft_agent/simulated_fault.py, and this throttle ends when it
closes one). The process keeps running most of the time (it
still heartbeats: a slow rank, not a hung one) but gets only 1/F of the CPU it would get,
so whatever it does advances at about 1/F of its speed, for any script.

A fixed wall-clock duty cycle (run P/F, stop the rest of each period P) is exact on an idle
machine, but not on an oversubscribed one: the scheduler hands a resumed process a better
share than its busy neighbours get, and 4 ranks on 2 cores throttled "2x" ran only ~1.2-1.4x
slower. So the throttle budgets CPU time instead: it reads how much CPU the process used
(``/proc/PID/task/*/schedstat``) and how much of their runnable time its peers (the other
ranks, read only) got, and lets it use ``peer share / F`` of a CPU,
in a token bucket of one period: stopped when the bucket is empty, resumed when it is half
full. Without /proc it falls back to the wall-clock duty cycle.

Safety: the process is signalled through a pidfd opened when the throttle is created (the
launcher's own, live child), so a pid reused after the worker died is never signalled; only
that one process is signalled (not its children, never a peer); ``stop()`` always leaves it
continued.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("ft_launcher")

DEFAULT_PERIOD_S = 0.05
MIN_PERIOD_S = 0.002  # below this the signals themselves become the workload
SHARE_REFRESH_S = 0.25  # how often the peers' CPU share is re-read
# The first read comes sooner: until then the budget assumes a whole CPU, which on a loaded
# machine lets the victim run at full speed (measured: its first ~5 steps of 35 ms).
FIRST_SHARE_S = 0.05
MIN_RUNNABLE_FRACTION = 0.05  # a peer runnable less than this of the time says nothing
# Budget banked while the process waits for a CPU after being resumed (a loaded machine
# makes it wait); with less, the wait's budget would be lost and it would run slower.
BANK_PERIODS = 4


@dataclass(frozen=True)
class DutyCycle:
    """How one period splits into a stopped and a running part (on an idle machine)."""

    period_s: float
    stopped_s: float
    running_s: float

    @property
    def speed(self) -> float:
        """The fraction of its own speed the process keeps (1/factor)."""
        return self.running_s / self.period_s


def duty_cycle(factor: float, period_s: float = DEFAULT_PERIOD_S) -> DutyCycle:
    """The split of one period that slows a process to 1/``factor`` of its speed."""
    if not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
    if not (math.isfinite(period_s) and period_s >= MIN_PERIOD_S):
        raise ValueError(f"period_s must be at least {MIN_PERIOD_S}, got {period_s!r}")
    running = period_s / factor
    return DutyCycle(period_s, period_s - running, running)


@dataclass
class CpuBudget:
    """Token bucket of CPU seconds: ``share / factor`` CPU seconds per second, at most
    BANK_PERIODS periods' worth banked; stopped when empty, resumed at half a period's
    worth. Pure: the caller supplies the clock and the CPU used."""

    factor: float
    period_s: float = DEFAULT_PERIOD_S
    running: bool = True
    tokens: float = field(init=False)
    _t: float | None = field(default=None, init=False)
    _used: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        duty_cycle(self.factor, self.period_s)  # validates
        self.tokens = self.period_s / self.factor

    def step(self, now: float, used_s: float, share: float) -> bool:
        """Account the CPU seconds used so far (cumulative) at time ``now``, where a peer
        gets ``share`` of a CPU; True when the process may run."""
        rate = share / self.factor
        per_period = rate * self.period_s
        if self._t is not None:
            refill = rate * max(0.0, now - self._t)
            self.tokens = min(BANK_PERIODS * per_period, self.tokens + refill) - max(
                0.0, used_s - self._used)
        self._t, self._used = now, used_s
        if self.running and self.tokens <= 0:
            self.running = False
        elif not self.running and self.tokens >= per_period / 2:
            self.running = True  # hysteresis: resume half a period's budget later
        return self.running

    def next_check_s(self, share: float) -> float:
        """When to look again: a fifth of a period while running; when half a period's
        budget is back while stopped."""
        if self.running:
            return self.period_s / 5
        rate = share / self.factor
        return max(self.period_s / 5, (rate * self.period_s / 2 - self.tokens) / rate)


def cpu_share(before: tuple[float, float], after: tuple[float, float],
              elapsed_s: float) -> float | None:
    """Fraction of its runnable time a process ran, from two (run_s, wait_s) samples of
    schedstat; None when it was runnable too little of ``elapsed_s`` to tell."""
    ran, waited = after[0] - before[0], after[1] - before[1]
    runnable = ran + waited
    if ran < 0 or waited < 0 or runnable < MIN_RUNNABLE_FRACTION * elapsed_s or runnable <= 0:
        return None
    return min(1.0, ran / runnable)


def _task_schedstat(pid: int, tid: int | str) -> tuple[float, float] | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None  # a thread that ended, or no schedstat in this kernel


def schedstat(pid: int) -> dict[int, tuple[float, float]] | None:
    """{thread id: (seconds on a CPU, seconds waiting on a run queue)} of a process's
    threads (the work may not be on the main thread); None when unknown."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out = {}
    for tid in tids:
        sample = _task_schedstat(pid, tid)
        if sample is not None and tid.isdigit():
            out[int(tid)] = sample
    return out or None


class ProcessCpu:
    """Cumulative CPU and run-queue seconds of one process, nanosecond-exact and cheap
    enough to read every few milliseconds: a full read of every thread on ``refresh()``,
    in between only the threads that were busy in the last refresh window."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.run_s = 0.0
        self.wait_s = 0.0
        self._last: dict[int, tuple[float, float]] = {}
        self._busy: list[int] = []
        self._first = True
        self.refreshed_at = -math.inf

    def refresh(self) -> bool:
        """Read every thread; False when the process is gone or unreadable."""
        now = schedstat(self.pid)
        if now is None:
            return False
        busy = []
        for tid, (run, wait) in now.items():
            # A thread born since the last read counts from zero; at the first read, from now.
            last = self._last.get(tid, (run, wait) if self._first else (0.0, 0.0))
            self.run_s += max(0.0, run - last[0])
            self.wait_s += max(0.0, wait - last[1])
            if run > last[0] or self._first:
                busy.append(tid)
        self._last, self._busy, self._first = now, busy, False
        self.refreshed_at = time.monotonic()
        return True

    def used(self) -> float:
        """CPU seconds so far (the busy threads read now, the others as of the refresh)."""
        for tid in self._busy:
            sample = _task_schedstat(self.pid, tid)
            last = self._last.get(tid)
            if sample is None or last is None:
                continue
            self.run_s += max(0.0, sample[0] - last[0])
            self.wait_s += max(0.0, sample[1] - last[1])
            self._last[tid] = sample
        return self.run_s


class _Target:
    """One process, addressed through a pidfd where the kernel has them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.closed = False
        self._fd: int | None = None
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise
        except (AttributeError, OSError):  # old kernel or a seccomp filter: plain kill
            os.kill(pid, 0)  # raises ProcessLookupError when it is gone

    def send(self, signum: int) -> bool:
        """Deliver ``signum``; False when the process is gone or the target closed."""
        if self.closed:
            return False
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, signum)
            else:
                os.kill(self.pid, signum)
            return True
        except ProcessLookupError:
            return False

    def close(self) -> None:
        self.closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _PeerShare:
    """The median CPU share of the peers while runnable, re-read every SHARE_REFRESH_S."""

    def __init__(self, meters: Sequence[ProcessCpu]) -> None:
        self.meters = list(meters)
        self.share = 1.0  # until measured: a whole CPU (the idle-machine duty cycle)
        self._last: dict[int, tuple[float, float]] = {}
        self._at: float | None = None
        self._measured = False

    def update(self, now: float) -> float:
        every = SHARE_REFRESH_S if self._measured else FIRST_SHARE_S
        if self._at is not None and now - self._at < every:
            return self.share
        elapsed, self._at = (now - self._at if self._at is not None else 0.0), now
        shares = []
        for meter in self.meters:
            if not meter.refresh():
                continue
            sample = (meter.run_s, meter.wait_s)
            before = self._last.get(meter.pid)
            self._last[meter.pid] = sample
            share = cpu_share(before, sample, elapsed) if before is not None else None
            if share is not None:
                shares.append(share)
        if shares:
            share = max(0.01, statistics.median(shares))
            # Smoothed over ~1 s: in a synchronous job the peers block on the slow rank and
            # a single window's share jumps around.
            self.share = share if not self._measured else 0.7 * self.share + 0.3 * share
            self._measured = True
        return self.share


class Throttle:
    """Run one process at about 1/``factor`` of its speed until ``stop()``.

    ``peers``: pids of processes doing the same work (the other local ranks), read only,
    as the reference for the CPU share; without them, the process's own share while it
    is allowed to run (which a loaded scheduler inflates).
    ``start()`` starts a daemon thread; ``stop()`` ends it and sends a final SIGCONT, and is
    safe to call twice, before ``start()`` and after the process died. With ``duration_s``
    the throttle ends by itself after that long (a transient slowdown), leaving the process
    continued. ``until``: asked every look; when it returns True the throttle ends (the
    rank slows its own sections from then on). Raises ProcessLookupError when ``pid`` is
    already gone.
    """

    def __init__(self, pid: int, factor: float, period_s: float = DEFAULT_PERIOD_S,
                 duration_s: float | None = None, peers: Sequence[int] = (),
                 until: Callable[[], bool] = lambda: False) -> None:
        if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s must be a positive number, got {duration_s!r}")
        self.cycle = duty_cycle(factor, period_s)
        self.factor = factor
        self.duration_s = duration_s
        self.peers = [p for p in peers if p != pid]
        self.until = until
        self._target = _Target(pid)
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stopped_total_s = 0.0  # time the process spent stopped by this throttle
        self.started_at: float | None = None
        self.ended_at: float | None = None

    @property
    def pid(self) -> int:
        return self._target.pid

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Begin throttling (from a daemon thread)."""
        if self._thread is not None or self._halt.is_set():
            return
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{self.pid}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop throttling; the process is left continued (when it is still alive)."""
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._target.send(signal.SIGCONT)
            self._target.close()

    def _signal(self, signum: int) -> bool:
        with self._lock:
            return not self._halt.is_set() and self._target.send(signum)

    def _run(self) -> None:
        t0 = time.monotonic()
        end = t0 + self.duration_s if self.duration_s is not None else math.inf
        budget = CpuBudget(self.factor, self.cycle.period_s)
        victim = ProcessCpu(self.pid)
        measured = victim.refresh()
        # Without peers, its own share while allowed to run is the reference.
        reference = _PeerShare([ProcessCpu(p) for p in self.peers] or [victim])
        wall_used, stopped_at = 0.0, None
        last = t0
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                if now >= end or self.until():
                    break
                if stopped_at is None:
                    wall_used += now - last
                last = now
                share = reference.update(now) if measured else 1.0
                if measured and now - victim.refreshed_at >= SHARE_REFRESH_S:
                    measured = victim.refresh()  # threads that became busy; gone: wall
                used = victim.used() if measured else wall_used
                run = budget.step(now, used, share)
                if not run and stopped_at is None:
                    if not self._signal(signal.SIGSTOP):
                        break
                    stopped_at = time.monotonic()
                elif run and stopped_at is not None:
                    if not self._signal(signal.SIGCONT):
                        break
                    self.stopped_total_s += time.monotonic() - stopped_at
                    stopped_at = None
                self._halt.wait(min(budget.next_check_s(share), max(0.0, end - now)))
        finally:
            with self._lock:
                self._target.send(signal.SIGCONT)
            self.ended_at = time.monotonic()
            if stopped_at is not None:
                self.stopped_total_s += self.ended_at - stopped_at
            log.debug("throttle of pid %d ended after %.2f s (%.2f s stopped)", self.pid,
                      self.ended_at - t0, self.stopped_total_s)
