"""The rules of the rendezvous, pure: who is alive, when a round closes and in what order
its nodes get their group ranks, what the coordinator does next, and whether a node is
still in its round.

No socket and no clock of its own: the callers (``nodes.coordinator``, ``nodes.member``)
pass the time from their own monotonic clock. Liveness is judged on the watcher's clock
only: a node's keep-alive is a counter it increments; the coordinator notes when it last
saw the counter change, never a timestamp written by another machine. The records kept in
the store are ``nodes.records``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ft_launcher.nodes.records import (
    CLOSED,
    LOST,
    LostNode,
    Membership,
    NodeInfo,
    Notice,
)

# -- liveness ---------------------------------------------------------------------------


@dataclass
class KeepAliveBook:
    """When the watcher last saw each node's keep-alive counter change, on its own clock.

    A node is presumed alive when first seen. A watcher that did not look for a while (its
    own process stalled) learned nothing about the others meanwhile: every node is presumed
    alive again from the moment it looks, so a stall of the watcher never drops a node."""

    dead_after: float
    interval: float
    counters: dict[str, int | None] = field(default_factory=dict)
    changed_at: dict[str, float] = field(default_factory=dict)
    looked_at: float | None = None

    def observe(self, counters: Mapping[str, int | None], now: float) -> None:
        blind = self.looked_at is not None and now - self.looked_at > 2 * self.interval
        if blind:
            for node in self.changed_at:
                self.changed_at[node] = now
        self.looked_at = now
        for node, count in counters.items():
            if node not in self.changed_at or count != self.counters.get(node):
                self.changed_at[node] = now
            self.counters[node] = count

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for node in [n for n in self.changed_at if n not in keep]:
            del self.changed_at[node]
            self.counters.pop(node, None)

    def last_seen(self, node: str, now: float) -> float:
        """Seconds since the node's counter last changed (0 when never seen)."""
        return max(0.0, now - self.changed_at.get(node, now))

    def lapsed(self, nodes: Iterable[str], now: float) -> list[str]:
        return [n for n in nodes if self.last_seen(n, now) > self.dead_after]


def counter_value(data: bytes | None) -> int | None:
    """A keep-alive counter as read from the store (untrusted): None when absent or
    malformed, which the book treats as "no change seen"."""
    if data is None or len(data) > 24:
        return None
    try:
        return int(data)
    except ValueError:
        return None


# -- closing a round --------------------------------------------------------------------


@dataclass(frozen=True)
class CloseRule:
    """When the coordinator closes a round: as soon as it has ``max_nodes``; or once it has
    at least ``min_nodes`` and either every node expected (the previous round's live
    nodes) has joined, or ``last_call_s`` has passed since it first had ``min_nodes``."""

    min_nodes: int
    max_nodes: int
    last_call_s: float


def order_members(joined: Sequence[NodeInfo], previous: Sequence[str]) -> list[NodeInfo]:
    """Group-rank order: the previous round's nodes keep their relative order (a rank's
    snapshot stays on its node), then the newcomers in the order they joined."""
    place = {node: i for i, node in enumerate(previous)}
    known = sorted((n for n in joined if n.node in place), key=lambda n: place[n.node])
    return known + [n for n in joined if n.node not in place]


def close_round(rule: CloseRule, g: int, joined: Sequence[NodeInfo], previous: Sequence[str],
                expected: set[str], min_since: float | None, now: float) -> Membership | None:
    """The membership to write for round ``g``, or None to keep collecting. ``joined`` are
    the live joiners in ticket order (one entry per node), ``previous`` the last round's
    nodes in rank order, ``expected`` those whose arrival closes the round early (its live
    ones), ``min_since`` when ``min_nodes`` was first reached. Past ``max_nodes``, the
    previous round's nodes come first (their snapshots are local), the rest are spares."""
    if len(joined) < rule.min_nodes:
        return None
    full = len(joined) >= rule.max_nodes
    everyone = bool(expected) and expected <= {n.node for n in joined}
    called = min_since is not None and now - min_since >= rule.last_call_s
    if not (full or everyone or called):
        return None
    ordered = order_members(joined, previous)
    return Membership(g, tuple(ordered[:rule.max_nodes]), tuple(ordered[rule.max_nodes:]))


def first_tickets(items: Sequence[NodeInfo]) -> list[NodeInfo]:
    """One entry per node, its first ticket (a node that joins twice keeps its place)."""
    seen: set[str] = set()
    out = []
    for n in items:
        if n.node not in seen:
            seen.add(n.node)
            out.append(n)
    return out


# -- a node's view ----------------------------------------------------------------------


