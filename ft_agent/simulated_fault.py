"""Simulated faults, the parts the launcher and the agent share: the seeded draw of which
rank fails, how and when, and the ``FT_SIMULATED_FAULT`` values that arm a ``rank_exit`` or a
``rank_slow`` (whose stretch of timed sections is here too).

A seeded draw over values every process already has (a seed such as the run id, and the
restart cycle) gives every node and every rank the same answer with no message and no
collective: it works before the process group exists and cannot deadlock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

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


def _fields_of(value: str, kind: str) -> dict[str, str] | None:
    """The ``key=value`` fields of an ``FT_SIMULATED_FAULT`` of ``kind``; None: another kind."""
    found, _, rest = value.partition(":")
    if found != kind:
        return None
    return dict(p.split("=", 1) for p in rest.split(",") if "=" in p)


def parse_exit_fault(value: str) -> tuple[int, float] | None:
    """(code, delay) from ``FT_SIMULATED_FAULT``; None when it arms no valid ``rank_exit``."""
    fields = _fields_of(value, EXIT_FAULT)
    if fields is None:
        return None
    try:
        code, delay = int(fields["code"]), float(fields["delay"])
    except (KeyError, ValueError):
        return None
    if not 1 <= code <= 255 or not math.isfinite(delay) or delay < 0:
        return None
    return code, delay


SLOW_FAULT = "rank_slow"
MAX_OPEN_SECTIONS = 64  # per rank, as the monitor allows


def slow_fault_value(factor: float, delay: float, duration: float | None) -> str:
    """``FT_SIMULATED_FAULT`` for a rank whose sections must take ``factor`` times as long,
    from ``delay`` seconds after it starts training, for ``duration`` seconds (None: on)."""
    value = f"{SLOW_FAULT}:factor={factor!r},delay={delay:.6f}"
    return value if duration is None else f"{value},duration={duration!r}"


def parse_slow_fault(value: str) -> tuple[float, float, float | None] | None:
    """(factor, delay, duration) from ``FT_SIMULATED_FAULT``; None when it arms no valid
    ``rank_slow``."""
    fields = _fields_of(value, SLOW_FAULT)
    if fields is None:
        return None
    try:
        factor, delay = float(fields["factor"]), float(fields["delay"])
        duration = float(fields["duration"]) if "duration" in fields else None
    except (KeyError, ValueError):
        return None
    if not (math.isfinite(factor) and factor > 1 and math.isfinite(delay) and delay >= 0):
        return None
    if duration is not None and not (math.isfinite(duration) and duration > 0):
        return None
    return factor, delay, duration


@dataclass
class SlowSections:
    """A ``rank_slow`` carried out by the rank: every timed section that closes from
    ``delay`` seconds after the rank's first section on (for ``duration`` seconds, None:
    for good) is made to last ``factor`` times its work.

    The first section is when this rank starts training, as the launcher counts (every
    rank's first activity; in a synchronous job they start together). Pure: the caller
    sleeps the returned extra time inside the section, then closes it. A section's work is
    its wall time less what was added inside it already (a nested section's stretch), so
    nested sections are not slowed twice.
    """

    factor: float
    delay: float = 0.0
    duration: float | None = None
    start: float | None = None  # monotonic, fixed by the first section
    added_s: float = 0.0  # stretch added so far, all sections together
    reported: bool = False  # the first stretch was put on the launcher's record
    _open: dict[str, tuple[float, float]] = field(default_factory=dict)

    def opened(self, name: str, t: float) -> None:
        if self.start is None:
            self.start = t + self.delay
        if name in self._open or len(self._open) < MAX_OPEN_SECTIONS:
            self._open[name] = (t, self.added_s)

    def active(self, t: float) -> bool:
        return self.start is not None and self.start <= t and (
            self.duration is None or t < self.start + self.duration)

    def extra_s(self, name: str, t: float) -> float:
        """Seconds to add before closing ``name`` at ``t`` (0 outside the fault's time)."""
        opened = self._open.pop(name, None)
        if opened is None or not self.active(t):
            return 0.0
        t0, added_before = opened
        inside = self.added_s - added_before
        extra = max(0.0, (self.factor - 1) * (t - t0) - self.factor * inside)
        self.added_s += extra
        return extra
