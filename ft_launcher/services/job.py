"""The job's services, in the order the cycle calls them: the one place that knows them all.

Order matters where two services touch the same moment: snapshots ``begin`` before the warm
pool takes its store (a snapshot choice can take a while, and a store taken later has had
that much longer to come up), and the status line ``tick`` first in a pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ft_launcher.services.nccl import NcclTraces
from ft_launcher.services.seam import CycleService, Services
from ft_launcher.services.snapshots import SnapshotService
from ft_launcher.services.status import StatusLine
from ft_launcher.services.stragglers import StragglerService
from ft_launcher.services.warm import WarmService
from ft_launcher.services.workers_file import WorkersFile
from ft_launcher.snapshots import service as snapshots
from ft_launcher.warm.standby_pool import StandbyPool

if TYPE_CHECKING:
    from ft_launcher.config import LaunchConfig
    from ft_launcher.journal import Journal
    from ft_launcher.ports import MonitorPort, StandbyPort
    from ft_launcher.rundir import RunDir


def standby_pool(cfg: LaunchConfig, rundir: RunDir, events: Callable[..., Any],
                 wake: Callable[[], None]) -> StandbyPool:
    """The job's warm-restart pool (``--ft-warm-restart``; inert when off). Its zygote starts
    here: after the launcher's signal handlers are installed (see ``Supervisor``)."""
    return StandbyPool(cfg, rundir.logs / "standby", events, wake=wake)


def for_job(cfg: LaunchConfig, rundir: RunDir, events: Callable[..., Any], *,
            journal: Journal, monitor: MonitorPort, rdzv: Any, standbys: StandbyPort,
            host: str) -> Services:
    """Every service this job's cycles call (snapshots only when they are on)."""
    services: list[CycleService] = [StatusLine(journal, monitor.progress),
                                    NcclTraces(rundir.private)]
    job_snapshots = snapshots.for_job(cfg, rundir, events)
    if job_snapshots is not None:
        services.append(SnapshotService(job_snapshots, rdzv))
    services += [WarmService(standbys), StragglerService(cfg.ft, rdzv, host, events),
                 WorkersFile(rundir.path)]
    return Services(services)
