"""The one seam between a cycle and the services it only calls.

A ``Cycle`` owns what dies with it (its workers, rank slots, armed fault, watch loop). What
it merely calls (snapshots, stragglers, the warm standby pool, the status line, NCCL
traces) is a ``CycleService``: a class that overrides the hooks it needs, each a no-op
here. The job's services are one ``Services`` list (``job.for_job`` builds it), which is a
``CycleService`` itself; the cycle calls the list at each hook and imports no service, so
a new capability is a class here and a line in ``job.for_job``, never an import in
``cycle.py``.

The hooks, in the order a cycle calls them:

==================  ======================================================================
``begin``           the cycle's round is known; nothing is started yet
``worker_env``      variables to add to one rank's environment (given the one so far)
``feeds``           what to read from the ranks' messages this cycle (``RankFeeds``)
``take_worker``     a ready process for a rank (warm restart); None: it is spawned cold
``started``         the cycle's workers are up
``due``             the monotonic time ``tick`` must run by (None: no timed step)
``polls``           whether something must be polled every ``--monitor-interval``
``check``           after the cycle's own checks, each pass: a result ends the cycle
``tick``            each pass that goes on (after the checks)
``worker_exited``   a worker's exit is on record
``ended``           the cycle is over: its workers are gone, its result final
``close``           the job is over (every exit path of the launcher)
==================  ======================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ft_launcher.nodes.rendezvous import RoundInfo
    from ft_launcher.policy import CycleResult
    from ft_launcher.process.output import Sink
    from ft_launcher.process.workers import Worker, WorkerSpec

# (rank, section, seconds): a closed section's wall or device time.
SectionTime = Callable[[int, str, float], Any]
# (rank, message): a rank's report of a given ``what`` (``RankMonitorClient.report``).
ReportHandler = Callable[[int, str], Any]


@dataclass(frozen=True)
class CycleStart:
    """What a service learns as a cycle begins: its number, its round, this node's ranks."""

    cycle: int
    round: RoundInfo
    ranks: tuple[int, ...]


@dataclass
class RankFeeds:
    """What a service reads from the ranks' messages, as the monitor decodes them."""

    section_closed: SectionTime | None = None  # every closed section (wall seconds)
    device_time: SectionTime | None = None  # a closed section's device time
    reports: dict[str, ReportHandler] = field(default_factory=dict)  # what -> handler


class CycleService:
    """A service a cycle calls at each hook; override only the hooks it needs."""

    def begin(self, start: CycleStart) -> None:
        """A cycle begins: its round is known, no worker is planned or started yet."""

    def worker_env(self, rank: int, env: Mapping[str, str]) -> dict[str, str]:
        """Variables to add to ``rank``'s environment, ``env`` being what it has so far."""
        return {}

    def feeds(self) -> RankFeeds:
        """What this service reads from the ranks' messages this cycle."""
        return RankFeeds()

    def take_worker(self, spec: WorkerSpec,
                    sink: Callable[[WorkerSpec], Sink]) -> Worker | None:
        """A ready process to run ``spec`` (its output to ``sink(spec)``), or None."""
        return None

    def started(self, workers: Sequence[Worker]) -> None:
        """The cycle's workers are up."""

    def due(self, now: float, wall: float) -> float | None:
        """The monotonic time by which ``tick`` must run next; None: no timed step.
        ``now`` and ``wall`` are the monotonic and the wall clock read together."""
        return None

    def polls(self) -> bool:
        """Whether the cycle must wake every ``--monitor-interval`` for this service."""
        return False

    def check(self) -> CycleResult | None:
        """A reason to end the cycle now, judged after the cycle's own checks; or None."""
        return None

    def tick(self, now: float, training: bool) -> None:
        """One pass of the watch loop that goes on; ``training``: every rank trains."""

    def worker_exited(self, worker: Worker) -> None:
        """``worker``'s exit is on record (``worker_exited``)."""

    def ended(self, result: CycleResult) -> None:
        """The cycle is over (its workers are gone) and ended with ``result``."""

    def close(self) -> None:
        """The job is over."""


class Services(CycleService):
    """The job's services as one: each hook calls every service in list order (``close``
    in reverse)."""

    def __init__(self, services: Sequence[CycleService] = ()) -> None:
        self.services = list(services)

    def begin(self, start: CycleStart) -> None:
        for s in self.services:
            s.begin(start)

    def worker_env(self, rank: int, env: Mapping[str, str]) -> dict[str, str]:
        added: dict[str, str] = {}
        for s in self.services:
            added.update(s.worker_env(rank, {**env, **added}))
        return added

    def feeds(self) -> RankFeeds:
        all_feeds = [s.feeds() for s in self.services]
        reports: dict[str, ReportHandler] = {}
        for f in all_feeds:
            reports.update(f.reports)
        return RankFeeds(_fan_out([f.section_closed for f in all_feeds]),
                         _fan_out([f.device_time for f in all_feeds]), reports)

    def take_worker(self, spec: WorkerSpec,
                    sink: Callable[[WorkerSpec], Sink]) -> Worker | None:
        for s in self.services:
            worker = s.take_worker(spec, sink)
            if worker is not None:
                return worker
        return None

    def started(self, workers: Sequence[Worker]) -> None:
        for s in self.services:
            s.started(workers)

    def due(self, now: float, wall: float) -> float | None:
        times = [t for t in (s.due(now, wall) for s in self.services) if t is not None]
        return min(times) if times else None

    def polls(self) -> bool:
        return any(s.polls() for s in self.services)

    def check(self) -> CycleResult | None:
        for s in self.services:
            result = s.check()
            if result is not None:
                return result
        return None

    def tick(self, now: float, training: bool) -> None:
        for s in self.services:
            s.tick(now, training)

    def worker_exited(self, worker: Worker) -> None:
        for s in self.services:
            s.worker_exited(worker)

    def ended(self, result: CycleResult) -> None:
        for s in self.services:
            s.ended(result)

    def close(self) -> None:
        for s in reversed(self.services):  # the last begun closes first
            s.close()


def _fan_out(hooks: list[SectionTime | None]) -> SectionTime | None:
    """One callback that calls each of ``hooks`` (None when there is none)."""
    present = [h for h in hooks if h is not None]
    if len(present) < 2:
        return present[0] if present else None

    def each(rank: int, section: str, seconds: float) -> None:
        for hook in present:
            hook(rank, section, seconds)
    return each
