"""Device (GPU) time of a section, from CUDA events, without synchronising the training.

``client.section("compute", device=True)`` records a start event on the current stream when
the section opens and an end event when it closes. The GPU runs those events later, when it
reaches them, so the elapsed time of *this* section is not known at its close: waiting for
it (``event.synchronize()``) would stall the host on every step. Instead each close reports
the device time of the oldest earlier section whose end event has completed
(``event.query()``, which never blocks), so device times reach the monitor a step or a few
late, in order, and the training never waits.

torch is imported only when a device section is first timed (``ft_agent`` stays cheap for
CPU jobs). The event factory is injectable so the bookkeeping is tested without a GPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

# Sections whose end has not completed on the device yet, per name. A device that falls
# this far behind the host (or a stream that never runs) drops the oldest: memory stays
# bounded and the reported times stay recent.
MAX_PENDING = 64
# Events kept for reuse per name (creating a CUDA event costs more than recording one).
MAX_POOL = 2 * MAX_PENDING


def _cuda_event() -> Any:
    import torch  # deferred: only a device section pays for it

    return torch.cuda.Event(enable_timing=True)


class DeviceTimer:
    """Start/end events per section name; ``close`` returns a completed earlier section's
    device time in seconds, or None when none has completed yet."""

    def __init__(self, new_event: Callable[[], Any] = _cuda_event) -> None:
        self._new_event = new_event
        self._open: dict[str, Any] = {}
        self._pending: dict[str, deque[tuple[Any, Any]]] = {}
        self._pool: list[Any] = []
        self.dropped = 0  # sections whose device time was never reported (backlog full)

    def open(self, name: str) -> None:
        """Record the start event of ``name`` on the current stream."""
        event = self._take()
        event.record()
        stale = self._open.pop(name, None)  # opened twice without a close: keep the last
        if stale is not None:
            self._give(stale)
        self._open[name] = event

    def close(self, name: str) -> float | None:
        """Record the end event of ``name``; return the device seconds of the oldest earlier
        section of ``name`` that has completed (None when none has, or none was opened)."""
        start = self._open.pop(name, None)
        pending = self._pending.setdefault(name, deque())
        if start is not None:
            end = self._take()
            end.record()
            pending.append((start, end))
            if len(pending) > MAX_PENDING:
                self._give(*pending.popleft())
                self.dropped += 1
        return self._completed(pending)

    def _completed(self, pending: deque[tuple[Any, Any]]) -> float | None:
        # Only the oldest is looked at: events on one stream complete in order, and one
        # report per close keeps pace with the sections.
        if not pending or not pending[0][1].query():
            return None
        start, end = pending.popleft()
        seconds = start.elapsed_time(end) / 1000.0  # milliseconds
        self._give(start, end)
        return seconds

    def _take(self) -> Any:
        return self._pool.pop() if self._pool else self._new_event()

    def _give(self, *events: Any) -> None:
        for event in events:
            if len(self._pool) < MAX_POOL:
                self._pool.append(event)
