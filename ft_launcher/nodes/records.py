"""What the rendezvous keeps in its store, encoded and checked: everything read from a
store is untrusted (bounded sizes, every field checked, ``RecordError`` and nothing else on
bad input).

The store's keys for one job (``Keys``):

| key | what |
| --- | --- |
| ``alive/<node>`` | the node's keep-alive counter |
| ``r/<g>/open`` | round g is open for joining: the ``Notice`` of why (first writer wins) |
| ``r/<g>/join/n``, ``r/<g>/join/<i>`` | the joiners of round g by ticket (``add`` gives i) |
| ``r/<g>/members`` | the round as its coordinator closed it: nodes in group-rank order, spares |
| ``r/<g>/master`` | where round g's workers meet (written by its group rank 0) |
| ``r/<g>/exited`` | the exit barrier's counter |
| ``r/<g>/hang``, ``.../acks`` | the round's hang verdict (first writer wins); nodes that answered |
| ``r/<g>/x/`` | the round's store for the services (snapshots, stragglers) |
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

MAX_RECORD_BYTES = 4 << 20  # a membership of 10,000 nodes is about 1 MB
MAX_LIST = 100_000
_NAME = re.compile(r"^[\w.:\[\]%@/+-]{1,256}$")

# Why a round was opened (a ``Notice``'s ``why``).
START = "start"  # the job's first round
REJOIN = "rejoin"  # a node of the round restarts (its workers failed, or it counts itself out)
LOST = "lost"  # nodes of the round stopped keeping alive
LEFT = "left"  # a node of the round left (a health check, a requeue)
WAITING = "waiting"  # a node arrived while the round runs with room for it
HANG = "hang"  # a rank was judged hung: every node answers the verdict
CLOSED = "closed"  # the job is over
TAKEOVER = "takeover"  # a new coordinator (etcd): the old one's node is gone
STORE_LOST = "store_lost"  # the coordinator lost the job's store (etcd): the job ends
WHYS = (START, REJOIN, LOST, LEFT, WAITING, HANG, CLOSED, TAKEOVER, STORE_LOST)


class Keys:
    """The store's keys of one job (see the module table)."""

    @staticmethod
    def alive(node: str) -> str:
        return f"alive/{node}"

    @staticmethod
    def open(g: int) -> str:
        return f"r/{g}/open"

    @staticmethod
    def join_count(g: int) -> str:
        return f"r/{g}/join/n"

    @staticmethod
    def join(g: int, ticket: int) -> str:
        return f"r/{g}/join/{ticket}"

    @staticmethod
    def members(g: int) -> str:
        return f"r/{g}/members"

    @staticmethod
    def master(g: int) -> str:
        return f"r/{g}/master"

    @staticmethod
    def exited(g: int) -> str:
        return f"r/{g}/exited"

    @staticmethod
    def hang(g: int) -> str:
        return f"r/{g}/hang"

    @staticmethod
    def hang_acks(g: int) -> str:
        return f"r/{g}/hang/acks"

    @staticmethod
    def services(g: int) -> str:
        return f"r/{g}/x"


# -- records ----------------------------------------------------------------------------


class RecordError(ValueError):
    """A record read from the store is malformed (untrusted input)."""


def _load(data: bytes | None, what: str) -> dict[str, Any]:
    if data is None:
        raise RecordError(f"{what}: missing")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{what}: {len(data)} bytes, over {MAX_RECORD_BYTES}")
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"{what}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RecordError(f"{what}: not an object")
    return value


