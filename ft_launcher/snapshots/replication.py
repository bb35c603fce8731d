"""Replicas of this node's ranks' snapshots on other nodes (``--ft-snapshot-replicas k``).

One ``ReplicaServer`` per job and node hosts the copies other nodes push here (under the
area's ``replicas/``); a ``ReplicaSender`` per buddy pushes each local rank's newest commit
to the ``k`` nodes after this one in the ring of the round's group ranks (``buddy.buddies``).
The shared token comes from the job's rendezvous store (first writer wins), so only the
job's launchers can push or fetch. Pushing never blocks the launcher's loop; finished
transfers become events. A fetched slot is an ordinary committed slot of the rank's own
directory, so the choice and the checks at a cycle start treat it like a local copy.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ft_agent import snapshot as store
from ft_agent.snapshot_retention import Plan
from ft_launcher.snapshots.buddy import buddies
from ft_launcher.snapshots.replica import (
    ReplicaSender,
    ReplicaServer,
    TransferResult,
    fetch,
)
from ft_launcher.snapshots.replica_disk import rank_dir_name

log = logging.getLogger("ft_launcher")

TOKEN_KEY = "ft/replica/token"
TICK_S = 0.2  # how often the launcher's loop looks for a new local commit to push


def shared_token(job_store: Any) -> str:
    """The job's replica token: the first launcher's random one (compare-and-set)."""
    value = job_store.compare_set(TOKEN_KEY, "", secrets.token_hex(16))
    return value.decode() if isinstance(value, bytes) else str(value)


def bind_address(local_addr: str) -> str:
    """An address ZeroMQ can bind: ``local_addr`` itself when it is numeric, else what
    it resolves to."""
    try:
        return socket.gethostbyname(local_addr)
    except OSError:
        return local_addr


def buddy_nodes(node: int, nodes: int, k: int) -> tuple[int, ...]:
    """The group ranks that hold ``node``'s replicas this round (ring by group rank)."""
    return buddies(list(range(nodes)), k).get(node, ()) if nodes else ()


