"""What the launcher's console says about an event: pure, apart from the log it feeds.

``events.jsonl`` keeps every record. The console is for a person: an event that each rank
reports on its own (its first step, each checkpoint it saves) is shown once, for the first
rank that reports it, and the rest go to the debug log; epoch seconds are shown as clock
times.
"""

from __future__ import annotations

import time
from typing import Any

# Reported once by every rank; the console shows the first report of each (per cycle, and
# per iteration where the event carries one).
PER_RANK = frozenset({
    "rank_connected", "training_started", "first_step", "checkpoint_saved", "last_progress",
    "interval_stats", "rank_goodbye", "standby_ready",
})
HIDDEN_FIELDS = frozenset({"timeouts"})  # long; in events.jsonl and `ft_report`


def clock_time(epoch_s: float) -> str:
    """``13:05:42.118``: local wall-clock time to the millisecond."""
    whole = int(epoch_s)
    millis = int((epoch_s - whole) * 1000)
    return time.strftime("%H:%M:%S", time.localtime(whole)) + f".{millis:03d}"


def _shown(key: str, value: Any) -> str:
    if (key == "at" or key.endswith("_at")) and isinstance(value, int | float) \
            and not isinstance(value, bool) and value > 1e9:
        return clock_time(float(value))
    return str(value)


class Console:
    """Decides, event by event, which ones a person sees and how each line reads."""

    def __init__(self) -> None:
        self._cycle = 0
        self._seen: set[tuple[str, Any]] = set()  # this cycle's (event, iteration) shown

    def line(self, cycle: int, name: str, fields: dict[str, Any]) -> tuple[bool, str]:
        """(shown on the console, the line); a line not shown goes to the debug log."""
        detail = " ".join(f"{k}={_shown(k, v)}" for k, v in fields.items()
                          if k not in HIDDEN_FIELDS)
        text = f"cycle {cycle}: {name} {detail}".rstrip()
        if name not in PER_RANK:
            return True, text
        if cycle != self._cycle:
            self._cycle, self._seen = cycle, set()
        key = (name, fields.get("iteration"))
        if key in self._seen:
            return False, text
        self._seen.add(key)
        if "rank" in fields:
            text += " (the other ranks' reports: events.jsonl)"
        return True, text
