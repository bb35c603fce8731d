"""Diagnosis listeners: observers told about every rejected result and every verdict.

The in-process agent (ft_agent) registers one to forward verdicts to the launcher. A listener
that raises is logged and ignored: observing must never change the outcome of training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("rerun")

DiagnosisListener = Callable[[dict[str, Any]], None]

_listeners: list[DiagnosisListener] = []


def add_diagnosis_listener(fn: DiagnosisListener) -> None:
    """Register ``fn(event)``; called for each rejected result and verdict. Idempotent."""
    if not callable(fn):
        raise TypeError(f"diagnosis listener must be callable, got {type(fn).__name__}")
    if fn not in _listeners:
        _listeners.append(fn)


def remove_diagnosis_listener(fn: DiagnosisListener) -> None:
    """Unregister ``fn``; does nothing when it is not registered."""
    if fn in _listeners:
        _listeners.remove(fn)


def emit(event: dict[str, Any]) -> None:
    """Hand ``event`` to every listener, each on its own copy, logging what they raise."""
    for fn in list(_listeners):
        try:
            fn(dict(event))
        except Exception:  # a broken observer must not break training
            logger.exception("diagnosis listener %r raised; ignored", fn)
