"""Snapshots as a cycle service: each rank's snapshot environment, the ranks' snapshot
reports, and the push of new local commits to the buddies (``snapshots.service``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ft_launcher.nodes.rendezvous import RoundInfo
from ft_launcher.services.seam import CycleService, CycleStart, RankFeeds
from ft_launcher.snapshots import reports
from ft_launcher.snapshots.service import JobSnapshots, WorldRound

if TYPE_CHECKING:
    from ft_launcher.ports import RendezvousPort


class SnapshotService(CycleService):
    """The job's ``JobSnapshots`` (on: ``--ft-snapshot-every``) at the cycle's hooks."""

    def __init__(self, snapshots: JobSnapshots, rdzv: RendezvousPort) -> None:
        self.snapshots, self.rdzv = snapshots, rdzv
        self.env: dict[int, dict[str, str]] = {}

    def begin(self, start: CycleStart) -> None:
        """Which iteration each rank restores, agreed with the other nodes (this may take
        a while: copies are verified, and several nodes exchange what they hold)."""
        rnd = start.round
        self.env = self.snapshots.begin_cycle(list(start.ranks), rnd.group_world_size,
                                              snapshot_world(self.rdzv, rnd))

    def worker_env(self, rank: int, env: Mapping[str, str]) -> dict[str, str]:
        return self.env.get(rank, {})

    def feeds(self) -> RankFeeds:
        return RankFeeds(reports={reports.WHAT: self.snapshots.on_report})

    def due(self, now: float, wall: float) -> float | None:
        return self.snapshots.due(now)  # soon while ranks commit: their reports move the plan

    def tick(self, now: float, training: bool) -> None:
        self.snapshots.tick()  # the plan; new local commits go to the buddies (never blocks)

    def close(self) -> None:
        self.snapshots.close()  # the job's snapshots go with it


def snapshot_world(rdzv: RendezvousPort, rnd: RoundInfo) -> WorldRound | None:
    """How this node's snapshots agree with the other nodes' this round: through the
    round's rendezvous store; None with one node or static addresses (no shared store)."""
    store = rdzv.round_store
    if rnd.group_world_size < 2 or store is None:
        return None
    return WorldRound(store, rdzv.job_store, rnd.round, rnd.group_rank, rnd.group_world_size,
                      rdzv.local_addr)
