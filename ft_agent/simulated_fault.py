"""Simulated faults, the parts the launcher and the agent share: the seeded draw of which
rank fails, how and when, and the ``FT_SIMULATED_FAULT`` value that arms a ``rank_exit``.

A seeded draw over values every process already has (a seed such as the run id, and the
restart cycle) gives every node and every rank the same answer with no message and no
collective: it works before the process group exists and cannot deadlock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SIGNAL_FAULTS = ("rank_killed", "rank_hung")  # what "random" draws from
EXIT_FAULT = "rank_exit"


@dataclass(frozen=True)
class Draw:
    """One cycle's fault: the resolved type (never "random"), the victim, the delay."""

    fault_type: str
    rank: int
    delay: float


def draw(seed: str, cycle: int, world_size: int, fault_type: str, base_delay: float,
         rand_delay: float, rank: int | None = None) -> Draw:
    """The fault of ``cycle``: the same for every caller with the same arguments."""
    rng = random.Random(f"{seed}:{cycle}")
    drawn = rng.randrange(world_size)  # always drawn, so a fixed rank leaves the rest alike
    if fault_type == "random":
        fault_type = rng.choice(SIGNAL_FAULTS)
    delay = base_delay + rng.uniform(0.0, rand_delay)
    return Draw(fault_type, drawn if rank is None else rank, delay)


def exit_fault_value(code: int, delay: float) -> str:
    """``FT_SIMULATED_FAULT`` for a rank that must exit with ``code``, ``delay`` seconds after
    it starts training (connects to the launcher's monitor)."""
    return f"{EXIT_FAULT}:code={code},delay={delay:.6f}"


def parse_exit_fault(value: str) -> tuple[int, float] | None:
    """(code, delay) from ``FT_SIMULATED_FAULT``; None when it arms no valid ``rank_exit``."""
    kind, _, rest = value.partition(":")
    if kind != EXIT_FAULT:
        return None
    fields = dict(p.split("=", 1) for p in rest.split(",") if "=" in p)
    try:
        code, delay = int(fields["code"]), float(fields["delay"])
    except (KeyError, ValueError):
        return None
    if not 1 <= code <= 255 or not math.isfinite(delay) or delay < 0:
        return None
    return code, delay
