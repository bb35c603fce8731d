"""A rank's snapshot reports: ``send_report("snapshot", <JSON>)`` from ``ft_agent``.

The message is untrusted: ``decode`` checks every field and returns the event to record
(name and fields), a ``held`` or ``measure`` report for the coordinator (``HELD``,
``MEASURE``: not events), or None; it raises nothing. Fields not listed here are dropped.

=============  ========================================================================
``skipped``    ``iteration``, ``reason`` (budget, busy, claim, held, io, unsupported),
               ``bytes``, ``count`` (skips of that reason since the last report)
``restored``   ``iteration``, ``source`` (local, replica), ``bytes``, ``seconds``
``rejected``   ``iteration``, ``slot``, ``reason``: a copy failed its checks when loaded
``held``       ``held`` (the iterations the rank's slots hold, at most one per slot),
               ``at`` (the furthest iteration it called ``snapshot()`` with)
``measure``    ``iteration`` (as ``at``), ``blocking_s``, ``commit_s``, ``step_s``
               (seconds, finite, under a day), ``cpu`` (cores, under 4096)
=============  ========================================================================
"""

from __future__ import annotations

import json
import math
from typing import Any

from ft_agent.snapshot_retention import SLOTS

WHAT = "snapshot"
HELD = "held"
MEASURE = "measure"
SKIP_REASONS = ("budget", "busy", "claim", "held", "io", "unsupported")
SOURCES = ("local", "replica")
MAX_INT = 2**63 - 1
MAX_REASON_CHARS = 500
MAX_MEASURE_S = 86_400.0
MAX_CPU = 4096.0


def _int(value: Any, lo: int = 0) -> int | None:
    return value if type(value) is int and lo <= value <= MAX_INT else None


def _seconds(value: Any, high: float = 1e9) -> float | None:
    ok = type(value) in (int, float) and math.isfinite(value) and 0 <= value < high
    return round(float(value), 6) if ok else None


def _iterations(value: Any) -> list[int] | None:
    if type(value) is not list or len(value) > len(SLOTS):
        return None
    out = [_int(v, -MAX_INT) for v in value]
    return None if any(v is None for v in out) else sorted(set(out))  # type: ignore[arg-type]


def _text(value: Any) -> str | None:
    return value[:MAX_REASON_CHARS] if isinstance(value, str) and value.isprintable() else None


def decode(message: str) -> tuple[str, dict[str, Any]] | None:
    """(event name, fields) for a valid report, else None."""
    try:
        obj = json.loads(message)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    kind = obj.get("kind")
    if kind == "skipped":
        fields = {"iteration": _int(obj.get("iteration"), -MAX_INT),
                  "reason": obj.get("reason") if obj.get("reason") in SKIP_REASONS else None,
                  "bytes": _int(obj.get("bytes")), "count": _int(obj.get("count"), 1)}
        name = "snapshot_skipped"
    elif kind == "restored":
        fields = {"iteration": _int(obj.get("iteration"), -MAX_INT),
                  "source": obj.get("source") if obj.get("source") in SOURCES else None,
                  "bytes": _int(obj.get("bytes")), "seconds": _seconds(obj.get("seconds"))}
        name = "snapshot_restored"
    elif kind == "rejected":
        fields = {"iteration": _int(obj.get("iteration"), -MAX_INT),
                  "slot": obj.get("slot") if obj.get("slot") in SLOTS else None,
                  "reason": _text(obj.get("reason"))}
        name = "snapshot_rejected"
    elif kind == HELD:
        fields = {"held": _iterations(obj.get("held")), "at": _int(obj.get("at"), -MAX_INT)}
        name = HELD
    elif kind == MEASURE:
        fields = {"iteration": _int(obj.get("iteration"), -MAX_INT),
                  **{k: _seconds(obj.get(k), MAX_MEASURE_S)
                     for k in ("blocking_s", "commit_s", "step_s")},
                  "cpu": _seconds(obj.get("cpu"), MAX_CPU)}
        name = MEASURE
    else:
        return None
    if any(v is None for v in fields.values()):
        return None
    return name, fields
