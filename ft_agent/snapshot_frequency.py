"""The default snapshot frequency: pure rules shared by the ranks and the launcher.

Without ``--ft-snapshot-every``, each rank measures what a snapshot costs it (the whole
``snapshot()`` call that took one) and how long a step takes (``Meter``, fed by the rank's
``snapshot()`` calls), and reports that; the launcher turns every rank's measure into one
interval in steps (``wanted_every``: the fewest steps between snapshots that keep the time
``snapshot()`` blocks, plus the background commit's CPU time when the node has no idle
core for it (``node_busy``), under ``budget`` of the step time), changes it only when that
matters (``settle``), and announces it as a grid segment, "every N steps from iteration X",
with X far enough ahead of every rank (``start_of``) that every rank of the world switches
at the same iteration. ``Grid.due`` is the rank's test: the first call at or past each
point of the grid.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Between an announcement and the iteration it takes effect: this much time in steps, and
# at least MIN_LEAD_STEPS, so that every rank reads it before it gets there.
LEAD_S = 1.0
MIN_LEAD_STEPS = 2
# A smaller interval (more snapshots) only once the current one has held this long, and
# only when the measure says half or less: the measures of a busy machine wobble.
LOWER_AFTER_S = 30.0
MAX_EVERY = 1_000_000
WINDOW = 20  # measures kept for a median
MIN_STEPS = 3  # steps seen before a measure: the first ones include the start-up


@dataclass(frozen=True)
class Grid:
    """Segments ((from iteration, every N steps), ...) in ascending order: from each
    ``from``, the iterations ``from + j * N`` are the snapshot points."""

    segments: tuple[tuple[int, int], ...] = ()

    def position(self, iteration: int) -> tuple[int, int] | None:
        """(segment, point) of the last grid point at or before ``iteration``; None before
        the first segment."""
        pos = None
        for k, (start, every) in enumerate(self.segments):
            if iteration >= start:
                pos = (k, (iteration - start) // every)
        return pos

    def due(self, iteration: int, last: int | None) -> bool:
        """Whether a snapshot of ``iteration`` is due, ``last`` being the iteration of this
        rank's last snapshot in the cycle (None: none yet): the first call at or past each
        grid point."""
        here = self.position(iteration)
        if here is None:
            return False
        before = None if last is None else self.position(last)
        return before is None or here > before


def extend(segments: tuple[tuple[int, int], ...], start: int, every: int,
           keep: int = 3) -> tuple[tuple[int, int], ...]:
    """``segments`` with "every ``every`` from ``start``" added (those starting at or after
    ``start`` replaced); at most ``keep`` of them, the newest."""
    older = tuple(s for s in segments if s[0] < start)
    return (*older, (start, every))[-keep:]


@dataclass(frozen=True)
class Measure:
    """One rank's medians: the wall time of a ``snapshot()`` call that took a snapshot, the
    CPU time of its background commit (CRC32, NaN test, commit record; 0 for a small state
    committed inside the call), the wall time of a step, and the cores the rank's own work
    used (its process's CPU time less the background commits')."""

    blocking_s: float
    commit_s: float
    step_s: float
    cpu: float

    def cost_s(self, busy: bool) -> float:
        """What one snapshot costs the training: its blocking time, and its commit when the
        node has no idle core for it (the commit then competes with the training)."""
        return self.blocking_s + (self.commit_s if busy else 0.0)


def node_busy(cpus: Iterable[float], cores: int) -> bool:
    """Whether the ranks of a node (``cpus``: the cores each keeps busy on average) leave
    no core to a background commit: less than one idle on average, or no more cores than
    ranks. Ranks in step compute at the same moments, and a commit started at a step's end
    runs into the next step's compute: two ranks on 2 cores that compute half of each step
    gave it no idle core, and snapshots cost them as much as ranks that compute all of it."""
    cpus = list(cpus)
    return cores <= len(cpus) or cores - sum(cpus) < 1.0


def wanted_every(costs: Mapping[int, tuple[float, float]], budget: float) -> int:
    """The fewest steps between snapshots that keep every rank's cost under ``budget`` (a
    share of its step time); ``costs``: rank -> (cost of a snapshot, step), in seconds."""
    every = 1
    for cost_s, step_s in costs.values():
        if step_s > 0 and cost_s > 0:
            every = max(every, math.ceil(cost_s / (budget * step_s) - 1e-9))
    return min(every, MAX_EVERY)


def settle(current: int | None, wanted: int, now: float, since: float) -> int:
    """The interval to use: ``wanted`` when there is none yet or when the current one is
    over budget (``wanted`` is larger); a much smaller ``wanted`` once the current one has
    held ``LOWER_AFTER_S`` (``since``: when it began); else the current one."""
    if current is None or wanted > current:
        return wanted
    if wanted * 2 <= current and now - since >= LOWER_AFTER_S:
        return wanted
    return current


def start_of(at: int, step_s: float) -> int:
    """The iteration a change announced now takes effect at, ``at`` being the furthest
    iteration any rank has reported."""
    lead = MIN_LEAD_STEPS if step_s <= 0 else max(MIN_LEAD_STEPS, math.ceil(LEAD_S / step_s))
    return at + lead


class Meter:
    """A rank's measure, from its ``snapshot()`` calls (``call``), the time those that took
    a snapshot blocked (``blocked``) and the background commits (``commit``); the clocks are
    the caller's."""

    def __init__(self) -> None:
        self.steps: deque[float] = deque(maxlen=WINDOW)
        self.blocks: deque[float] = deque(maxlen=WINDOW)
        self.commits: deque[float] = deque(maxlen=WINDOW)
        self.last: tuple[int, float] | None = None  # (iteration, wall) of the last call
        self.window: tuple[float, float, float] | None = None  # (wall, cpu, commit cpu)
        self.commit_total = 0.0
        self.cpu = 0.0

    def call(self, iteration: int, now: float, cpu: float) -> None:
        """A ``snapshot()`` call for ``iteration`` at ``now`` (monotonic), the process having
        used ``cpu`` seconds of CPU so far."""
        if self.last is not None and iteration > self.last[0]:
            self.steps.append((now - self.last[1]) / (iteration - self.last[0]))
        if self.last is None or iteration > self.last[0]:
            self.last = (iteration, now)
        if self.window is None:
            self.window = (now, cpu, self.commit_total)
        elif now - self.window[0] >= 1.0:
            own = cpu - self.window[1] - (self.commit_total - self.window[2])
            self.cpu = max(0.0, own / (now - self.window[0]))
            self.window = (now, cpu, self.commit_total)

    def blocked(self, seconds: float) -> None:
        self.blocks.append(seconds)

    def commit(self, cpu_seconds: float) -> None:
        self.commit_total += cpu_seconds
        self.commits.append(cpu_seconds)

    def measure(self) -> Measure | None:
        """The medians, or None until a snapshot, its commit and ``MIN_STEPS`` steps have
        been seen."""
        if len(self.steps) < MIN_STEPS or not (self.blocks and self.commits):
            return None
        return Measure(statistics.median(self.blocks), statistics.median(self.commits),
                       statistics.median(self.steps), self.cpu)
