"""Who is to blame for a hang: the culprit among the node's silent ranks.

In a collective every rank goes silent at once, and whichever deadline expires first is not
necessarily the rank that stopped: the others are blocked waiting for it. Before a rank is
killed (and, on many nodes, its host excluded), every silent rank is looked at, in this
order of evidence:

1. a stopped process (state T: SIGSTOP, a debugger, a frozen cgroup);
2. a rank whose stack is not inside a collective (it is stuck in its own code);
3. the rank whose last activity is oldest.

A rank blocked in a collective is named only when nothing else explains the silence. Pure:
the caller gathers the evidence (process states, stack texts).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

# Frames that mean "waiting for other ranks" in a faulthandler or py-spy dump.
_COLLECTIVE = re.compile(
    r"torch/distributed/|torch/nn/parallel/distributed|all_reduce|allreduce|all_gather"
    r"|reduce_scatter|broadcast|barrier|all_to_all|nccl|gloo",
    re.IGNORECASE,
)


@dataclass
class Suspect:
    """Evidence about one silent rank."""

    rank: int
    silence_s: float
    stopped: bool = False
    in_collective: bool | None = None  # None: no stack to tell


@dataclass
class Blame:
    """The rank to act on, why, and the evidence (recorded in ``hang_detected``)."""

    rank: int
    why: str  # "stopped", "not_in_collective", "oldest_activity"
    suspects: list[dict[str, Any]]


def in_collective(stack_text: str | None) -> bool | None:
    """True when a stack dump shows the rank waiting in a collective; None without a dump."""
    if not stack_text or not stack_text.strip():
        return None
    return bool(_COLLECTIVE.search(stack_text))


def choose(suspects: list[Suspect]) -> Blame:
    """The culprit among ``suspects`` (at least one) by the order of evidence above."""
    if not suspects:
        raise ValueError("choose() needs at least one suspect")

    def oldest(group: list[Suspect]) -> Suspect:
        return max(group, key=lambda s: (s.silence_s, -s.rank))

    stopped = [s for s in suspects if s.stopped]
    outside = [s for s in suspects if s.in_collective is False]
    if stopped:
        culprit, why = oldest(stopped), "stopped"
    elif outside:
        culprit, why = oldest(outside), "not_in_collective"
    else:
        culprit, why = oldest(suspects), "oldest_activity"
    return Blame(culprit.rank, why, [asdict(s) for s in sorted(suspects, key=lambda s: s.rank)])
