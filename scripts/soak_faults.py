"""The snapshot soak's fault plan: which faults exist, when the next one comes, which one it
is, and whether the job is in a state to take it. Pure logic (no processes, no clock of its
own), so that ``tests/test_soak_faults.py`` checks it in milliseconds; the I/O is in
``snapshot_soak.py`` and ``soak_nodes.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

RANK_FAULTS = ("kill", "stop")  # SIGKILL, SIGSTOP of one training rank
NODE_FAULTS = ("freeze", "node_kill")  # SIGSTOP of a node's processes, SIGKILL of a launcher
ALL_FAULTS = RANK_FAULTS + NODE_FAULTS

# The last of these events in a launcher's events.jsonl says what it is doing now.
_ROLE_OF_EVENT = {
    "rendezvous_done": "world", "spare_admitted": "world", "spare_waiting": "spare",
    "node_dropped": "rejoining", "launcher_exited": "gone",
}


def parse_faults(text: str, nodes: int) -> list[str]:
    """The fault kinds of ``--faults`` (comma-separated); node faults need ``nodes`` >= 2.
    Raises ValueError naming what is wrong."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds:
        raise ValueError("--faults names no fault")
    unknown = [k for k in kinds if k not in ALL_FAULTS]
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}: one of {', '.join(ALL_FAULTS)}")
    if nodes < 2 and any(k in NODE_FAULTS for k in kinds):
        raise ValueError(f"{', '.join(NODE_FAULTS)} need --nodes 2")
    return kinds


def default_faults(nodes: int) -> str:
    """Every fault that applies: rank faults on one launcher, node faults too with two."""
    return ",".join(ALL_FAULTS if nodes >= 2 else RANK_FAULTS)


def next_gap(rng: random.Random, every: float) -> float:
    """Seconds to the next fault: ``every`` on average, uniform within ±50 %."""
    return every * rng.uniform(0.5, 1.5)


def node_role(event_names: Iterable[str]) -> str:
    """What a launcher is doing, from its event names in order: ``world`` (in the training
    world), ``spare`` (waiting to be admitted), ``rejoining`` (dropped from its round, not
    waiting yet), ``gone`` (exited), or ``starting`` (none of these yet)."""
    role = "starting"
    for name in event_names:
        role = _ROLE_OF_EVENT.get(name, role)
    return role


@dataclass(frozen=True)
class JobState:
    """What the soak sees of the job at one moment."""

    ranks_running: int  # training processes of the launchers in the world
    world_size: int  # how many there are when the job is whole
    world_nodes: int  # launchers in the world
    spares: int  # launchers waiting as spares
    recovering: bool = False  # a fault's aftermath is still being handled (a frozen node)


def can_inject(kind: str, state: JobState, nodes: int) -> bool:
    """Whether ``kind`` may be injected now: the job whole and training (a fault between
    cycles would hit nothing, or two faults would overlap), and for a node fault a spare
    waiting to take the lost node's place (with ``--nnodes N:N`` the world waits forever for
    a node that does not come back)."""
    whole = (not state.recovering and state.ranks_running == state.world_size
             and state.world_nodes == nodes)
    if kind in RANK_FAULTS:
        return whole
    return whole and state.spares >= 1


def choose(rng: random.Random, kinds: list[str]) -> str:
    """The next fault's kind, uniform over ``kinds``; drawn when it is due, and kept until
    the job can take it, so that a kind that often has to wait is not drawn less often."""
    return rng.choice(kinds)


def recovery_times(faults: list[float], first_steps: list[tuple[float, int]],
                   world_size: int) -> list[float | None]:
    """For each fault's time, the seconds until every rank (0..world_size-1) had made the
    first step of a cycle started after it: ``first_steps`` are (time, rank) of the
    ``first_step`` events of every launcher. None while some rank has not (yet)."""
    out: list[float | None] = []
    for t in faults:
        firsts: dict[int, float] = {}
        for at, rank in sorted(first_steps):
            if at > t and 0 <= rank < world_size:
                firsts.setdefault(rank, at)
        out.append(max(firsts.values()) - t if len(firsts) == world_size else None)
    return out
