"""The job's snapshots on this node: the area, the choice at each cycle start, the events.

At a cycle start (``begin_cycle``) the launcher reads each rank's commit records (cheap),
checks in full (every tensor's CRC32, in threads: zlib releases the GIL) only the copies of
the candidate iteration, picks the newest iteration every rank holds a whole copy of
(``pick.choose``), uncommits every newer or rejected copy, and gives each rank
``FT_SNAPSHOT_ITERATION``. The rank loads that iteration and checks it again (its own NaN
check included) before it returns it from ``restore()``.
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
from ft_launcher.snapshots import reports
from ft_launcher.snapshots.area import SHM, Area, AreaRefused, area_name, default_root
from ft_launcher.snapshots.pick import Choice, Copy, choose, to_discard

log = logging.getLogger("ft_launcher")

ENV_DIR = "FT_SNAPSHOT_DIR"
ENV_EVERY = "FT_SNAPSHOT_EVERY"
ENV_MEMORY = "FT_SNAPSHOT_MEMORY"
ENV_ITERATION = "FT_SNAPSHOT_ITERATION"
NO_ITERATION = "none"


@dataclass(frozen=True)
class SnapshotOptions:
    """``--ft-snapshot-every`` (None: off), ``--ft-snapshot-memory`` (bytes per node; None:
    half the free space of the area's file system at start), ``--ft-snapshot-replicas``."""

    every: str | None = None
    memory: int | None = None
    replicas: int = 0


def for_job(cfg: Any, rundir: Any, events: Callable[..., Any]) -> JobSnapshots | None:
    """The job's snapshots from its ``LaunchConfig`` and ``RunDir``; None when off."""
    ft = cfg.ft
    if getattr(ft, "snapshot_every", None) is None:
        return None
    options = SnapshotOptions(ft.snapshot_every, ft.snapshot_memory, ft.snapshot_replicas)
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

    @property
    def enabled(self) -> bool:
        return self.options.every is not None

    # -- the job's life ----------------------------------------------------------------

    def _prepare(self) -> bool:
        if self.state == "new":
            try:
                self.area.make()
                memory = self.options.memory or free_half(self.area.path)
            except (AreaRefused, OSError) as e:
                self.state = "off"
                log.warning("snapshots off: %s", e)
                self.events("snapshots_off", reason=str(e), path=str(self.area.path))
                return False
            self.state = "ready"
            self.rank_memory = memory // max(1, self.nproc)
            if self.options.replicas:
                log.warning("--ft-snapshot-replicas %d: copies on other nodes are not made by "
                            "this version; snapshots stay on this node", self.options.replicas)
            self.events("snapshots_ready", path=str(self.area.path), every=self.options.every,
                        memory=memory, rank_memory=self.rank_memory,
                        replicas=self.options.replicas, stale_removed=self.area.stale_removed)
        return self.state == "ready"

    def close(self) -> None:
        """Remove the area (every exit path of the launcher calls this)."""
        if self.state == "ready":
            self.area.remove()
        self.state = "closed"

    # -- a cycle -----------------------------------------------------------------------

    def begin_cycle(self, ranks: list[int], group_world_size: int) -> dict[int, dict[str, str]]:
        """Each of this node's ranks' snapshot environment for the cycle starting now."""
        if not self.enabled or not self._prepare():
            return {}
        started = time.perf_counter()
        copies = {r: self._copies(r) for r in ranks}
        if group_world_size > 1:
            # The other nodes' copies are not known here: restoring needs their agreement.
            choice = Choice(None, "several nodes: no agreement on an iteration yet")
        else:
            choice = choose(copies, self._verify)
        discarded = self._discard(to_discard(copies, choice))
        for rank, copy, reason in choice.rejected:
            self.events("snapshot_rejected", rank=rank, iteration=copy.iteration,
                        slot=copy.slot, reason=reason, by="launcher")
        self.events("snapshot_picked", iteration=choice.iteration, reason=choice.reason,
                    ranks={str(r): sorted({c.iteration for c in cs}) for r, cs in copies.items()},
                    verified_bytes=sum(c.bytes for _, c in choice.verified),
                    seconds=round(time.perf_counter() - started, 4), discarded=discarded)
        value = NO_ITERATION if choice.iteration is None else str(choice.iteration)
        return {r: {ENV_DIR: str(self.area.rank_dir(r)), ENV_EVERY: str(self.options.every),
                    ENV_MEMORY: str(self.rank_memory), ENV_ITERATION: value} for r in ranks}

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
        """Record a rank's snapshot report as its event (a malformed one as rank_report)."""
        decoded = reports.decode(message)
        if decoded is None:
            self.events("rank_report", rank=rank, what=reports.WHAT, message=message[:8000])
            return
        name, fields = decoded
        if name == "snapshot_rejected":  # literal names: tests/test_docs.py finds each one
            self.events("snapshot_rejected", rank=rank, by="rank", **fields)
        elif name == "snapshot_restored":
            self.events("snapshot_restored", rank=rank, **fields)
        else:
            self.events("snapshot_skipped", rank=rank, **fields)
