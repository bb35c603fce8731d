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
