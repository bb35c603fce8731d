"""Straggler medians shared between launchers through the rendezvous store.

Each launcher's detector knows only its own ranks' section times. Where launchers share a
rendezvous (a c10d TCPStore or etcd), each one writes its ranks' recent medians under its own
key of the round's store every few seconds and reads the other nodes' keys, so every node
scores its ranks against the whole job (``StragglerDetector.observe_remote``).

What is read comes from another machine: it is untrusted. ``decode_medians`` is total (any
bytes give a bounded dict or an error string, never an exception) and checks every field;
a node writes at most ``MAX_RANKS`` ranks in at most ``MAX_BYTES``.

The encoding and the decoding are pure; ``Exchange`` does the store I/O, rate-limited by an
injected clock, and never raises (a store that fails is logged; the detector then compares
local ranks only, and remote medians age out after the detector's ``remote_ttl_s``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("ft_launcher")

KEY_PREFIX = "ft_launcher/stragglers/"  # + the node's group rank; the round's store is fresh
VERSION = 1
MAX_BYTES = 64 * 1024
MAX_RANKS = 1024  # ranks per node
MAX_HOST_CHARS = 255
MAX_MEDIAN_S = 7 * 24 * 3600.0
DEFAULT_INTERVAL_S = 3.0  # between two publications (and two reads) of one node
CLOCKS = ("wall", "device")


class Store(Protocol):
    """What the exchange needs of a torch ``Store`` (c10d TCPStore, etcd store)."""

    def set(self, key: str, value: bytes | str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class NodeMedians:
    """One node's publication: its host, the clock of its times, rank -> median seconds."""

    host: str
    clock: str
    medians: dict[int, float]


def encode_medians(host: str, clock: str, medians: Mapping[int, float]) -> bytes:
    """The bytes a node publishes (its first ``MAX_RANKS`` ranks; invalid values left out)."""
    ranks = {str(r): round(float(m), 9) for r, m in sorted(medians.items())[:MAX_RANKS]
             if _rank(r) and _seconds(m)}
    return json.dumps({"v": VERSION, "host": host[:MAX_HOST_CHARS], "clock": clock,
                       "ranks": ranks}, separators=(",", ":")).encode()


def decode_medians(data: Any) -> NodeMedians | str:
    """A node's publication, or a string saying why it is rejected (never raises)."""
    if not isinstance(data, (bytes, bytearray)):
        return f"not bytes but {type(data).__name__}"
    if len(data) > MAX_BYTES:
        return f"{len(data)} bytes, more than {MAX_BYTES}"
    try:
        msg = json.loads(bytes(data).decode(), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return f"not JSON: {str(exc)[:100]}"
    if type(msg) is not dict or msg.get("v") != VERSION or type(msg.get("v")) is not int:
        return "not a version 1 object"
    host, clock, ranks = msg.get("host"), msg.get("clock"), msg.get("ranks")
    if type(host) is not str or len(host) > MAX_HOST_CHARS or not host.isprintable():
        return "host: not a printable string of at most 255 characters"
    if clock not in CLOCKS:
        return f"clock: not one of {', '.join(CLOCKS)}"
    if type(ranks) is not dict or len(ranks) > MAX_RANKS:
        return f"ranks: not an object of at most {MAX_RANKS} ranks"
    medians = {}
    for key, value in ranks.items():
        if not (key.isdigit() and key.isascii() and len(key) <= 10 and _rank(int(key))):
            return f"ranks: {key[:20]!r} is not a rank"
        if not _seconds(value):
            return f"ranks: median of rank {key} is not a number of seconds"
        medians[int(key)] = float(value)
    return NodeMedians(host, clock, medians)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _rank(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 31


def _seconds(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value <= MAX_MEDIAN_S


@dataclass
class Exchange:
    """Publish this node's medians and collect the other nodes' through ``store``, at most
    once per ``interval_s``. ``poll()`` returns the other nodes' publications when it read
    them (an empty list otherwise); the caller feeds them to the detector."""

    store: Store
    node: int  # this node's group rank
    nodes: int  # nodes in the round
    host: str
    interval_s: float = DEFAULT_INTERVAL_S
    now: Callable[[], float] = time.monotonic
    rejected: dict[int, str] = field(default_factory=dict)  # node -> why, last seen
    _next_at: float = field(default=0.0, init=False)

    def poll(self, medians: Mapping[int, float], clock: str = "wall") -> list[NodeMedians]:
        now = self.now()
        if now < self._next_at:
            return []
        self._next_at = now + self.interval_s
        try:
            if medians:
                self.store.set(f"{KEY_PREFIX}{self.node}",
                               encode_medians(self.host, clock, medians))
            return self._read_others()
        except Exception as exc:  # noqa: BLE001 - a store's client raises many kinds
            log.warning("stragglers: rendezvous store unavailable: %s", str(exc)[:200])
            return []

    def _read_others(self) -> list[NodeMedians]:
        out = []
        for node in range(self.nodes):
            key = f"{KEY_PREFIX}{node}"
            # check() first: get() of a missing key blocks until the store's timeout.
            if node == self.node or not self.store.check([key]):
                continue
            got = decode_medians(self.store.get(key))
            if isinstance(got, str):
                if self.rejected.get(node) != got:
                    log.warning("stragglers: node %d's medians rejected: %s", node, got)
                self.rejected[node] = got
                continue
            out.append(got)
        return out


def for_round(rdzv: Any, group_rank: int, nodes: int, host: str) -> Exchange | None:
    """The exchange of this round, or None: one node, or a rendezvous without a shared
    store (static addresses). The store is the round's own (torch prefixes it per round),
    so no publication of a previous round is ever read."""
    if nodes < 2:
        return None
    store = rdzv.round_store  # None: no shared store (fixed addresses)
    if store is None:
        return None
    return Exchange(store, group_rank, nodes, host)
