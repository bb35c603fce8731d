"""The rendezvous as one node takes part in it (``--rdzv-backend c10d`` and ``etcd``).

A node keeps alive with one counter (``pulse``), joins a round by ticket, and waits for the
membership the coordinator writes once (``coordinator``); while its workers run it learns
of the next round from the pulse, which the store wakes: no request per poll. Per node and
keep-alive interval that is two small requests, whatever the number of nodes; a round of N
costs N tickets and one membership.

Where the round's store lives and who coordinates is the ``Place`` (``nodes.place``): a
c10d store hosted by one launcher (that launcher coordinates), or, with etcd, a c10d store
hosted by the launcher elected through etcd.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from ft_launcher.nodes.kv import StoreUnreachable
from ft_launcher.nodes.records import (
    CLOSED,
    LEFT,
    REJOIN,
    STORE_LOST,
    TAKEOVER,
    WAITING,
    Keys,
    LostNode,
    Membership,
    NodeInfo,
    Notice,
    RecordError,
)
from ft_launcher.nodes.rendezvous import (
    OBSERVER_ERRORS,
    RendezvousClosed,
    RendezvousError,
    RendezvousLost,
    RendezvousTimings,
    RoundInfo,
    RoundView,
    Standing,
    free_port,
)
from ft_launcher.nodes.rounds import out_reason
from ft_launcher.nodes.verdicts import VerdictChannel

log = logging.getLogger("ft_launcher")

MASTER_WAIT_S = 30.0


def node_id(host: str) -> str:
    """Unique per launcher process: host, pid and a random tag (pids repeat across hosts
    and containers)."""
    return f"{host}-{os.getpid()}-{os.urandom(3).hex()}"


class RoundRendezvous:
    """This node's side of the rendezvous (``ports.RendezvousPort``).

    ``next_round()`` blocks until this node has a place (emitting ``spare_waiting`` and
    ``spare_admitted`` through ``events`` while it waits as a hot spare); ``poll_round``
    reads what the pulse learnt; ``standing`` asks the store after a stall. Raises
    ``RendezvousLost`` when the store is gone and ``RendezvousClosed`` when the job is
    over."""

    polls_peers = True

    def __init__(self, place: Any, run_id: str, min_nodes: int, max_nodes: int,
                 timings: RendezvousTimings, fixed_port: int | None, local_addr: str,
                 host: str, events: Callable[..., Any] | None = None,
                 me: str | None = None) -> None:
        self.place = place
        self.run_id, self.min_nodes, self.max_nodes = run_id, min_nodes, max_nodes
        self.timings, self.fixed_port = timings, fixed_port
        self.local_addr, self.host = local_addr, host
        self.events = events
        self.me = NodeInfo(me or node_id(host), local_addr, host)
        place.start_pulse(self.me.node)
        self.round: int | None = None  # the round this node is in (or last was)
        self._epoch = place.epoch  # the coordinator of that round (etcd elects new ones)
        self.membership: Membership | None = None
        self._was_dropped = False
        self._spare_since: float | None = None  # next_round(): waiting as a spare since

    @property
    def kv(self) -> Any:
        """The main thread's client of the round's store (the coordinator's)."""
        return self.place.main

    @property
    def pulse(self) -> Any:
        return self.place.pulse

    # -- the port's facts ----------------------------------------------------------------

    @property
    def node_name(self) -> str:
        return self.me.node

    @property
    def stop_fence_s(self) -> float:
        """A rank stopped this long asks whether its round is still current
        (``FT_STOP_FENCE_S``)."""
        return self.timings.stop_fence_s

    @property
    def round_store(self) -> Any | None:
        """The current round's store for the services (snapshots, stragglers): a torch
        ``Store`` whose keys no other round reads; None before the first round."""
        if self.round is None:
            return None
        return self.place.services_store(Keys.services(self.round))

    @property
    def job_store(self) -> Any:
        """A store that lives as long as the job (the snapshot replicas' shared token)."""
        return self.place.job_store()

    # -- joining -------------------------------------------------------------------------

    def _emit(self, name: str, **fields: Any) -> None:
        if self.events is None:
            return
        try:
            self.events(name, **fields)
        except OBSERVER_ERRORS:
            log.exception("rendezvous: cannot record %s", name)

    def _lost(self, exc: BaseException) -> RendezvousLost:
        return RendezvousLost(self.place.backend, self.place.endpoint, exc)

    def next_round(self) -> RoundInfo:
        """Join the next round (blocks): a node that finds the round full waits as a hot
        spare (``spare_waiting``) until a node is lost (``spare_admitted``)."""
        previous, self._spare_since = self.membership, None
        while True:
            try:
                self.place.refresh()
                self.pulse.watch(None)
                fresh = self.round is None or self._epoch != self.place.epoch
                g = self.place.latest_round() if fresh else self._leave_round(self.round)
                membership, g = self._join_from(g)
                rnd = self._start_round(membership, g)
                break
            except StoreUnreachable as exc:
                if not self.place.coordinator_replaceable:
                    raise self._lost(exc) from None
                self.place.reconnect(exc)  # RendezvousLost when the job's store is gone
        rnd.left = gone(previous, membership)
        if self._spare_since is not None:
            rnd.spare_wait_s = round(time.monotonic() - self._spare_since, 3)
            self._emit("spare_admitted", waited_s=rnd.spare_wait_s, round=g,
                       group_rank=rnd.group_rank, group_world_size=rnd.group_world_size)
        return rnd

    def _leave_round(self, g: int) -> int:
        """This node leaves round ``g`` to re-join: the next round opens (unless someone
        opened it already, e.g. the coordinator that dropped this node)."""
        self.open_next(REJOIN)
        return g + 1

    def open_next(self, why: str, lost: tuple[LostNode, ...] = ()) -> Notice:
        """Open the round after this node's (first writer wins); the notice that stands."""
        return self._open((self.round or 0) + 1, why, lost)

    def _open(self, g: int, why: str, lost: tuple[LostNode, ...] = ()) -> Notice:
        notice = Notice(g, why, self.me.node, lost)
        held = self.kv.create(Keys.open(g), notice.encode())
        try:
            return Notice.decode(held)
        except RecordError:
            return notice

    def _join_from(self, g: int) -> tuple[Membership, int]:
        """Rounds from ``g`` on until one has this node: (its membership, its number).
        ``_spare_since`` says when this node began waiting as a spare."""
        deadline = time.monotonic() + self.timings.join_timeout
        while True:
            self._check_closed()
            membership = self._read_members(g)
            if membership is None:
                self._take_ticket(g)
                membership = self._await_members(g, deadline)
            if membership.abandoned:  # the next round is open (unless the record was junk)
                g += 1
                self._open(g, REJOIN)
                continue
            if membership.rank_of(self.me.node) is not None:
                return membership, g
            if len(membership.nodes) < self.max_nodes and not membership.is_spare(self.me.node):
                g += 1  # arrived while it runs with room: everyone restarts once
                self._open(g, WAITING)
                continue
            if self._spare_since is None:
                self._spare_since = time.monotonic()
                self._emit("spare_waiting", round=g, participants=len(membership.nodes),
                           max_nodes=self.max_nodes)
            self._await_key(Keys.open(g + 1), None)
            deadline = time.monotonic() + self.timings.join_timeout
            g += 1

    def _check_closed(self) -> None:
        end = self.place.end()
        if end == STORE_LOST:
            raise self._lost(StoreUnreachable("the coordinator lost the job's store"))
        if end is not None:
            why = ("; this node was dropped from its round and not needed again"
                   if self._was_dropped else "; this spare was not needed"
                   if self._spare_since is not None else "")
            raise RendezvousClosed(f"the rendezvous at {self.place.endpoint} was closed by "
                                   f"the other nodes (the job is over){why}",
                                   was_spare=self._spare_since is not None or self._was_dropped)

    def _read_members(self, g: int) -> Membership | None:
        data = self.kv.get(Keys.members(g))
        return None if data is None else self._decode_members(g, data)

    def _decode_members(self, g: int, data: bytes) -> Membership:
        try:
            return Membership.decode(data)
        except RecordError as exc:  # untrusted: a broken round is skipped, not trusted
            log.warning("rendezvous: round %d's membership is malformed (%s)", g, exc)
            return Membership(g, abandoned=True)

    def _take_ticket(self, g: int) -> None:
        ticket = self.kv.add(Keys.join_count(g), 1)
        self.kv.set(Keys.join(g, ticket), self.me.encode())

    def _await_members(self, g: int, deadline: float) -> Membership:
        data = self._await_key(Keys.members(g), deadline)
        return self._decode_members(g, data)

    def _await_key(self, key: str, deadline: float | None) -> bytes:
        """Wait for ``key`` in slices (a signal's handler runs between them; the job may
        close meanwhile); RendezvousError at ``deadline``."""
        while True:
            slice_s = self.timings.keep_alive_interval
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(
                        f"no round formed at {self.place.endpoint} within join_timeout "
                        f"{self.timings.join_timeout:g} s")
                slice_s = min(slice_s, left)
            data = self.kv.wait(key, slice_s)
            if data is not None:
                return data
            self._check_closed()
            self._check_pulse()

    def _check_pulse(self) -> None:
        """The keep-alive has failed for the grace: the store is lost (c10d), or its
        coordinator is (etcd: ``next_round`` finds the next one)."""
        state = self.pulse.state()
        if state.unreachable_s is not None and state.unreachable_s >= self.place.lost_grace_s:
            raise StoreUnreachable(f"the keep-alive gets no answer for "
                                   f"{state.unreachable_s:.1f} s")

    def _start_round(self, membership: Membership, g: int) -> RoundInfo:
        self.round, self.membership, self._was_dropped = g, membership, False
        self._epoch = self.place.epoch
        self.pulse.watch(g)
        rank = membership.rank_of(self.me.node)
        assert rank is not None
        size = len(membership.nodes)
        if rank == 0:
            port = self.fixed_port or free_port("0.0.0.0")
            self.kv.set(Keys.master(g), f"{self.local_addr}:{port}".encode())
            return RoundInfo(0, size, self.local_addr, port, g)
        data = self.kv.wait(Keys.master(g), max(MASTER_WAIT_S, self.timings.dead_after))
        addr, port = parse_master(data)
        return RoundInfo(rank, size, addr, port, g)

    # -- while the workers run -----------------------------------------------------------

    def num_nodes_waiting(self) -> int:
        return self.poll_round().waiting

    def poll_round(self) -> RoundView:
        """What the pulse learnt (no request): the next round opened (nodes waiting, nodes
        lost, this node dropped, a hang verdict). Raises RendezvousLost once the store
        has not answered for the grace."""
        state = self.pulse.state()
        if state.unreachable_s is not None and state.unreachable_s >= self.place.lost_grace_s:
            if self.place.coordinator_replaceable:  # a new one is elected when it re-joins
                return RoundView(waiting=1, why=TAKEOVER)
            raise self._lost(StoreUnreachable(f"no answer for {state.unreachable_s:.1f} s"))
        notice = state.notice
        if notice is None:
            return RoundView()
        if notice.why == STORE_LOST:
            raise self._lost(StoreUnreachable("the coordinator lost the job's store"))
        return view_of(notice, self.me.node, self.round or 0)

    def standing(self, stalled_s: float) -> Standing:
        """Whether this node is still in its round after it was not running for
        ``stalled_s`` (its launcher stopped, or a rank's stop fence): the next round's
        notice read now, and this node's own keep-alive gaps (within one interval of the
        expiry it counts itself out). When the store does not answer, a stall of the
        keep-alive expiry or more means the node is out."""
        if self.round is None:
            return Standing(True)
        t = self.timings
        try:
            data = self.kv.get(Keys.open(self.round + 1))
        except StoreUnreachable as exc:
            lapsed = stalled_s >= t.dead_after
            return Standing(not lapsed, f"the rendezvous did not answer ({exc})" + (
                f"; stopped {stalled_s:.1f} s, past the keep-alive expiry {t.dead_after:g} s"
                if lapsed else ""), known=False)
        notice = None
        if data is not None:
            try:
                notice = Notice.decode(data)
            except RecordError:
                notice = Notice(self.round + 1, REJOIN, "unknown")
        gap = max(self.pulse.state().beat_gap_s, stalled_s)
        why = out_reason(notice, self.me.node, self.round, gap, t.dead_after,
                         t.keep_alive_interval)
        return Standing(why is None, why or "")

    def verdict_channel(self, rnd: RoundInfo) -> VerdictChannel | None:
        """The round's hang verdict, shared with its other nodes (None alone)."""
        if rnd.group_world_size < 2:
            return None
        return VerdictChannel(self.kv, self.me, rnd.round, rnd.group_rank,
                              rnd.group_world_size)

    def mark_dropped(self) -> None:
        """The others dropped this node; if the job ends before it is needed again, it
        ends as a spare."""
        self._was_dropped = True

    # -- leaving -------------------------------------------------------------------------

    def exit_barrier(self, wait: bool, timeout: float = 300.0) -> None:
        """Say this node is leaving; with ``wait``, wait until every node of the round
        left (the store's host must outlive the others' last requests)."""
        if self.round is None or self.membership is None:
            return
        nodes = len(self.membership.nodes)
        deadline = time.monotonic() + timeout
        try:
            done = self.kv.add(Keys.exited(self.round), 1)
            while wait and done < nodes and time.monotonic() < deadline:
                time.sleep(0.05)
                done = self.kv.add(Keys.exited(self.round), 0)
        except StoreUnreachable as exc:  # the store's host may be gone already
            log.debug("exit barrier: %s", exc)
            return
        if wait and done < nodes:
            log.warning("exit barrier: %d of %d nodes finished after %.0f s", done, nodes,
                        timeout)

    def shutdown(self, close: bool = True) -> None:
        """``close``: the job is over for every node (waiting spares then exit); otherwise
        this node leaves alone and the others re-form at once, without waiting for its
        keep-alive to lapse."""
        try:
            if close:
                self.place.close_job()
                self.open_next(CLOSED)
            elif self.round is not None and self.membership is not None \
                    and self.membership.rank_of(self.me.node) is not None:
                self.open_next(LEFT, (LostNode(self.me.node, self.me.host, 0.0),))
        except (StoreUnreachable, RendezvousError) as exc:  # best effort at exit
            log.debug("rendezvous shutdown: %s", exc)
        self.place.close()


def view_of(notice: Notice, node: str, g: int) -> RoundView:
    """What the next round's ``notice`` means for ``node`` of round ``g``."""
    lost = tuple(n.node for n in notice.lost if n.node != node)
    me = notice.dropped(node)
    dropped = out_reason(notice, node, g, 0.0, math.inf, 0.0) if me else None
    return RoundView(waiting=0 if notice.lost else 1, lost=lost, dropped=dropped,
                     why=notice.why, verdict=notice.verdict,
                     last_seen_s=me.last_seen_s if me else None)


def gone(previous: Membership | None, now: Membership) -> tuple[str, ...]:
    """Nodes of the previous round that the new one lacks."""
    if previous is None:
        return ()
    here = {n.node for n in now.nodes}
    return tuple(sorted(n.node for n in previous.nodes if n.node not in here))


def parse_master(data: bytes | None) -> tuple[str, int]:
    """``addr:port`` as group rank 0 wrote it (untrusted)."""
    try:
        addr, _, port = (data or b"").decode().rpartition(":")
        value = int(port)
    except (UnicodeDecodeError, ValueError):
        raise RendezvousError(f"the workers' master address is malformed: {data!r:.80}") \
            from None
    if not addr or not 0 < value < 65536:
        raise RendezvousError(f"the workers' master address is malformed: {data!r:.80}")
    return addr, value