def out_reason(notice: Notice | None, node: str, g: int, beat_gap_s: float,
               dead_after: float, interval: float) -> str | None:
    """Pure: why ``node`` is no longer in round ``g``, or None when it still is.

    ``notice`` is the next round's (None when none was opened); ``beat_gap_s`` the longest
    time between two of this node's successful keep-alives since it joined ``g``, or
    since its last one: within one interval of the expiry, the coordinator may be dropping
    it right now, so it counts itself out (one restart for every node, rather than stale
    workers writing a moment longer)."""
    if notice is not None:
        lost = notice.dropped(node)
        if lost is not None:
            return (f"dropped from round {g}: its keep-alive lapsed (none seen for "
                    f"{lost.last_seen_s:.1f} s)")
        if notice.why == CLOSED:
            return "the rendezvous was closed"
        return f"round {g} is over: the others moved on to round {notice.round} ({notice.why})"
    if beat_gap_s > dead_after - interval:
        return (f"its keep-alive paused {beat_gap_s:.1f} s: the others drop a node after "
                f"{dead_after:g} s")
    return None


# -- the coordinator's decisions --------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """What the coordinator read from the store in one look."""

    next_open: Notice | None = None  # the next round's notice, when someone opened it
    joins: tuple[NodeInfo, ...] = ()  # new tickets of the round being collected
    counters: Mapping[str, int | None] = field(default_factory=dict)  # keep-alives


@dataclass(frozen=True)
class Close:
    """Write the round's membership (it closes)."""

    membership: Membership


@dataclass(frozen=True)
class Open:
    """Open the next round with this notice (first writer wins)."""

    notice: Notice


Action = Close | Open


@dataclass
class CoordinatorCore:
    """The coordinator's state and decisions, one round at a time: while a round is being
    collected, close it by ``CloseRule``; while it runs, drop the nodes whose keep-alive
    lapsed by opening the next round. Someone else opening the next round (a node that
    restarts, one that arrives, a hang verdict) starts its collection; a round that was
    still being collected then is abandoned."""

    rule: CloseRule
    book: KeepAliveBook
    me: str
    round: int = 0
    collecting: bool = True
    joined: list[NodeInfo] = field(default_factory=list)
    previous: list[str] = field(default_factory=list)  # the last closed round's nodes
    expected: set[str] = field(default_factory=set)
    min_since: float | None = None
    members: Membership | None = None
    opened: bool = False  # this coordinator opened the next round; waiting to see it

    def watched(self) -> list[str]:
        """Whose keep-alive counters to read: the joiners, or the running round's nodes."""
        if self.collecting:
            return [n.node for n in self.joined]
        return [n.node for n in self.members.nodes] if self.members else []

    def step(self, seen: Seen, now: float) -> list[Action]:
        """Take one look's worth of news; what to write to the store."""
        self.book.observe(seen.counters, now)
        if seen.next_open is not None:
            return self._advance(seen.next_open)
        if self.collecting:
            return self._collect(seen.joins, now)
        return self._watch(now)

    def _advance(self, notice: Notice) -> list[Action]:
        actions: list[Action] = []
        if self.collecting:  # nodes waiting for it learn to go on to the next one
            actions.append(Close(Membership(self.round, abandoned=True)))
        elif self.members is not None:
            self.previous = [n.node for n in self.members.nodes]
        gone = {n.node for n in notice.lost}
        self.expected = set(self.previous) - gone
        self.round, self.collecting, self.opened = notice.round, True, False
        self.joined, self.members, self.min_since = [], None, None
        return actions

    def _collect(self, joins: Sequence[NodeInfo], now: float) -> list[Action]:
        self.joined = first_tickets([*self.joined, *joins])
        lapsed = set(self.book.lapsed([n.node for n in self.joined], now))
        live = [n for n in self.joined if n.node not in lapsed]
        if len(live) >= self.rule.min_nodes and self.min_since is None:
            self.min_since = now
        membership = close_round(self.rule, self.round, live, self.previous,
                                 self.expected - lapsed, self.min_since, now)
        if membership is None:
            return []
        self.collecting, self.members = False, membership
        self.book.forget(n.node for n in membership.nodes)
        return [Close(membership)]

    def _watch(self, now: float) -> list[Action]:
        if self.opened or self.members is None:
            return []
        lapsed = self.book.lapsed([n.node for n in self.members.nodes], now)
        if not lapsed:
            return []
        by_node = {n.node: n for n in self.members.nodes}
        lost = tuple(LostNode(n, by_node[n].host, round(self.book.last_seen(n, now), 3))
                     for n in lapsed)
        self.opened = True
        return [Open(Notice(self.round + 1, LOST, self.me, lost))]
