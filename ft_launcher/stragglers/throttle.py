"""Slow a worker's work from outside: stop it for (F-1) times each slice of work it does.

The ``rank_slow:factor=F`` simulated fault of a rank that times no sections (one that does
stretches its sections itself: ft_agent/simulated_fault.py, and this throttle ends when it
closes one). A real straggler (a slow GPU, a throttled core) is slow in its *work*: its
sleeps and its waits in a collective last as long as anyone's. So the throttle charges
only the time the process wants a CPU: it reads the process's runnable time (on a CPU plus
waiting on a run queue, ``/proc/PID/task/*/schedstat``, every thread, nanosecond-exact)
every POLL_S, and owes (F-1) times each slice of it as wall time stopped (SIGSTOP, then
SIGCONT). Work is counted at most one second per wall second (threads running in parallel
are one process's work, not several). The debt is paid only while the process is working
(a thread of it is runnable, state R in ``/proc/PID/task/*/stat``, at that look), so a stop
lands in the work and not in a sleep or a wait; a stop lasts at most ``max_stop_s`` (it
stays a slow rank, not a hung one). Counting the run-queue wait makes a loaded machine no
excuse: work that waits for a CPU half the time is stretched from what it takes there, as
its peers' is; and as a scheduler runs a process it just resumed sooner than its busy
neighbours, the debt is scaled by the victim's CPU share over its peers' (``peers``).

Safety: the process is signalled through a pidfd opened when the throttle is created (the
launcher's own, live child), so a pid reused after the worker died is never signalled; only
that one process is signalled (not its children, never a peer); every way out of the
throttle leaves it continued.
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

POLL_S = 0.001  # how often the runnable time is read: a stop lands within ~1 ms of work
MIN_STOP_S = 0.002  # owed less than this, no stop: the signals would be the workload
DEFAULT_MAX_STOP_S = 0.05  # one stop at most (a stop begun at the end of the work runs on
# into what follows it by up to this much); the rest of a debt is paid at the next looks
DEBT_CAP_S = 1.0  # a debt never paid (work in slivers too short to see) stays bounded
BANK_CAP_S = 0.02  # runnable time read but not yet charged (a few kernel ticks' worth)
REFRESH_S = 0.1  # every thread re-read this often (a thread that became busy)
BUSY_RUN_S = 0.001  # a thread that ran less than this in a refresh window is idle
STOP_POLL_S = 0.0002  # how often a sent SIGSTOP is checked for having taken effect
SHARE_REFRESH_S = 0.25  # how often the CPU shares (victim's, peers') are re-read
MIN_RUNNABLE_FRACTION = 0.05  # runnable less than this of a window: its share says nothing
# A peer is a pace to compare with only while it is busy too (runnable this much of the
# window): in a synchronous job peers mostly wait for the slow rank, and the few ms they
# run after each wait carry the wake-up's latency, not the pace of their work.
PEER_RUNNABLE_FRACTION = 0.5
MAX_SPEEDUP = 4.0  # the victim's share over its peers' is believed up to 4


def cpu_share(before: tuple[float, float], after: tuple[float, float], elapsed_s: float,
              min_fraction: float = MIN_RUNNABLE_FRACTION) -> float | None:
    """Fraction of its runnable time a process ran, from two (run_s, wait_s) samples of
    schedstat; None when it was runnable less than ``min_fraction`` of ``elapsed_s``."""
    ran, waited = after[0] - before[0], after[1] - before[1]
    runnable = ran + waited
    if ran < 0 or waited < 0 or runnable < min_fraction * elapsed_s or runnable <= 0:
        return None
    return min(1.0, ran / runnable)


def check_factor(factor: float) -> float:
    """``factor`` when it is a finite number > 1, else ValueError."""
    if not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
    return factor


@dataclass
class CpuDebt:
    """Wall time owed as stops: (factor - 1) x each slice of work (factor x speedup - 1
    where the process runs faster than its peers). Pure: the caller supplies the clock, the
    process's cumulative runnable seconds and whether it is runnable now.

    ``observe(now, runnable_s, working, speedup)`` after each read; ``stop_for()`` says how
    long to stop now (0: not now); ``resumed(s)`` after a stop of ``s`` wall seconds.
    """

    factor: float
    max_stop_s: float = DEFAULT_MAX_STOP_S
    min_stop_s: float = MIN_STOP_S
    debt_s: float = 0.0
    active: bool = False
    _t: float | None = field(default=None, init=False)
    _runnable: float = field(default=0.0, init=False)
    _banked: float = field(default=0.0, init=False)
    _stopped: float = field(default=0.0, init=False)  # of the look under way

    def __post_init__(self) -> None:
        check_factor(self.factor)
        if not (math.isfinite(self.max_stop_s) and self.max_stop_s >= self.min_stop_s > 0):
            raise ValueError(f"max_stop_s must be at least {self.min_stop_s}, "
                             f"got {self.max_stop_s!r}")

    def observe(self, now: float, runnable_s: float, working: bool, speedup: float = 1.0
                ) -> None:
        """Account the process's runnable seconds so far (cumulative) at time ``now``;
        ``working``: it is runnable at this moment (a stop now lands in its work);
        ``speedup``: its CPU share while runnable over its peers' (a scheduler favours a
        process it just resumed: its work then goes faster than theirs, so it owes more)."""
        if self._t is not None:
            wall = max(0.0, now - self._t - self._stopped)
            # The kernel adds a running task's time at its tick (4 ms at HZ=250), in lumps:
            # banked and spent at most one wall second per second, so nothing is lost and
            # threads running side by side count as one process's work.
            self._banked += max(0.0, runnable_s - self._runnable)
            work = min(wall, self._banked)
            self._banked = min(BANK_CAP_S, self._banked - work)
            owed = self.factor * min(MAX_SPEEDUP, max(1.0, speedup)) - 1
            self.debt_s = min(DEBT_CAP_S, self.debt_s + owed * work)
        self._t, self._runnable, self._stopped = now, max(runnable_s, self._runnable), 0.0
        self.active = working

    def stop_for(self) -> float:
        """Seconds to stop the process now: 0 unless it is working and owes enough."""
        if not self.active or self.debt_s < self.min_stop_s:
            return 0.0
        return min(self.debt_s, self.max_stop_s)

    def resumed(self, stopped_s: float) -> None:
        """The process was stopped ``stopped_s`` wall seconds (from when the stop took
        effect): the debt is paid that much, and that time is not time it could work in."""
        stopped_s = max(0.0, stopped_s)
        self.debt_s = max(0.0, self.debt_s - stopped_s)
        self._stopped += stopped_s
        self.active = False  # look again before the next stop


def _task_schedstat(pid: int, tid: int | str) -> tuple[float, float] | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None  # a thread that ended, or no schedstat in this kernel


def _task_state(pid: int, tid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            text = f.read()
        # "tid (comm) S ...": the command may hold spaces and parentheses, so after the last.
        return text[text.rindex(b")") + 2:][:1].decode("ascii")
    except (OSError, ValueError, UnicodeDecodeError):
        return None


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
        self._at_refresh: dict[int, tuple[float, float]] = {}
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
            # Busy: it ran since the last refresh (not since the last ``used()``, which the
            # kernel's tick may not have caught up with) for more than a wake-up's worth.
            before = self._at_refresh.get(tid, (0.0, 0.0))
            if run - before[0] >= BUSY_RUN_S or self._first:
                busy.append(tid)
            self.run_s += max(0.0, run - last[0])
            # The wait of a thread that did no work is not work waiting for a CPU: idle
            # threads are woken by every SIGSTOP and SIGCONT, and wait on a loaded machine.
            if tid in busy or tid in self._busy:
                self.wait_s += max(0.0, wait - last[1])
        self._last, self._busy, self._first = now, busy, False
        self._at_refresh = dict(now)
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

    def stopped(self) -> bool:
        """Every thread that was busy in the last refresh window is stopped (state T)."""
        return all(_task_state(self.pid, tid) in ("T", None) for tid in self._busy)

    def working(self) -> bool:
        """A thread that was busy in the last refresh window is runnable now (state R)."""
        return any(_task_state(self.pid, tid) == "R" for tid in self._busy)

    def runnable(self) -> float:
        """Seconds on a CPU or waiting for one so far (as ``used()``)."""
        self.used()
        return self.run_s + self.wait_s


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


class _Share:
    """The median CPU share while runnable of some processes, re-read every
    SHARE_REFRESH_S and smoothed over ~1 s; None until a window says something."""

    def __init__(self, meters: Sequence[ProcessCpu], refresh: bool = True,
                 min_fraction: float = MIN_RUNNABLE_FRACTION) -> None:
        self.meters = list(meters)
        self.refresh = refresh  # False: the meters are kept up to date by their owner
        self.min_fraction = min_fraction
        self.share: float | None = None
        self._last: dict[int, tuple[float, float]] = {}
        self._at: float | None = None

    def update(self, now: float) -> float | None:
        if self._at is not None and now - self._at < SHARE_REFRESH_S:
            return self.share
        elapsed, self._at = (now - self._at if self._at is not None else 0.0), now
        shares = []
        for meter in self.meters:
            if self.refresh and not meter.refresh():
                continue
            sample = (meter.run_s, meter.wait_s)
            before = self._last.get(meter.pid)
            self._last[meter.pid] = sample
            if before is not None:
                share = cpu_share(before, sample, elapsed, self.min_fraction)
                shares.append(share) if share is not None else None
        if not shares:
            self.share = None  # a window that says nothing: no pace to compare with now
            return None
        share = max(0.01, statistics.median(shares))
        self.share = share if self.share is None else 0.7 * self.share + 0.3 * share
        return self.share


def speedup(own: float | None, peers: float | None) -> float:
    """The victim's CPU share while runnable over its busy peers', at least 1 (a victim
    that gets less than its peers waits longer, and its wait is charged as work already);
    1 unless both are known."""
    return 1.0 if own is None or peers is None else max(1.0, own / peers)


class Throttle:
    """Stretch one process's work to ``factor`` times until ``stop()``.

    ``start()`` starts a daemon thread; ``stop()`` ends it and sends a final SIGCONT, and is
    safe to call twice, before ``start()`` and after the process died. With ``duration_s``
    the throttle ends by itself after that long (a transient slowdown), leaving the process
    continued. ``until``: asked every look; when it returns True the throttle ends (the
    rank slows its own sections from then on). Raises ProcessLookupError when ``pid`` is
    already gone; ValueError for a factor not > 1 or a bad ``max_stop_s``. ``peers``: pids
    of processes doing the same work (the other local ranks), only read: their CPU share is
    the pace the victim's work is stretched from (without them, its own).
    """

    def __init__(self, pid: int, factor: float, duration_s: float | None = None,
                 until: Callable[[], bool] = lambda: False, peers: Sequence[int] = (),
                 max_stop_s: float = DEFAULT_MAX_STOP_S, poll_s: float = POLL_S) -> None:
        if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s must be a positive number, got {duration_s!r}")
        CpuDebt(factor, max_stop_s)  # validates
        self.factor = factor
        self.max_stop_s = max_stop_s
        self.poll_s = poll_s
        self.duration_s = duration_s
        self.until = until
        self.peers = [p for p in peers if p != pid]
        self._target = _Target(pid)
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stopped_total_s = 0.0  # time the process spent stopped by this throttle
        self.stops = 0
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
        debt = CpuDebt(self.factor, self.max_stop_s)
        meter = ProcessCpu(self.pid)
        own = _Share([meter], refresh=False)
        peers = _Share([ProcessCpu(p) for p in self.peers], min_fraction=PEER_RUNNABLE_FRACTION)
        try:
            while not self._halt.is_set() and meter.refresh():
                refreshed = time.monotonic()
                while not self._halt.is_set() and time.monotonic() - refreshed < REFRESH_S:
                    now = time.monotonic()
                    if now >= end or self.until():
                        return
                    faster = speedup(own.update(now), peers.update(now))
                    debt.observe(now, meter.runnable(), meter.working(), faster)
                    stop_s = min(debt.stop_for(), end - now)
                    if stop_s <= 0:
                        self._halt.wait(self.poll_s)
                    elif not self._stop_once(stop_s, debt, meter):
                        return
        finally:
            with self._lock:
                self._target.send(signal.SIGCONT)
            self.ended_at = time.monotonic()
            log.debug("throttle of pid %d ended after %.2f s (%.2f s stopped in %d stops)",
                      self.pid, self.ended_at - t0, self.stopped_total_s, self.stops)

    def _stop_once(self, stop_s: float, debt: CpuDebt, meter: ProcessCpu) -> bool:
        """One SIGSTOP ... SIGCONT of ``stop_s``; False when the process is gone (or the
        throttle is halting: ``_run``'s exit continues it)."""
        meter.used()
        wait_before = meter.wait_s
        if not self._signal(signal.SIGSTOP):
            return False
        # A SIGSTOP takes effect once a thread of the process has run to take it: on a
        # loaded machine, a while later, and the process works until then. Timed from then.
        sent = time.monotonic()
        while not meter.stopped() and time.monotonic() - sent < stop_s:
            time.sleep(STOP_POLL_S)
        stopped_at = time.monotonic()
        self._halt.wait(max(0.0, stop_s - (stopped_at - sent)))
        # Timed before the SIGCONT: the process it wakes may take this thread's CPU, and
        # the process works meanwhile (seen with every core busy: a third of each "stop").
        stopped_s = time.monotonic() - stopped_at
        resumed = self._signal(signal.SIGCONT)
        self.stopped_total_s += stopped_s
        self.stops += 1
        # Waiting on a run queue for a CPU to take the SIGSTOP on is not work: forgotten.
        meter.used()
        meter.wait_s = wait_before
        debt.resumed(stopped_s)
        return resumed