class Replication:
    """This node's replica server and senders; ``close`` before the area is removed."""

    def __init__(self, root: Path, k: int, token: str, local_addr: str,
                 events: Callable[..., Any], clock: Callable[[], float]) -> None:
        self.root, self.k, self.token, self.events, self.clock = root, k, token, events, clock
        self.server = ReplicaServer(root, f"tcp://{bind_address(local_addr)}:0", token).start()
        self.senders = [ReplicaSender(token) for _ in range(k)]
        # this cycle's buddy nodes and their endpoints (None: it serves none), nearest first
        self.targets: dict[int, str | None] = {}
        self.ranks: dict[int, Path] = {}  # this cycle's local ranks and their directories
        self.pushed: dict[int, int] = {}  # rank -> newest iteration submitted
        self.failed: set[str] = set()  # endpoints whose last push failed
        self.next_tick = 0.0

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def hosted(self) -> dict[int, tuple[int, ...]]:
        """The iterations this node's server holds, per rank (cheap checks)."""
        out: dict[int, tuple[int, ...]] = {}
        for entry in os.scandir(self.root) if self.root.is_dir() else ():
            name = entry.name
            if name.startswith("rank_") and name[5:].isdigit():
                try:
                    its = store.available_iterations(entry.path)
                except store.SnapshotError:
                    continue
                if its:
                    out[int(name[5:])] = tuple(its)
        return out

    def adopt(self, rank: int, rank_dir: Path) -> None:
        """A rank that is no longer this node's: its directory becomes a replica this
        server hosts (kept only when newer than the one already hosted)."""
        dest = self.root / rank_dir_name(rank)
        try:
            mine = max(store.available_iterations(rank_dir), default=-1)
            theirs = max(store.available_iterations(dest), default=-1)
            if mine > theirs:
                shutil.rmtree(dest, ignore_errors=True)
                self.root.mkdir(mode=0o700, exist_ok=True)
                os.rename(rank_dir, dest)
                return
        except (store.SnapshotError, OSError) as e:
            log.warning("rank %d: cannot keep its snapshots as a replica: %s", rank, e)
        shutil.rmtree(rank_dir, ignore_errors=True)

    def discard_after(self, iteration: int | None) -> list[list[int | str]]:
        """Uncommit the hosted copies newer than the world's choice (all of them when none
        was chosen): a future the world rolled back from must never be restored later.
        Returns [rank, slot, iteration] of each."""
        out: list[list[int | str]] = []
        for rank in self.hosted():
            rank_dir = self.root / rank_dir_name(rank)
            try:
                good, _ = store.committed_slots(rank_dir)
                for s in good:
                    if iteration is None or s.iteration > iteration:
                        store.uncommit(rank_dir, s.slot)
                        out.append([rank, s.slot, s.iteration])
            except (store.SnapshotError, OSError) as e:
                log.warning("rank %d: cannot discard a hosted replica: %s", rank, e)
        return out

    def begin_cycle(self, ranks: dict[int, Path], targets: dict[int, str | None]) -> None:
        """This cycle's local ranks, and its buddy nodes' endpoints (nearest first)."""
        self.ranks, self.targets, self.pushed, self.failed = ranks, targets, {}, set()

    def follow(self, plan: Plan) -> None:
        """The world's plan, for the copies this node hosts."""
        self.server.plan = plan

    def failing(self) -> tuple[int, ...]:
        """The buddy nodes this node's last push to failed (their copies do not count in
        the world's plan until a push succeeds again)."""
        return tuple(n for n, ep in self.targets.items() if ep is None or ep in self.failed)

    def tick(self) -> None:
        """Push each local rank's newest commit when it is new; report finished pushes."""
        now = self.clock()
        if now < self.next_tick:
            return
        self.next_tick = now + TICK_S
        for rank, rank_dir in self.ranks.items():
            try:
                newest = max(store.available_iterations(rank_dir), default=None)
            except store.SnapshotError:
                continue
            if newest is None or newest <= self.pushed.get(rank, -1):
                continue
            self.pushed[rank] = newest
            endpoints = [ep for ep in self.targets.values() if ep is not None]
            for sender, endpoint in zip(self.senders, endpoints, strict=False):
                sender.submit(rank_dir, rank, endpoint)
        for sender in self.senders:
            for result in sender.results():
                self.report(result)

    def report(self, r: TransferResult) -> None:
        if r.op == "push":
            # A buddy whose slots all keep copies the plan keeps refuses as busy: it is
            # following the plan, not failing.
            if r.ok or (r.reason or "").startswith("refused: busy"):
                self.failed.discard(r.endpoint)
            else:
                self.failed.add(r.endpoint)
        if not r.ok:
            self.events("snapshot_replica_failed", rank=r.rank, op=r.op, endpoint=r.endpoint,
                        iteration=r.iteration, reason=r.reason)
        elif r.op == "push":
            self.events("snapshot_replicated", rank=r.rank, iteration=r.iteration,
                        endpoint=r.endpoint, bytes=r.bytes, seconds=round(r.seconds, 4),
                        skipped=r.skipped)
        else:
            self.events("snapshot_replica_fetched", rank=r.rank, iteration=r.iteration,
                        endpoint=r.endpoint, bytes=r.bytes, seconds=round(r.seconds, 4))

    def fetch(self, rank: int, dest: Path, iteration: int, endpoints: list[str]) -> str | None:
        """Fetch ``rank``'s ``iteration`` from the first of ``endpoints`` that has it;
        None on success, else the last failure's reason."""
        reason = "no node holds it"
        for endpoint in endpoints:
            result = fetch(endpoint, rank, dest, self.token, iteration)
            self.report(result)
            if result.ok and result.iteration == iteration:
                return None
            reason = result.reason or f"got iteration {result.iteration}"
        return reason

    def close(self) -> None:
        for sender in self.senders:
            sender.close(timeout=5.0)
        self.server.close()
