"""The job's snapshots on this node: the area, the choice at each cycle start, the plan
during a cycle, the events.

At a cycle start (``begin_cycle``) the launcher reads each rank's commit records (cheap),
checks in full (every tensor's CRC32, in threads: the CRC releases the GIL) only the copies of
the candidate iteration, picks the newest iteration every rank holds a whole copy of
(``pick.choose``), uncommits every newer or rejected copy, and gives each rank
``FT_SNAPSHOT_ITERATION``. The rank loads that iteration and checks it again (its own NaN
check included) before it returns it from ``restore()``. During the cycle the
``Coordinator`` keeps the plan every holder follows (which copies to keep, and with the
default frequency which iterations to snapshot) from the ranks' reports (``on_report``)
and, with several nodes, the other launchers' summaries (``tick``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_agent import snapshot as store
from ft_launcher.process.worker_env import EnvDoc
from ft_launcher.snapshots import reports
from ft_launcher.snapshots.area import SHM, Area, AreaRefused, area_name, default_root
from ft_launcher.snapshots.coordinator import Coordinator, PlanExchange, World
from ft_launcher.snapshots.pick import Choice, Copy, choose, to_discard
from ft_launcher.snapshots.replication import Replication, buddy_nodes, shared_token
from ft_launcher.snapshots.world import (
    EXCHANGE_TIMEOUT_S,
    OK,
    Holdings,
    StoreExchange,
    agree,
    decode,
    encode,
    holders,
    verdicts_reason,
)

log = logging.getLogger("ft_launcher")

ENV_DIR = "FT_SNAPSHOT_DIR"
ENV_EVERY = "FT_SNAPSHOT_EVERY"
ENV_MEMORY = "FT_SNAPSHOT_MEMORY"
ENV_ITERATION = "FT_SNAPSHOT_ITERATION"
ENV_PLAN = "FT_SNAPSHOT_PLAN"
NO_ITERATION = "none"
AUTO = "auto"
DEFAULT_OVERHEAD = 0.02

# begin_cycle's variables, as docs/reference/environment.md lists them.
SNAPSHOT_ENV = (
    EnvDoc((ENV_DIR, ENV_EVERY, ENV_MEMORY, ENV_ITERATION, ENV_PLAN),
           f"unless `--ft-snapshot-every off` (the default is `{AUTO}`): the rank's snapshot "
           f"directory, the frequency (`{AUTO}`: the one the ranks agree on; `5` steps or "
           "`30s`), its share of `--ft-snapshot-memory` in bytes, the iteration it restores "
           f"in this cycle (`{NO_ITERATION}` when there is none), and the node's plan file "
           f"(which copies to keep and, with `{AUTO}`, which iterations to snapshot) "
           "([snapshots](../snapshots.md))"),
)


@dataclass(frozen=True)
class SnapshotOptions:
    """``--ft-snapshot-every`` (``auto``: the frequency the ranks agree on under the
    ``overhead`` budget, a share of the step time; N or Ns; None: off),
    ``--ft-snapshot-memory`` (bytes per node; None: half the free space of the area's file
    system at start), ``--ft-snapshot-replicas``, ``--ft-snapshot-overhead``."""

    every: str | None = AUTO
    memory: int | None = None
    replicas: int = 0
    overhead: float = DEFAULT_OVERHEAD


@dataclass(frozen=True)
class WorldRound:
    """The round this node joined, as the snapshots need it with several nodes: the
    round's store (prefixed per round), the job's store (for the replica token), this
    node's group rank, the number of nodes, and the address peers reach this node by."""

    store: Any
    job_store: Any
    round_no: int
    node: int
    nodes: int
    local_addr: str


def for_job(cfg: Any, rundir: Any, events: Callable[..., Any]) -> JobSnapshots | None:
    """The job's snapshots from its ``LaunchConfig`` and ``RunDir``; None when off."""
    ft = cfg.ft
    if ft.snapshot_every is None:
        return None
    options = SnapshotOptions(ft.snapshot_every, ft.snapshot_memory, ft.snapshot_replicas,
                              ft.snapshot_overhead)
    return JobSnapshots(options, cfg.run_id, rundir.path, rundir.private, events,
                        cfg.nproc_per_node)


