"""The coordinator: one thread in one launcher that closes rounds and drops the nodes whose
keep-alive lapsed. The decisions are ``rounds.CoordinatorCore``'s; this module only reads
the store and writes what the core decided.

With the c10d backend the coordinator is the launcher that hosts the store (its loss is the
store's loss anyway); with etcd it is the launcher elected through etcd, and the round's
store is a c10d store it hosts. Its reads, per look: the next round's notice (a push: it
waits on the key), the new tickets while a round is collected (one counter read and one
``multi_get``), and the keep-alive counters of the round's nodes (one ``multi_get``). It
looks every ``poll_interval``: a counter's change is then dated to within that, so a node
is dropped within the keep-alive expiry plus one look of its last keep-alive. Its cost
does not grow with the number of nodes in requests, only in the size of two reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ft_launcher.nodes.kv import KeyValue, StoreUnreachable
from ft_launcher.nodes.records import (
    REJOIN,
    Keys,
    NodeInfo,
    Notice,
    RecordError,
)
from ft_launcher.nodes.rounds import Close, CoordinatorCore, Open, Seen, counter_value

log = logging.getLogger("ft_launcher")


def read_notice(kv: KeyValue, g: int) -> Notice | None:
    """Round ``g``'s notice, None when it is not open. A malformed one (untrusted) still
    means the round is open: it reads as a generic restart."""
    data = kv.get(Keys.open(g))
    if data is None:
        return None
    try:
        return Notice.decode(data)
    except RecordError as exc:
        log.warning("rendezvous: round %d's notice is malformed (%s)", g, exc)
        return Notice(g, REJOIN, "unknown")


class CoordinatorLoop:
    """Runs ``core`` against ``kv`` in a daemon thread until ``stop()``.

    ``on_round`` is told each round number the coordinator moves to (the job's store keeps
    the latest for launchers that arrive later); ``on_error`` is told when the store stops
    answering (the loop then ends)."""

    def __init__(self, kv: KeyValue, core: CoordinatorCore, interval: float,
                 poll_interval: float, on_round: Callable[[int], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self.core = kv, core
        self.interval, self.poll_interval = interval, poll_interval
        self.on_round = on_round
        self.clock = clock
        self.cursor = 0  # tickets of the collected round read so far
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ft-rdzv-coordinator",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval + 1)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.look()
        except StoreUnreachable as exc:
            self.error = str(exc)
            log.warning("rendezvous coordinator: the store stopped answering: %s", exc)

    def look(self) -> None:
        """One look: wait for news (or the next scan), read, decide, write."""
        core = self.core
        if core.collecting:
            self._stop.wait(self.poll_interval)
            next_open = read_notice(self.kv, core.round + 1)
        else:  # pushed by the store when someone opens the next round
            data = self.kv.wait(Keys.open(core.round + 1), self.poll_interval)
            next_open = read_notice(self.kv, core.round + 1) if data is not None else None
        joins = self.read_joins() if core.collecting and next_open is None else ()
        counters = self.read_counters(core.watched())
        before = core.round
        for action in core.step(Seen(next_open, joins, counters), self.clock()):
            self.apply(action)
        if core.round != before:
            self.cursor = 0
            if self.on_round is not None:
                self.on_round(core.round)

    def read_joins(self) -> tuple[NodeInfo, ...]:
        g = self.core.round
        count = self.kv.add(Keys.join_count(g), 0)
        if count <= self.cursor:
            return ()
        values = self.kv.multi_get([Keys.join(g, i) for i in range(self.cursor + 1, count + 1)])
        out = []
        for value in values:
            if value is None:  # its ticket is taken but not yet written: next look
                break
            self.cursor += 1
            try:
                out.append(NodeInfo.decode(value))
            except RecordError as exc:
                log.warning("rendezvous: round %d: a malformed joiner skipped (%s)", g, exc)
        return tuple(out)

    def read_counters(self, nodes: list[str]) -> dict[str, int | None]:
        values = self.kv.multi_get([Keys.alive(n) for n in nodes])
        return {n: counter_value(v) for n, v in zip(nodes, values, strict=True)}

    def apply(self, action: Close | Open) -> None:
        if isinstance(action, Close):
            m = action.membership
            self.kv.create(Keys.members(m.round), m.encode())
            if not m.abandoned:
                log.info("rendezvous: round %d closed with %d node(s), %d spare(s)", m.round,
                         len(m.nodes), len(m.spares))
        else:
            n = action.notice
            self.kv.create(Keys.open(n.round), n.encode())
            log.info("rendezvous: round %d opened: %s %s", n.round, n.why,
                     ", ".join(f"{x.node} (last seen {x.last_seen_s:g} s ago)" for x in n.lost))
