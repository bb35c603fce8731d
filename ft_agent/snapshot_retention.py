"""Which snapshot copies a holder keeps, and how the launcher moves the plan every holder
follows: pure functions shared by a rank's store (``ft_agent.snapshot``), the launcher's
replica server and the launcher's coordinator. No I/O, no torch.

A *holder* keeps copies of one rank's snapshots in three slots: the rank's own directory,
or a replica of it on another node. Every holder of a world follows the same *plan*, which
the launcher moves on from what the holders report they hold:

- ``pin``: an iteration every holder holds, never overwritten;
- ``floor``: every copy of an iteration at or above it is kept (no floor and no pin yet:
  every copy is kept).

A write goes to a slot that keeps nothing: an empty one, else the oldest copy not kept;
when every slot keeps something, the snapshot is skipped ("held") until the plan moves on.
``advance`` moves it: the newest iteration at or above the floor that every holder holds
becomes the pin, the floor just above it; when there is none, the floor rises past every
iteration that some holder can no longer hold (its newest copy is past it and it has no copy
of it: a holder's copies only get newer within a cycle).

The guarantee, checked over random interleavings in tests/test_snapshot_retention.py: at
every moment each holder still holds the newest iteration that every holder has committed,
whatever the delays of the reports and of the plans, and whichever writes a kill cuts
short. A restore after a fault is therefore from that iteration (k = 1), never older.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

SLOTS = ("a", "b", "c")
MAX_ITERATION = 2**62
MAX_PLAN_BYTES = 4096
MAX_SEGMENTS = 4
PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """What every holder of a world follows; ``seq`` grows with each change. ``grid`` is
    the default frequency's schedule, ((from iteration, every N steps), ...) ascending
    (see ``ft_agent.snapshot_frequency``); empty until the ranks have agreed on one.
    ``why``: the launcher's reasons for the grid's last segment (for its event only)."""

    seq: int = 0
    pin: int | None = None
    floor: int | None = None
    grid: tuple[tuple[int, int], ...] = ()
    why: dict[str, Any] = field(default_factory=dict, compare=False)


def kept(held: Collection[int], plan: Plan | None) -> set[int]:
    """The iterations among ``held`` that a holder following ``plan`` must not overwrite;
    ``plan`` None: a holder outside any world (no launcher) keeps only its newest copy."""
    held = set(held)
    if not held:
        return set()
    if plan is None:
        return {max(held)}
    if plan.pin is None and plan.floor is None:
        return held
    keep = {plan.pin} & held
    if plan.floor is not None:
        keep.update(i for i in held if i >= plan.floor)
    return keep


def write_slot(slots: Mapping[str, int | None], plan: Plan | None, *,
               claimed: Collection[str] | None = None, force: bool = False) -> str | None:
    """The slot a new copy goes to (``slots``: slot -> iteration held, None when empty), or
    None when every slot keeps something. ``claimed``: slots whose memory is already
    claimed, preferred (a fresh slot's pages cost many times a copy). ``force``: a write
    that must happen (before an exit) overwrites the oldest copy but the pin and the
    newest instead of giving up."""
    keep = kept([i for i in slots.values() if i is not None], plan)
    free = [s for s, i in slots.items() if i is None or i not in keep]
    if not free and force:
        held = [i for i in slots.values() if i is not None]
        spare = {plan.pin if plan else None, max(held, default=None)}
        free = [s for s, i in slots.items() if i not in spare] or list(slots)
    if not free:
        return None

    def order(s: str) -> tuple[bool, bool, int, str]:
        held = slots[s]
        return (claimed is not None and s not in claimed, held is not None,
                held if held is not None else 0, s)
    return min(free, key=order)


def advance(plan: Plan, holdings: Mapping[Hashable, Collection[int] | None]) -> Plan:
    """The plan after the holders' latest reports (``holdings``: every holder of the world
    and what it holds; None while it has not reported). Reports may be stale: a holder
    never drops an iteration the plan it follows keeps, so what it held stays held."""
    if not holdings or any(h is None for h in holdings.values()):
        return plan
    sets = [set(h) for h in holdings.values()]  # type: ignore[arg-type]
    common = set.intersection(*sets)
    if plan.floor is not None:
        common = {i for i in common if i >= plan.floor}
    if common:  # every iteration at or above the floor is newer than the pin
        pin = max(common)
        return Plan(plan.seq + 1, pin, pin + 1, plan.grid, plan.why)
    if not all(sets):
        return plan  # a holder with nothing yet may still commit any iteration
    floor = min(max(s) for s in sets) + 1
    if plan.floor is not None and floor <= plan.floor:
        return plan
    return Plan(plan.seq + 1, plan.pin, floor, plan.grid, plan.why)


# -- the plan on the wire (a file the launcher rewrites; untrusted on reading) -----------


def encode_plan(plan: Plan) -> bytes:
    return json.dumps({"v": PLAN_VERSION, "seq": plan.seq, "pin": plan.pin,
                       "floor": plan.floor, "grid": [list(g) for g in plan.grid],
                       "why": plan.why}, separators=(",", ":"), allow_nan=False).encode()


def _iteration(value: Any) -> bool:
    return type(value) is int and -MAX_ITERATION <= value <= MAX_ITERATION


def decode_plan(data: bytes) -> Plan | None:
    """A plan read back, or None when anything in it is malformed (never raises)."""
    if len(data) > MAX_PLAN_BYTES:
        return None
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=lambda name: None)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if type(obj) is not dict or obj.get("v") != PLAN_VERSION:
        return None
    seq, pin, floor, grid = obj.get("seq"), obj.get("pin"), obj.get("floor"), obj.get("grid")
    if type(seq) is not int or not 0 <= seq <= MAX_ITERATION:
        return None
    if (pin is not None and not _iteration(pin)) or (floor is not None and
                                                     not _iteration(floor)):
        return None
    if type(grid) is not list or len(grid) > MAX_SEGMENTS:
        return None
    segments: list[tuple[int, int]] = []
    for g in grid:
        if not (type(g) is list and len(g) == 2 and _iteration(g[0]) and type(g[1]) is int
                and 1 <= g[1] <= MAX_ITERATION):
            return None
        if segments and g[0] <= segments[-1][0]:
            return None
        segments.append((g[0], g[1]))
    why = obj.get("why")
    return Plan(seq, pin, floor, tuple(segments), why if type(why) is dict else {})
