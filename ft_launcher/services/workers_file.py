"""``RUN_DIR/workers.json`` as a cycle service: rewritten when a cycle's workers start and
whenever one exits, emptied when the cycle ends (``process/workers_file.py`` says why)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ft_launcher.process import workers_file
from ft_launcher.services.seam import CycleService, CycleStart

if TYPE_CHECKING:
    from ft_launcher.policy import CycleResult
    from ft_launcher.process.workers import Worker


class WorkersFile(CycleService):
    """Keeps ``workers.json`` to the running cycle's live workers."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.cycle: int | None = None
        self.workers: list[Worker] = []

    def begin(self, start: CycleStart) -> None:
        self.cycle = start.cycle

    def started(self, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)
        workers_file.write(self.run_dir, self.cycle, self.workers)

    def worker_exited(self, worker: Worker) -> None:
        workers_file.write(self.run_dir, self.cycle, self.workers)

    def ended(self, result: CycleResult) -> None:
        self.workers = []
        workers_file.write(self.run_dir, None, ())

    def close(self) -> None:  # a launcher error may end the job without ending its cycle
        if self.workers:
            self.ended(None)  # type: ignore[arg-type]
