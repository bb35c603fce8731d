"""Which iteration the new world resumes from: pure functions of the copies each rank has.

A rank's copy of an iteration is usable when its slot passed the cheap checks (commit
record, size, header checksum); before an iteration is chosen, every rank's copy of it is
checked in full (each tensor's CRC32) through the injected ``verify``. A copy that fails is
rejected and the choice is made again without it, so the world never resumes from an
iteration one of its ranks cannot load.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Copy:
    """One committed slot of one rank (``ft_agent.snapshot.SlotInfo``'s fields)."""

    slot: str
    iteration: int
    seq: int
    bytes: int


@dataclass
class Choice:
    """The iteration every rank restores (None: none can), why, and the copies rejected
    on the way as (rank, copy, reason)."""

    iteration: int | None
    reason: str
    rejected: list[tuple[int, Copy, str]] = field(default_factory=list)
    verified: list[tuple[int, Copy]] = field(default_factory=list)


def pick_iteration(per_rank_iterations: Mapping[int, Collection[int]]) -> int | None:
    """The newest iteration that every rank has; None when there are no ranks or no
    iteration common to all of them."""
    common: set[int] | None = None
    for iterations in per_rank_iterations.values():
        common = set(iterations) if common is None else common & set(iterations)
        if not common:
            return None
    return max(common) if common else None


def why_none(per_rank_iterations: Mapping[int, Collection[int]]) -> str:
    """Why ``pick_iteration`` found nothing, in words for the event."""
    if not per_rank_iterations:
        return "no ranks"
    empty = sorted(r for r, its in per_rank_iterations.items() if not its)
    if len(empty) == len(per_rank_iterations):
        return "no rank has a snapshot"
    if empty:
        return f"rank(s) {', '.join(map(str, empty))} have no snapshot"
    return "no iteration is held by every rank"


def choose(copies: Mapping[int, Sequence[Copy]],
           verify: Callable[[list[tuple[int, Copy]]], dict[tuple[int, str], str | None]]
           ) -> Choice:
    """Pick the newest common iteration whose every rank's copy passes ``verify``.

    ``verify`` gets (rank, copy) pairs and returns, per (rank, slot), None (whole) or the
    reason it is not; it is called once per candidate iteration, never twice for a copy.
    """
    bad: dict[tuple[int, str], str] = {}
    choice = Choice(None, "")
    while True:
        usable = {r: [c for c in cs if (r, c.slot) not in bad] for r, cs in copies.items()}
        iteration = pick_iteration({r: {c.iteration for c in cs} for r, cs in usable.items()})
        if iteration is None:
            choice.reason = why_none({r: [c.iteration for c in cs] for r, cs in usable.items()})
            return choice
        # A rank may hold the iteration twice (a roll-back rewrote it): newest write first.
        wanted = [(r, max((c for c in cs if c.iteration == iteration), key=lambda c: c.seq))
                  for r, cs in usable.items()]
        results = verify(wanted)
        failed = [(r, c) for r, c in wanted if results.get((r, c.slot)) is not None]
        for r, c in failed:
            bad[(r, c.slot)] = results[(r, c.slot)] or ""
            choice.rejected.append((r, c, bad[(r, c.slot)]))
        if not failed:
            choice.iteration, choice.verified = iteration, wanted
            choice.reason = "newest iteration every rank holds"
            return choice


def to_discard(copies: Mapping[int, Sequence[Copy]], choice: Choice) -> list[tuple[int, Copy]]:
    """The copies no rank may load any more: newer than the chosen iteration (a future the
    world rolled back from), all of them when none was chosen, and the rejected ones."""
    rejected = {(r, c.slot) for r, c, _ in choice.rejected}
    keep = {(r, c.slot) for r, c in choice.verified}
    out = []
    for rank, cs in copies.items():
        for c in cs:
            if (rank, c.slot) in keep:
                continue
            if (rank, c.slot) in rejected or choice.iteration is None \
                    or c.iteration >= choice.iteration:
                out.append((rank, c))
    return out
