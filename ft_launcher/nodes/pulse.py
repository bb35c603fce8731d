"""A node's pulse: a thread that increments the node's keep-alive counter every interval and,
while the node is in a round, waits in between on the next round's notice, which the store
pushes the moment anyone opens that round. Two requests per interval, whatever the job's
size; the training's watch loop reads what the pulse learnt without any request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ft_launcher.nodes.kv import KeyValue, StoreUnreachable
from ft_launcher.nodes.records import Keys, Notice, RecordError

log = logging.getLogger("ft_launcher")


@dataclass(frozen=True)
class PulseState:
    """What the pulse knows, as of one read (``Pulse.state``)."""

    notice: Notice | None  # the next round's notice, once it is open
    beat_gap_s: float  # longest gap between two keep-alives since the round was watched
    unreachable_s: float | None  # how long the store has not answered; None: it answers


class Pulse:
    """Keeps ``node`` alive in ``kv`` (a client of its own: a c10d client is not
    thread-safe) and watches the round given to ``watch``."""

    def __init__(self, kv: KeyValue, node: str, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self.node, self.interval, self.clock = kv, node, interval, clock
        self._lock = threading.Lock()
        self._round: int | None = None
        self._notice: Notice | None = None
        self._last_beat = clock()
        self._gap = 0.0
        self._failing_since: float | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # stop, or a new round to watch
        self._thread = threading.Thread(target=self._run, name="ft-rdzv-pulse", daemon=True)

    def start(self) -> None:
        self.beat()  # the counter exists before the node joins anything
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=3 * self.interval + 1)

    def watch(self, g: int | None) -> None:
        """Watch for the round after ``g`` (None: the node is in no round)."""
        with self._lock:
            self._round, self._notice = g, None
            self._gap = self.clock() - self._last_beat
        self._wake.set()

    def state(self) -> PulseState:
        now = self.clock()
        with self._lock:
            gap = max(self._gap, now - self._last_beat)
            failing = None if self._failing_since is None else now - self._failing_since
            return PulseState(self._notice, gap, failing)

    def beat(self) -> None:
        """One keep-alive (raises StoreUnreachable)."""
        self.kv.add(Keys.alive(self.node), 1)
        now = self.clock()
        with self._lock:
            self._gap = max(self._gap, now - self._last_beat)
            self._last_beat, self._failing_since = now, None

    def _run(self) -> None:
        next_beat = self.clock() + self.interval
        while not self._stop.is_set():
            try:
                self._wait_until(next_beat)
                if self._stop.is_set():
                    break
                next_beat = self.clock() + self.interval
                self.beat()
            except StoreUnreachable as exc:
                with self._lock:
                    if self._failing_since is None:
                        self._failing_since = self.clock()
                        log.warning("rendezvous: keep-alive failed: %s", exc)
                self._sleep(self.interval)
                next_beat = self.clock()

    def _wait_until(self, deadline: float) -> None:
        """Until ``deadline``: wait on the next round's notice while there is one to wait
        for, else sleep."""
        while not self._stop.is_set():
            self._wake.clear()
            with self._lock:
                g, known = self._round, self._notice is not None
            left = deadline - self.clock()
            if left <= 0:
                return
            if g is None or known:
                if not self._sleep(left):
                    return
                continue  # woken: a round to watch now
            self._watch_once(g, left)
            return

    def _sleep(self, seconds: float) -> bool:
        """Sleep; True when woken early (stop, or a round to watch)."""
        return self._wake.wait(max(0.0, seconds))

    def _watch_once(self, g: int, left: float) -> None:
        deadline = self.clock() + left
        data = self.kv.wait(Keys.open(g + 1), max(left, 0.001))
        if data is None:
            return
        try:
            notice = Notice.decode(data)
        except RecordError as exc:  # untrusted: still, the next round is open
            log.warning("rendezvous: round %d's notice is malformed (%s)", g + 1, exc)
            notice = Notice(g + 1, "rejoin", "unknown")
        with self._lock:
            if self._round == g:
                self._notice = notice
        self._sleep(deadline - self.clock())
