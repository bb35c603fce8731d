"""The launcher's status line as a cycle service: printed among the ranks' output every
``--ft-status-interval`` (``journal.Journal.print_status``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ft_launcher.services.seam import CycleService

if TYPE_CHECKING:
    from ft_launcher.journal import Journal


class StatusLine(CycleService):
    """Prints the status line when due; wakes the loop for it."""

    def __init__(self, journal: Journal, progress: Callable[[], Mapping[int, int]]) -> None:
        self.journal, self.progress = journal, progress

    def due(self, now: float, wall: float) -> float | None:
        at = self.journal.status_due()  # on the wall clock
        return None if at is None else now + (at - wall)

    def tick(self, now: float, training: bool) -> None:
        self.journal.print_status(self.progress)
