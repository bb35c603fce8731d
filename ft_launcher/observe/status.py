"""The launcher's periodic status line, from a ledger summary (pure formatting).

The supervisor prints it every ``--ft-status-interval`` seconds so a person can follow the
job among the ranks' output: elapsed time, cycle, restarts, the last step a rank reported,
and the goodput so far.
"""

from __future__ import annotations

import math
from typing import Any


def _elapsed(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def status_line(summary: dict[str, Any], now: float) -> str:
    """One line such as ``status: 0:12:04 elapsed | cycle 1 | 1 restart | step 1200 |
    goodput 87.3%``. ``summary`` is ``Ledger.summary(now)``; unknown figures show as ``-``."""
    attempts = summary.get("attempts") or []
    current = attempts[-1] if attempts else {}
    start = current.get("start_ts", summary.get("start_ts"))
    elapsed = _elapsed(now - start) if isinstance(start, (int, float)) else "-"
    cycle = summary.get("cycle")
    restarts = current.get("restarts", summary.get("restarts")) or 0
    step = summary.get("last_step")
    goodput = current.get("goodput", summary.get("goodput"))
    parts = [
        f"status: {elapsed} elapsed",
        f"cycle {cycle if cycle is not None else '-'}",
        f"{restarts} restart{'' if restarts == 1 else 's'}",
        f"step {step if step is not None else '-'}",
        "goodput " + (f"{100 * goodput:.1f}%" if isinstance(goodput, (int, float))
                      and math.isfinite(goodput) else "-"),
    ]
    if len(attempts) > 1:
        parts.insert(1, f"attempt {current.get('attempt')}")
    return " | ".join(parts)


class StatusTimer:
    """When the next status line is due (pure: the caller passes the time).

    ``interval`` 0 turns the line off: ``due`` is never true and ``next_due`` is None, so the
    supervisor's poll need not wake for it.
    """

    def __init__(self, interval: float, start: float) -> None:
        self.interval = interval
        self._next = start + interval if interval > 0 else None

    def next_due(self) -> float | None:
        """The time of the next line (for the supervisor's poll timeout), or None."""
        return self._next

    def due(self, now: float) -> bool:
        """True once per interval; a late call does not cause a burst of lines."""
        if self._next is None or now < self._next:
            return False
        while self._next <= now:
            self._next += self.interval
        return True
