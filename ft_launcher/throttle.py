"""Slow a worker down from outside: SIGSTOP / SIGCONT at a fine duty cycle.

The ``rank_slow:factor=F`` simulated fault. In every period of ``period_s`` the process is
stopped for ``period_s * (1 - 1/F)`` and runs for ``period_s / F``, so whatever it does (CPU
work, a GPU launch loop, any script) advances at about 1/F of its speed, and it still sends
heartbeats: a slow rank, not a hung one.

Safety: the process is addressed through a pidfd opened when the throttle is created (the
launcher's own, live child), so a pid reused after the worker died is never signalled; only
that one process is signalled (not its children); ``stop()`` always leaves it continued.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("ft_launcher")

DEFAULT_PERIOD_S = 0.05
MIN_PERIOD_S = 0.002  # below this the signals themselves become the workload


@dataclass(frozen=True)
class DutyCycle:
    """How one period splits into a stopped and a running part."""

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


class Throttle:
    """Run one process at about 1/``factor`` of its speed until ``stop()``.

    ``start()`` starts a daemon thread; ``stop()`` ends it and sends a final SIGCONT, and is
    safe to call twice, before ``start()`` and after the process died. With ``duration_s``
    the throttle ends by itself after that long (a transient slowdown), leaving the process
    continued. Raises ProcessLookupError when ``pid`` is already gone.
    """

    def __init__(self, pid: int, factor: float, period_s: float = DEFAULT_PERIOD_S,
                 duration_s: float | None = None) -> None:
        if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s must be a positive number, got {duration_s!r}")
        self.cycle = duty_cycle(factor, period_s)
        self.factor = factor
        self.duration_s = duration_s
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

    def _run(self) -> None:
        c = self.cycle
        t0 = time.monotonic()
        end = t0 + self.duration_s if self.duration_s is not None else math.inf
        k = 0
        try:
            # Phases on an absolute schedule: a late wake-up shortens the next phase instead
            # of drifting the ratio.
            while not self._halt.is_set():
                period_start = t0 + k * c.period_s
                if period_start >= end:
                    break
                with self._lock:
                    if self._halt.is_set() or not self._target.send(signal.SIGSTOP):
                        break
                stopped_at = time.monotonic()
                self._halt.wait(max(0.0, period_start + c.stopped_s - stopped_at))
                with self._lock:
                    alive = self._target.send(signal.SIGCONT)
                self.stopped_total_s += time.monotonic() - stopped_at
                if not alive:
                    break
                k += 1
                self._halt.wait(max(0.0, t0 + k * c.period_s - time.monotonic()))
        finally:
            with self._lock:
                self._target.send(signal.SIGCONT)
            self.ended_at = time.monotonic()
            log.debug("throttle of pid %d ended after %.2f s (%.2f s stopped)", self.pid,
                      self.ended_at - t0, self.stopped_total_s)
