"""The warm standby pool as a cycle service: a single-node cycle's store that already
listens, the standbys that become workers, and the pool's own steps (``warm/``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ft_launcher.services.seam import CycleService, CycleStart

if TYPE_CHECKING:
    from ft_launcher.ports import StandbyPort
    from ft_launcher.process.output import Sink
    from ft_launcher.process.workers import Worker, WorkerSpec


class WarmService(CycleService):
    """The job's ``StandbyPool`` (inert with ``--no-ft-warm-restart``) at the cycle's hooks."""

    def __init__(self, standbys: StandbyPort) -> None:
        self.standbys = standbys
        self.store_env: dict[str, str] = {}

    def begin(self, start: CycleStart) -> None:
        # Warm restart keeps a TCPStore listening for the next single-node cycle, so no
        # rank waits out the store client's retry back-off while rank 0's store comes up.
        port = self.standbys.take_store() if start.round.group_world_size == 1 else None
        self.store_env = {} if port is None else {
            "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def worker_env(self, rank: int, env: Mapping[str, str]) -> dict[str, str]:
        return self.store_env

    def take_worker(self, spec: WorkerSpec,
                    sink: Callable[[WorkerSpec], Sink]) -> Worker | None:
        return self.standbys.take(spec, sink)

    def started(self, workers: Sequence[Worker]) -> None:
        self.standbys.cycle_started()

    def due(self, now: float, wall: float) -> float | None:
        return self.standbys.tick_due(now)

    def tick(self, now: float, training: bool) -> None:
        # Standbys are spawned once every rank is training (first heartbeat or section).
        self.standbys.tick(training)

    def close(self) -> None:
        self.standbys.close()
