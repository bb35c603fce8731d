"""Which nodes hold the replicas of each node's ranks' snapshots (pure).

The nodes of a world, in a stable order every launcher agrees on (e.g. the rendezvous'
group ranks), form a ring; node ``i``'s replicas go to the ``k`` nodes after it. No node is
its own buddy, so losing any single node leaves each of its ranks' snapshots on another
node whenever the world has two nodes or more; losing any ``k`` nodes (or fewer) still
leaves one copy of every rank's data (on its own node or on one of its ``k`` buddies).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

Node = TypeVar("Node", bound=Hashable)


def buddies(nodes: Sequence[Node], k: int = 1) -> dict[Node, tuple[Node, ...]]:
    """For each node, the ``min(k, len(nodes) - 1)`` distinct other nodes that hold its
    ranks' replicas, nearest first along the ring; with one node, none. Raises
    ``ValueError`` for a negative ``k`` or a node listed twice."""
    if k < 0:
        raise ValueError(f"k must be >= 0, not {k}")
    if len(set(nodes)) != len(nodes):
        raise ValueError("a node is listed twice")
    n = len(nodes)
    width = min(k, n - 1) if n else 0
    return {node: tuple(nodes[(i + j) % n] for j in range(1, width + 1))
            for i, node in enumerate(nodes)}


def held_by(nodes: Sequence[Node], k: int = 1) -> dict[Node, tuple[Node, ...]]:
    """The inverse of ``buddies``: for each node, the nodes whose replicas it holds."""
    out: dict[Node, list[Node]] = {node: [] for node in nodes}
    for source, targets in buddies(nodes, k).items():
        for target in targets:
            out[target].append(source)
    return {node: tuple(sources) for node, sources in out.items()}


def surviving_copies(nodes: Sequence[Node], k: int, lost: set[Node]
                     ) -> dict[Node, tuple[Node, ...]]:
    """For each node's ranks, the surviving nodes that still hold a copy of their data (the
    node itself, if it is not lost, then its buddies that are not); empty when every copy
    is gone."""
    return {node: tuple(h for h in (node, *targets) if h not in lost)
            for node, targets in buddies(nodes, k).items()}