def free_half(path: Path) -> int:
    """Half the space free to this user on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // 2


class JobSnapshots:
    """Snapshots for one job on this node; inert when ``options.every`` is None."""

    def __init__(self, options: SnapshotOptions, run_id: str, run_dir: Path,
                 private_dir: Path, events: Callable[..., Any], nproc_per_node: int, *,
                 shm: Path = SHM) -> None:
        self.options = options
        self.events = events
        self.nproc = nproc_per_node
        root = default_root(private_dir, shm)
        self.area = Area(root / area_name(os.geteuid(), run_id, str(run_dir)))
        self.state = "new"  # new -> ready | off -> closed
        self.rank_memory = 0
        self.replication: Replication | None = None  # started at the first multi-node round
        self.exchange_timeout_s = EXCHANGE_TIMEOUT_S
        self.fetched: dict[int, int] = {}  # this cycle's ranks restored from a replica
        # The world's shape counts the replicas every node was asked for, even where this
        # node's server could not start (then its pushes count as failing).
        self.replicas_asked = options.replicas
        self.coordinator = Coordinator(self.area.path, auto=options.every == AUTO,
                                       budget=options.overhead, events=events)

    @property
    def enabled(self) -> bool:
        return self.options.every is not None

    # -- the job's life ----------------------------------------------------------------

    def _prepare(self) -> bool:
        if self.state == "new":
            try:
                self.area.clear()
                memory = self.options.memory or free_half(self.area.path.parent)
            except (AreaRefused, OSError) as e:
                self.state = "off"
                log.warning("snapshots off: %s", e)
                self.events("snapshots_off", reason=str(e), path=str(self.area.path))
                return False
            self.state = "ready"
            self.rank_memory = memory // max(1, self.nproc)
            self.events("snapshots_ready", path=str(self.area.path), every=self.options.every,
                        overhead=self.options.overhead, memory=memory,
                        rank_memory=self.rank_memory, replicas=self.options.replicas,
                        stale_removed=self.area.stale_removed)
        return self.state == "ready"

    def close(self) -> None:
        """Remove the area (every exit path of the launcher calls this)."""
        if self.replication is not None:
            self.replication.close()  # before the area its server writes into goes
            self.replication = None
        if self.state == "ready":
            self.area.remove_if_ours()
        elif self.state == "new" and self.enabled:
            # Never made: a spare that was not needed. The area of a launcher of this run
            # directory that was SIGKILLed before it is still there, and nobody else would
            # remove it (the run directory's lock says no other launcher uses it).
            self.area.remove_stale()
        self.state = "closed"

    # -- a cycle -----------------------------------------------------------------------

    def begin_cycle(self, ranks: list[int], group_world_size: int,
                    world: WorldRound | None = None) -> dict[int, dict[str, str]]:
        """Each of this node's ranks' snapshot environment for the cycle starting now;
        with several nodes, ``world`` is how the launchers agree (None: they cannot)."""
        if not self.enabled or not self._prepare():
            return {}
        started = time.perf_counter()
        self.fetched = {}
        if group_world_size > 1 and world is not None:
            copies, choice = self._world_choice(ranks, world)
        else:
            copies = {r: self._copies(r) for r in ranks}
            choice = choose(copies, self._verify) if group_world_size == 1 else Choice(
                None, "several nodes without a shared rendezvous store: no agreement")
        dropped = to_discard(copies, choice)
        discarded = self._discard(dropped)
        if self.replication is not None:
            discarded += self.replication.discard_after(choice.iteration)
        self._begin_plan(ranks, group_world_size, world, copies, dropped, choice.iteration)
        for rank, copy, reason in choice.rejected:
            self.events("snapshot_rejected", rank=rank, iteration=copy.iteration,
                        slot=copy.slot, reason=reason, by="launcher")
        self.events("snapshot_picked", iteration=choice.iteration, reason=choice.reason,
                    ranks={str(r): sorted({c.iteration for c in cs}) for r, cs in copies.items()},
                    verified_bytes=sum(c.bytes for _, c in choice.verified),
                    seconds=round(time.perf_counter() - started, 4), discarded=discarded)
        value = NO_ITERATION if choice.iteration is None else str(choice.iteration)
        return {r: {ENV_DIR: str(self.area.rank_dir(r)), ENV_EVERY: str(self.options.every),
                    ENV_MEMORY: str(self.rank_memory), ENV_ITERATION: value,
                    ENV_PLAN: self.coordinator.env} for r in ranks}

    def tick(self) -> None:
        """From the launcher's loop: with several nodes, this node's part of the plan
        (a store exchange every few hundred milliseconds); new local commits to the
        buddies (never blocks)."""
        if self.state != "ready":
            return
        self.coordinator.tick()
        if self.replication is not None:
            self.replication.tick()

    def due(self, now: float) -> float | None:
        """The monotonic time by which the launcher's loop must read the ranks' reports
        and call ``tick`` again (None: no hurry); ``now`` is the loop's monotonic clock."""
        return self.coordinator.due(now) if self.state == "ready" else None

    def _begin_plan(self, ranks: list[int], group_world_size: int, world: WorldRound | None,
                    copies: dict[int, list[Copy]], dropped: list[tuple[int, Copy]],
                    choice: int | None) -> None:
        """The plan of the cycle starting: every holder keeps the iteration the world
        restores (its first pin) and, before any, every copy."""
        gone = {(r, c.slot) for r, c in dropped}
        held = {r: [c.iteration for c in copies.get(r, []) if (r, c.slot) not in gone]
                for r in ranks}
        n = self.nproc
        exchange = None
        if group_world_size > 1 and world is not None:
            shape = World(tuple(range(world.nodes * n)), n, world.nodes, self.replicas_asked)
            exchange = PlanExchange(world.store, world.round_no, world.node, world.nodes)
            node = world.node
        else:
            shape, node = World(tuple(ranks), n), 0
        rep = self.replication
        mine = buddy_nodes(node, shape.nodes, shape.replicas)  # none it can push to
        self.coordinator.hosted = rep.hosted if rep is not None else dict
        self.coordinator.failing = rep.failing if rep is not None else lambda: mine
        self.coordinator.on_plan = rep.follow if rep is not None else None
        self.coordinator.begin_cycle(held, choice, shape, node, exchange)

    # -- several nodes -----------------------------------------------------------------

    def _replicas(self, w: WorldRound) -> Replication | None:
        if self.replication is None and self.options.replicas > 0 and w.job_store is not None:
            try:
                token = shared_token(w.job_store)
                self.replication = Replication(self.area.path / "replicas",
                                               self.options.replicas, token, w.local_addr,
                                               self.events, time.monotonic)
            except Exception as e:  # noqa: BLE001 - no replicas, never a failed launch
                log.warning("snapshot replicas off: %s", e)
                self.events("snapshot_replica_failed", rank=None, op="serve", endpoint=None,
                            iteration=None, reason=f"error: {type(e).__name__} {e}")
                self.options = SnapshotOptions(self.options.every, self.options.memory, 0)
        return self.replication

    def _holdings(self, ranks: list[int], w: WorldRound, rep: Replication | None
                  ) -> tuple[dict[int, list[Copy]], Holdings]:
        if rep is not None and self.area.path.is_dir():  # ranks that moved away: what
            for entry in os.scandir(self.area.path):  # they left becomes a replica here
                name = entry.name
                if name.startswith("rank_") and name[5:].isdigit() \
                        and int(name[5:]) not in ranks:
                    rep.adopt(int(name[5:]), Path(entry.path))
        copies = {r: self._copies(r) for r in ranks}
        held = {r: set(its) for r, its in (rep.hosted() if rep else {}).items()}
        for r, cs in copies.items():
            held.setdefault(r, set()).update(c.iteration for c in cs)
        return copies, Holdings(w.node, rep.endpoint if rep else None,
                                {r: tuple(sorted(its)) for r, its in held.items() if its})

    def _world_choice(self, ranks: list[int], w: WorldRound
                      ) -> tuple[dict[int, list[Copy]], Choice]:
        """Agree with the other launchers (``world``), fetch, check, agree again."""
        rep = self._replicas(w)
        copies, mine = self._holdings(ranks, w, rep)
        ex = StoreExchange(w.store, w.round_no, w.node, w.nodes, self.exchange_timeout_s)
        ex.publish("holds", encode(mine))
        raw, missing = ex.gather("holds")
        published = {n: h for n, t in raw.items() if (h := decode(t)) is not None and h.node == n}
        missing += [n for n in raw if n not in published]
        if rep is not None:
            rep.begin_cycle({r: self.area.rank_dir(r) for r in ranks},
                            {b: published[b].endpoint if b in published else None
                             for b in buddy_nodes(w.node, w.nodes, self.options.replicas)})
        if missing:
            self.events("snapshot_world_timeout", round=w.round_no, phase="holds",
                        missing=sorted(missing), waited_s=ex.timeout_s)
            why = f"node(s) {sorted(missing)} published no snapshot holdings in time"
            ex.publish("verdict", why)
            return copies, Choice(None, why)
        agreement = agree(range(w.nodes * self.nproc), published)
        choice, verdict = Choice(None, agreement.reason), agreement.reason
        if agreement.iteration is not None:
            choice, verdict = self._restore_here(ranks, copies, agreement.iteration,
                                                 published, w.node)
        ex.publish("verdict", verdict)
        ex.timeout_s = 4 * self.exchange_timeout_s  # the others may be fetching
        raw, missing = ex.gather("verdict")
        said = {n: t.decode(errors="replace")[:300] for n, t in raw.items()}
        said.update({n: "said nothing in time" for n in missing})
        why = verdicts_reason(said)
        if why is not None:
            if missing:
                self.events("snapshot_world_timeout", round=w.round_no, phase="verdict",
                            missing=sorted(missing), waited_s=ex.timeout_s)
            return copies, Choice(None, f"not every node can restore: {why}", choice.rejected)
        return copies, choice

    def _restore_here(self, ranks: list[int], copies: dict[int, list[Copy]], iteration: int,
                      published: dict[int, Holdings], me: int) -> tuple[Choice, str]:
        """Fetch the chosen iteration for the ranks that lack it, then check each local
        rank's copy of it in full; the choice and this node's verdict."""
        for r in ranks:
            if any(c.iteration == iteration for c in copies[r]):
                continue
            if self.replication is None:
                return Choice(None, f"rank {r} has no copy here and replicas are off"), \
                    f"rank {r}: no copy here (replicas off)"
            failed = self.replication.fetch(r, self.area.rank_dir(r), iteration,
                                            holders(r, iteration, published, me))
            if failed is not None:
                return Choice(None, f"rank {r}: fetch failed: {failed}"), \
                    f"rank {r}: fetch failed: {failed}"
            self.fetched[r] = iteration
            copies[r] = self._copies(r)
        at = {r: [c for c in cs if c.iteration == iteration] for r, cs in copies.items()}
        choice = choose(at, self._verify)
        if choice.iteration == iteration:
            choice.reason = "newest iteration every rank holds on some node"
            return choice, OK
        return choice, f"iteration {iteration}: {choice.reason}"

    def _copies(self, rank: int) -> list[Copy]:
        try:
            good, bad = store.committed_slots(self.area.rank_dir(rank))
        except store.SnapshotError as e:
            self.events("snapshot_rejected", rank=rank, iteration=None, slot=None,
                        reason=str(e), by="launcher")
            return []
        for slot, reason in bad:
            self.events("snapshot_rejected", rank=rank, iteration=None, slot=slot,
                        reason=reason, by="launcher")
            self._uncommit(rank, slot)
        return [Copy(s.slot, s.iteration, s.seq, s.bytes) for s in good]

    def _verify(self, wanted: list[tuple[int, Copy]]) -> dict[tuple[int, str], str | None]:
        def one(item: tuple[int, Copy]) -> str | None:
            return store.verify_slot(self.area.rank_dir(item[0]), item[1].slot)

        with ThreadPoolExecutor(max_workers=max(1, min(len(wanted), os.cpu_count() or 1)),
                                thread_name_prefix="ft-snapshot-verify") as pool:
            results = list(pool.map(one, wanted))
        return {(r, c.slot): res for (r, c), res in zip(wanted, results, strict=True)}

    def _discard(self, copies: list[tuple[int, Copy]]) -> list[list[Any]]:
        for rank, copy in copies:
            self._uncommit(rank, copy.slot)
        return [[rank, copy.slot, copy.iteration] for rank, copy in copies]

    def _uncommit(self, rank: int, slot: str) -> None:
        try:
            store.uncommit(self.area.rank_dir(rank), slot)
        except (store.SnapshotError, OSError) as e:
            log.warning("rank %d: cannot discard snapshot slot %s: %s", rank, slot, e)

    # -- the ranks' reports ------------------------------------------------------------

    def on_report(self, rank: int, message: str) -> None:
        """A rank's snapshot report: what it holds and what a snapshot costs it go to the
        plan; the others become their events (a malformed one becomes rank_report)."""
        decoded = reports.decode(message)
        if decoded is None:
            self.events("rank_report", rank=rank, what=reports.WHAT, message=message[:8000])
            return
        name, fields = decoded
        if name == reports.HELD:
            self.coordinator.on_held(rank, fields["held"], fields["at"])
        elif name == reports.MEASURE:
            self.coordinator.on_measure(rank, fields)
        elif name == "snapshot_rejected":  # literal names: tests/test_docs.py finds each one
            self.events("snapshot_rejected", rank=rank, by="rank", **fields)
        elif name == "snapshot_restored":
            if self.fetched.get(rank) == fields.get("iteration"):
                fields["source"] = "replica"  # the rank read it locally; it came from a peer
            self.events("snapshot_restored", rank=rank, **fields)
        else:
            self.events("snapshot_skipped", rank=rank, **fields)