def _dump(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise RecordError(f"{what}: not a valid name")
    return value


def _count(value: Any, what: str, upper: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        raise RecordError(f"{what}: not a count in 0..{upper}")
    return value


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not 0 <= value < 1e9:
        raise RecordError(f"{what}: not a finite number of seconds")
    return float(value)


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_LIST:
        raise RecordError(f"{what}: not a list of at most {MAX_LIST}")
    return value


@dataclass(frozen=True)
class NodeInfo:
    """A launcher as it joins a round: its id (unique per launcher process), the address
    its peers reach it by, and its host name (what a scheduler excludes)."""

    node: str
    addr: str
    host: str

    def encode(self) -> bytes:
        return _dump(asdict(self))

    @classmethod
    def decode(cls, data: bytes | None) -> NodeInfo:
        return cls.from_dict(_load(data, "joiner"))

    @classmethod
    def from_dict(cls, d: Any) -> NodeInfo:
        if not isinstance(d, dict):
            raise RecordError("node: not an object")
        return cls(_name(d.get("node"), "node"), _name(d.get("addr"), "addr"),
                   _name(d.get("host"), "host"))


@dataclass(frozen=True)
class Membership:
    """A round as its coordinator closed it: ``nodes`` in group-rank order, ``spares``
    (joined when it was full), or ``abandoned`` (a next round opened before it closed)."""

    round: int
    nodes: tuple[NodeInfo, ...] = ()
    spares: tuple[NodeInfo, ...] = ()
    abandoned: bool = False

    def rank_of(self, node: str) -> int | None:
        for i, n in enumerate(self.nodes):
            if n.node == node:
                return i
        return None

    def is_spare(self, node: str) -> bool:
        return any(n.node == node for n in self.spares)

    def encode(self) -> bytes:
        return _dump({"round": self.round, "nodes": [asdict(n) for n in self.nodes],
                      "spares": [asdict(n) for n in self.spares],
                      "abandoned": self.abandoned})

    @classmethod
    def decode(cls, data: bytes | None) -> Membership:
        d = _load(data, "members")
        nodes = tuple(NodeInfo.from_dict(n) for n in _list(d.get("nodes"), "members.nodes"))
        spares = tuple(NodeInfo.from_dict(n) for n in _list(d.get("spares", []),
                                                              "members.spares"))
        if len({n.node for n in nodes + spares}) != len(nodes) + len(spares):
            raise RecordError("members: a node is listed twice")
        return cls(_count(d.get("round"), "members.round"), nodes, spares,
                   bool(d.get("abandoned", False)))


@dataclass(frozen=True)
class LostNode:
    """A node the coordinator dropped, and how long ago it last saw its keep-alive (on the
    coordinator's own clock)."""

    node: str
    host: str
    last_seen_s: float


@dataclass(frozen=True)
class Notice:
    """Why round ``round`` was opened, by whom, and what every node of the round before
    it must know: the nodes dropped, a hang verdict, the job's end."""

    round: int
    why: str
    by: str  # the node that opened it (or the coordinator)
    lost: tuple[LostNode, ...] = ()
    verdict: dict[str, Any] | None = None  # HANG: the Verdict's fields

    def encode(self) -> bytes:
        return _dump({"round": self.round, "why": self.why, "by": self.by,
                      "lost": [asdict(n) for n in self.lost], "verdict": self.verdict})

    @classmethod
    def decode(cls, data: bytes | None) -> Notice:
        d = _load(data, "notice")
        why = d.get("why")
        if why not in WHYS:
            raise RecordError(f"notice.why: unknown {str(why)[:40]!r}")
        lost = []
        for n in _list(d.get("lost", []), "notice.lost"):
            if not isinstance(n, dict):
                raise RecordError("notice.lost: not an object")
            lost.append(LostNode(_name(n.get("node"), "lost.node"),
                                 _name(n.get("host"), "lost.host"),
                                 _seconds(n.get("last_seen_s"), "lost.last_seen_s")))
        verdict = d.get("verdict")
        if verdict is not None:
            verdict = asdict(Verdict.from_dict(verdict))
        return cls(_count(d.get("round"), "notice.round"), why, _name(d.get("by"), "by"),
                   tuple(lost), verdict)

    def dropped(self, node: str) -> LostNode | None:
        return next((n for n in self.lost if n.node == node), None)


# Evidence behind a hang verdict, strongest first: a stopped process beats a rank seen
# outside a collective, which beats the oldest silence (``hang.blame``).
EVIDENCE = {"stopped": 3, "not_in_collective": 2, "oldest_activity": 1, "expired_first": 0}


@dataclass(frozen=True)
class Verdict:
    """A hang verdict as the nodes share it: the rank named, its node, and why."""

    rank: int
    node: str
    host: str
    group_rank: int
    blame: str
    timeout_kind: str
    silence_s: float

    @property
    def strength(self) -> int:
        return EVIDENCE.get(self.blame, 0)

    def encode(self) -> bytes:
        return _dump(asdict(self))

    @classmethod
    def decode(cls, data: bytes | None) -> Verdict:
        return cls.from_dict(_load(data, "verdict"))

    @classmethod
    def from_dict(cls, d: Any) -> Verdict:
        if not isinstance(d, dict):
            raise RecordError("verdict: not an object")
        blame, kind = d.get("blame"), d.get("timeout_kind")
        if not isinstance(blame, str) or blame not in EVIDENCE:
            raise RecordError("verdict.blame: unknown")
        if not isinstance(kind, str) or not re.match(r"^[\w:.-]{1,64}$", kind):
            raise RecordError("verdict.timeout_kind: not a name")
        return cls(_count(d.get("rank"), "verdict.rank", 1 << 24),
                   _name(d.get("node"), "verdict.node"), _name(d.get("host"), "verdict.host"),
                   _count(d.get("group_rank"), "verdict.group_rank", 1 << 24), blame, kind,
                   _seconds(d.get("silence_s"), "verdict.silence_s"))
