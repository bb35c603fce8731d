"""A rank's snapshot reports: ``send_report("snapshot", <JSON>)`` from ``ft_agent``.

The message is untrusted: ``decode`` checks every field and returns the event to record
(name and fields) or None; it raises nothing. Fields not listed here are dropped.

=============  ========================================================================
``skipped``    ``iteration``, ``reason`` (budget, busy, io, unsupported), ``bytes``,
               ``count`` (skips of that reason since the last report)
``restored``   ``iteration``, ``source`` (local, replica), ``bytes``, ``seconds``
``rejected``   ``iteration``, ``slot``, ``reason``: a copy failed its checks when loaded
=============  ========================================================================
"""

from __future__ import annotations

import json
import math
from typing import Any

WHAT = "snapshot"
SKIP_REASONS = ("budget", "busy", "io", "unsupported")
SOURCES = ("local", "replica")
MAX_INT = 2**63 - 1
MAX_REASON_CHARS = 500


def _int(value: Any, lo: int = 0) -> int | None:
    return value if type(value) is int and lo <= value <= MAX_INT else None


def _seconds(value: Any) -> float | None:
    ok = type(value) in (int, float) and math.isfinite(value) and 0 <= value < 1e9
    return round(float(value), 6) if ok else None


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
                  "slot": obj.get("slot") if obj.get("slot") in ("a", "b") else None,
                  "reason": _text(obj.get("reason"))}
        name = "snapshot_rejected"
    else:
        return None
    if any(v is None for v in fields.values()):
        return None
    return name, fields
