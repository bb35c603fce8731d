"""The world's iteration across nodes: what each launcher holds, published through the
round's rendezvous store, and the one choice every launcher computes from the same data.

Two phases per round, each a key per node under a name that carries the round number (and
the store itself is the round's own, prefixed by torch), so an old round's keys are never
read:

1. ``holds``: each launcher publishes, per global rank, the iterations it can hand out (its
   own ranks' copies, the replicas its server hosts) and its replica server's endpoint.
   Every launcher reads all of them and ``agree`` picks the newest iteration that every
   rank of the new world has somewhere.
2. ``verdict``: each launcher fetches what its new ranks lack, checks every copy of the
   chosen iteration in full, and publishes ``ok`` or why not. The world restores only when
   every verdict is ``ok``; otherwise no rank restores (each rank then falls back to its
   disk checkpoint), so the ranks never resume from different iterations.

A peer that does not publish within the bounded wait makes the choice "none" for the round.
Everything read from the store is untrusted: ``decode`` checks it field by field and
returns None rather than raising.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ft_launcher.snapshots.pick import pick_iteration, why_none

log = logging.getLogger("ft_launcher")

EXCHANGE_TIMEOUT_S = 30.0
MAX_TEXT = 1 << 20  # a publication longer than this is refused unread
MAX_ITERATIONS = 16  # per rank: a store keeps two slots, a replica root two more
OK = "ok"


@dataclass(frozen=True)
class Holdings:
    """What one node can hand out: per global rank, the iterations it holds a copy of,
    and the endpoint of its replica server (None: it serves none)."""

    node: int
    endpoint: str | None
    ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Agreement:
    """The iteration the world resumes from (None: none), why, and the per-rank union."""

    iteration: int | None
    reason: str
    union: dict[int, list[int]]


def key(round_no: int, phase: str, node: int) -> str:
    """The store key of ``node``'s publication of ``phase`` in round ``round_no``."""
    return f"ft/snapshots/round{round_no}/{phase}/{node}"


def encode(h: Holdings) -> str:
    return json.dumps({"node": h.node, "endpoint": h.endpoint,
                       "ranks": {str(r): sorted(its) for r, its in h.ranks.items()}},
                      separators=(",", ":"))


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def decode(raw: bytes | str) -> Holdings | None:
    """A publication read from the store, or None when anything in it is malformed."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        if len(text) > MAX_TEXT:
            return None
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or _int(obj.get("node")) is None:
        return None
    endpoint, ranks = obj.get("endpoint"), obj.get("ranks")
    if endpoint is not None and not (isinstance(endpoint, str) and
                                     endpoint.startswith("tcp://") and len(endpoint) < 300):
        return None
    if not isinstance(ranks, dict):
        return None
    out: dict[int, tuple[int, ...]] = {}
    for name, its in ranks.items():
        rank = int(name) if isinstance(name, str) and name.isdigit() and len(name) < 10 \
            else None
        if rank is None or not isinstance(its, list) or len(its) > MAX_ITERATIONS \
                or any(_int(i) is None for i in its):
            return None
        out[rank] = tuple(its)
    return Holdings(obj["node"], endpoint, out)


def agree(world_ranks: Sequence[int], published: Mapping[int, Holdings]) -> Agreement:
    """Pure: the newest iteration every rank of ``world_ranks`` has on some node."""
    union: dict[int, set[int]] = {r: set() for r in world_ranks}
    for h in published.values():
        for rank, its in h.ranks.items():
            if rank in union:
                union[rank].update(its)
    iteration = pick_iteration(union)
    reason = "newest iteration every rank holds on some node" if iteration is not None \
        else why_none(union)
    return Agreement(iteration, reason, {r: sorted(its) for r, its in union.items()})


def holders(rank: int, iteration: int, published: Mapping[int, Holdings],
            me: int) -> list[str]:
    """Endpoints of the nodes that hold ``rank``'s ``iteration``; others first, in node
    order, then this node's own server (a replica it hosts for a rank now its own)."""
    found = sorted((node == me, node, h.endpoint) for node, h in published.items()
                   if h.endpoint is not None and iteration in h.ranks.get(rank, ()))
    return [ep for _, _, ep in found if ep is not None]


def verdicts_reason(verdicts: Mapping[int, str]) -> str | None:
    """None when every node said ``ok``; else which nodes did not, and why."""
    bad = [f"node {n}: {v}" for n, v in sorted(verdicts.items()) if v != OK]
    return "; ".join(bad)[:2000] if bad else None


class StoreExchange:
    """One round's publications in the rendezvous store: ``publish`` this node's text,
    ``gather`` every node's within a bounded wait."""

    def __init__(self, store: Any, round_no: int, node: int, nodes: int,
                 timeout_s: float = EXCHANGE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.round_no, self.node, self.nodes = store, round_no, node, nodes
        self.timeout_s, self.clock = timeout_s, clock

    def publish(self, phase: str, text: str) -> None:
        """Publish this node's text; a store that fails here fails the gather after it
        (the others then miss this node), never the launcher."""
        try:
            self.store.set(key(self.round_no, phase, self.node), text)
        except Exception as e:  # noqa: BLE001 - each store kind raises its own
            log.warning("snapshots: cannot publish %s for round %d: %s", phase,
                        self.round_no, e)

    def gather(self, phase: str) -> tuple[dict[int, bytes], list[int]]:
        """Every node's publication of ``phase``, and the nodes that published none in
        time (the store's wait raises on its timeout; each key is then checked alone)."""
        keys = {n: key(self.round_no, phase, n) for n in range(self.nodes)}
        try:
            self.store.wait(list(keys.values()), timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - each store kind raises its own on a timeout
            pass
        got: dict[int, bytes] = {}
        missing: list[int] = []
        for node, k in keys.items():
            try:
                got[node] = self.store.get(k) if self.store.check([k]) else b""
            except Exception:  # noqa: BLE001 - an unreachable store: the peer is missing
                got[node] = b""
            if not got[node]:
                missing.append(node)
                del got[node]
        return got, missing
