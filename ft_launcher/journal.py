"""The job's journal: every event to events.jsonl, the log, the goodput ledger and the
Prometheus metrics; and the launcher's status line, which reads the ledger."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ft_launcher.config import FaultToleranceConfig
from ft_launcher.observe.console import Console
from ft_launcher.observe.ledger import Ledger
from ft_launcher.observe.metrics import MetricsExporter
from ft_launcher.observe.status import StatusTimer, status_line
from ft_launcher.rundir import RunDir

log = logging.getLogger("ft_launcher")


class Journal:
    """Records events for one job; ``cycle`` is the cycle they belong to (set by the job)."""

    def __init__(self, rundir: RunDir, ft: FaultToleranceConfig) -> None:
        self.rundir = rundir
        self.cycle = 0
        # What the faults cost, live: the status line and the Prometheus metrics read it.
        self.ledger = Ledger()
        self.console = Console()
        self.status = StatusTimer(ft.status_interval, time.time())
        self.metrics: MetricsExporter | None = None
        if ft.metrics_port:
            self.metrics = MetricsExporter(ft.metrics_addr, ft.metrics_port)

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """Record an event in events.jsonl, log it as one line, feed the ledger and metrics."""
        record = self.rundir.event(name, self.cycle, **fields)
        shown, line = self.console.line(self.cycle, name, fields)
        log.log(logging.INFO if shown else logging.DEBUG, "%s", line)
        self.ledger.add(record)
        if self.metrics is not None:
            self.metrics.observe(record)
        return record

    def watch_heartbeats(self, ages: Callable[[], dict[int, float]]) -> None:
        """Where the metrics read each rank's heartbeat age (on their HTTP thread)."""
        if self.metrics is not None:
            self.metrics.set_heartbeat_ages(ages)

    def status_due(self) -> float | None:
        return self.status.next_due()

    def print_status(self, progress: Callable[[], Mapping[int, int]]) -> None:
        """The launcher's own line among the ranks' output, every --ft-status-interval."""
        now = time.time()
        if self.status.due(now):
            for rank, iteration in progress().items():
                self.ledger.progress(rank, iteration)
            log.info("status: %s", status_line(self.ledger.summary(now), now))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
