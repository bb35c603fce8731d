"""The stop fence: after a long stop, a rank asks its launcher whether its round still holds.

When a whole node is frozen (SIGSTOP of its launcher and workers, as a network partition or a
hung kernel looks), the other nodes drop it once its rendezvous keep-alive lapses and go on,
with a spare. On SIGCONT the node's workers may run before their launcher wakes up and stops
them: a rank that finished a collective just before the stop would go on to write that step's
progress or a checkpoint over the one the new world wrote. So a rank that was stopped long
enough to have been dropped first asks: its launcher answers "current" or "stale" (the
``fence`` message); on "stale", or no answer, the rank exits with ``STALE_EXIT_CODE`` at
once, before it touches a file (``os._exit``: no ``finally`` or ``atexit`` code runs).

Only when the launcher asks for it: ``FT_STOP_FENCE_S`` (set for a dynamic rendezvous) is the
shortest stop that may cost a node its place. A ticker thread notes gaps on the monotonic
clock; the SIGCONT handler, on the main thread (where the training writes), reads the gap and
blocks there until the launcher answers. Stops shorter than the threshold (the rank_slow
throttle stops a rank for milliseconds, many times a second) pass without a word.

A limit: the kernel hands a process's SIGCONT to any one thread that does not block it, and
Python sets the main thread's handler going from that thread. When another thread takes it
and waits for a CPU while the main thread runs, the main thread may get as far as a write
first. The ticker blocks SIGCONT (so does ZeroMQ in its threads); threads that libraries
start (gloo's, say) inherit the mask of the thread that starts them, and do not.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ft_agent")

STOP_FENCE_ENV = "FT_STOP_FENCE_S"
# sysexits' EX_TEMPFAIL: this rank's round is over; the node re-joins, nothing is broken.
STALE_EXIT_CODE = 75
MIN_TICK_S, MAX_TICK_S = 0.05, 0.25

# ask(stopped_s) -> (True, "") current | (False, why) stale | (None, why) no answer
Ask = Callable[[float], "tuple[bool | None, str]"]


@dataclass
class StopDetector:
    """Pure: was the process stopped for ``threshold_s`` or more? (clock injected)

    ``tick`` runs often on a thread of its own; a gap between two ticks of at least the
    threshold is a stop (or a process starved of CPU that long), kept until the next
    ``resumed``. ``resumed`` runs on SIGCONT: the stop is the longer of the gap since the
    last tick and a gap a tick saw already (after a SIGCONT the ticker may run before the
    handler does, and would otherwise hide the stop).
    """

    threshold_s: float
    last_tick: float
    pending_s: float = 0.0

    @property
    def tick_s(self) -> float:
        """How often to tick: four ticks per threshold, within [MIN_TICK_S, MAX_TICK_S]."""
        return min(MAX_TICK_S, max(MIN_TICK_S, self.threshold_s / 4))

    def tick(self, now: float) -> None:
        gap = now - self.last_tick
        if gap >= self.threshold_s:
            self.pending_s = max(self.pending_s, gap)
        self.last_tick = now

    def resumed(self, now: float) -> float | None:
        """On SIGCONT: the stop's length when it reached the threshold, else None."""
        gap = max(now - self.last_tick, self.pending_s)
        self.pending_s = 0.0
        self.last_tick = now
        return gap if gap >= self.threshold_s else None


def threshold_from_env(env: Mapping[str, str]) -> float | None:
    """``FT_STOP_FENCE_S`` as seconds; None when unset or not a positive number (warned)."""
    text = env.get(STOP_FENCE_ENV)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        log.warning("ignoring %s=%r: expected positive seconds", STOP_FENCE_ENV, text)
        return None
    return value


class StopFence:
    """The ticker thread and the SIGCONT handler of one process (see the module text)."""

    def __init__(self, threshold_s: float, ask: Ask,
                 clock: Callable[[], float] = time.monotonic,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.detector = StopDetector(threshold_s, clock())
        self._ask = ask
        self._clock = clock
        self._exit = exit
        # Reentrant: a second SIGCONT may run the handler again inside the first one.
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self.installed = False

    def install(self) -> bool:
        """Start ticking and handle SIGCONT; False where signals cannot be handled (not
        the main thread), and then the process runs as without a fence."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("%s: stop fence not armed (initialised off the main thread)",
                        STOP_FENCE_ENV)
            return False
        self._previous = signal.signal(signal.SIGCONT, self._on_sigcont)
        self._thread = threading.Thread(target=self._run, name="ft-stop-fence", daemon=True)
        self._thread.start()
        self.installed = True
        return True

    def close(self) -> None:
        """Stop ticking; give SIGCONT back to whoever had it (from the main thread)."""
        self._stop.set()
        if self.installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCONT, self._previous if self._previous is not None
                          else signal.SIG_DFL)
            self.installed = False

    def _run(self) -> None:
        # A SIGCONT sent to the process is handled by one thread that does not block it,
        # and Python runs the handler on the main thread only once that thread has run
        # the C half of it: taken by this thread, while the main thread gets a CPU first,
        # the main thread could write before it stops in the handler. So never this one.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCONT})
        while not self._stop.wait(self.detector.tick_s):
            with self._lock:
                self.detector.tick(self._clock())

    def _on_sigcont(self, signum: int, frame: Any) -> None:
        with self._lock:
            stopped = self.detector.resumed(self._clock())
        if stopped is not None:
            self.check(stopped)
        if callable(self._previous):
            self._previous(signum, frame)

    def check(self, stopped_s: float) -> None:
        """Ask the launcher; return when the round is current, else exit at once."""
        current, why = self._ask(stopped_s)
        if current:
            log.info("stopped %.1f s; the launcher says this rank's round is current",
                     stopped_s)
            return
        what = "stale" if current is False else "no answer"
        # Straight to the file descriptor: logging may be configured to drop it, and
        # nothing that could write a file runs after this.
        try:
            os.write(sys.stderr.fileno(), (
                f"ft_agent: this rank was stopped {stopped_s:.1f} s and its round is over "
                f"({what}: {why}); exiting {STALE_EXIT_CODE} before writing anything\n"
            ).encode(errors="replace"))
        except (OSError, ValueError, AttributeError):
            pass
        self._exit(STALE_EXIT_CODE)
