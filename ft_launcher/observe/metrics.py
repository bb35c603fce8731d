"""Prometheus metrics of the launcher (``--ft-metrics-port``), with ``prometheus_client``.

The supervisor feeds every event record to :meth:`MetricsExporter.observe` (the exporter
keeps its own :class:`~ft_launcher.observe.ledger.Ledger`) and hands over a callable that returns
each rank's seconds since its last heartbeat; figures that change with time (heartbeat ages,
goodput so far) are computed when Prometheus scrapes. Every metric name begins with
``ft_``. A private registry keeps them apart from anything else in the process.
prometheus_client is an optional extra: ``ft-launcher[metrics]``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ft_launcher.extras import import_extra
from ft_launcher.observe.ledger import Ledger, well_formed

log = logging.getLogger("ft_launcher")

MAX_LABEL_VALUES = 32  # per label: bounded however many kinds the events name


class MetricsError(RuntimeError):
    """The metrics port cannot be served."""


def _prometheus() -> Any:
    prometheus_client, core = import_extra(("prometheus_client", "prometheus_client.core"),
                                           "--ft-metrics-port", "prometheus_client", "metrics")
    return prometheus_client, core.GaugeMetricFamily


class MetricsExporter:
    """Serves ``/metrics`` on ``addr:port`` until :meth:`close`.

    ``observe(record)`` is called from the supervisor's thread; scrapes run in the HTTP
    server's thread; a lock keeps the ledger consistent between them.
    """

    def __init__(self, addr: str = "127.0.0.1", port: int = 0) -> None:
        prometheus_client, gauge_family = _prometheus()
        self._gauge_family = gauge_family
        self._lock = threading.Lock()
        self.ledger = Ledger()
        self._heartbeat_ages: Callable[[], dict[int, float]] | None = None
        self._alive: set[int] = set()
        self._labels: dict[str, set[str]] = {}
        reg = self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._cycle = prometheus_client.Gauge("ft_cycle", "Current restart cycle (0 first).",
                                              registry=reg)
        self._attempt = prometheus_client.Gauge(
            "ft_attempt", "Attempt of this run directory (a requeued job is a new one).",
            registry=reg)
        self._restarts = prometheus_client.Counter(
            "ft_restarts", "Restarts of the worker group, by what ended the cycle.",
            ["cause"], registry=reg)
        self._hangs = prometheus_client.Counter(
            "ft_hang_verdicts", "Ranks judged hung, by the timeout that expired.",
            ["timeout_kind"], registry=reg)
        self._alive_gauge = prometheus_client.Gauge(
            "ft_workers_alive", "Workers of this node running now.", registry=reg)
        reg.register(_Collector(self))
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=addr, registry=reg)
        except OSError as exc:
            raise MetricsError(f"--ft-metrics-port {port} on {addr}: "
                               f"{exc.strerror or exc}") from None
        self.address: tuple[str, int] = self._server.server_address[:2]
        log.info("metrics on http://%s:%d/metrics", *self.address)

    # -- input -----------------------------------------------------------------------

    def set_heartbeat_ages(self, ages: Callable[[], dict[int, float]]) -> None:
        """``ages()`` -> {rank: seconds since its last heartbeat}, called at each scrape
        (from the HTTP thread: it must only read)."""
        self._heartbeat_ages = ages

    def observe(self, record: dict[str, Any]) -> None:
        """Feed one event record (every record the launcher writes to events.jsonl)."""
        if not well_formed(record):
            return
        with self._lock:
            self.ledger.add(record)
        name = record["event"]
        if name == "launcher_started":
            self._alive.clear()
            self._attempt.set(self.ledger.attempts[-1].n if self.ledger.attempts else 1)
        elif name == "workers_started" and isinstance(record.get("ranks"), list):
            self._alive = {r for r in record["ranks"] if isinstance(r, int)}
        elif name == "worker_exited":
            rank = record.get("rank")
            if isinstance(rank, int):
                self._alive.discard(rank)
        elif name == "restart":
            self._restarts.labels(self._label("cause", self._last_cause())).inc()
        elif name == "hang_detected":
            kind = self._label("timeout_kind", str(record.get("timeout_kind", "unknown")))
            self._hangs.labels(kind).inc()
        self._cycle.set(record["cycle"])
        self._alive_gauge.set(len(self._alive))

    def progress(self, rank: int, iteration: int) -> None:
        """A step a rank reported (each report): keeps ``ft_last_step`` current."""
        with self._lock:
            self.ledger.progress(rank, iteration)

    def _last_cause(self) -> str:
        """What ended the cycle before a restart: the decision's outcome (failed, hung,
        peer_changed, ...)."""
        att = self.ledger.attempts[-1] if self.ledger.attempts else None
        if att is None or len(att.cycles) < 2:
            return "unknown"
        previous = att.cycles[sorted(att.cycles)[-2]]
        return str((previous.decision or {}).get("outcome") or "unknown")

    def _label(self, label: str, value: str) -> str:
        seen = self._labels.setdefault(label, set())
        value = value[:64]
        if value not in seen and len(seen) >= MAX_LABEL_VALUES:
            return "other"
        seen.add(value)
        return value

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- at scrape time --------------------------------------------------------------

    def _scrape_figures(self) -> Iterator[Any]:
        family = self._gauge_family
        now = time.time()
        with self._lock:
            summary = self.ledger.summary(now=now)
        current = summary["attempts"][-1] if summary["attempts"] else None
        goodput = family("ft_goodput", "Productive time / wall time of this attempt so far.")
        productive = family("ft_productive_seconds", "Productive training time so far.")
        wall = family("ft_wall_seconds", "Wall time of this attempt so far.")
        lost = family("ft_lost_seconds", "Time lost so far, by phase (see the ledger).",
                      labels=["phase"])
        latency = family("ft_last_detection_latency_seconds",
                         "Fault to detection, for the latest cycle that ended in a fault.")
        step = family("ft_last_step", "Last training step reported by a rank.")
        if current is not None:
            if current["goodput"] is not None:
                goodput.add_metric([], current["goodput"])
            productive.add_metric([], current["productive_s"])
            wall.add_metric([], current["wall_s"])
            for phase, secs in current["lost_s"].items():
                lost.add_metric([phase], secs)
            detected = [c for c in current["cycles"] if c["detection_s"] is not None]
            if detected:
                latency.add_metric([], detected[-1]["detection_s"])
            if current["last_step"] is not None:
                step.add_metric([], current["last_step"])
        yield from (goodput, productive, wall, lost, latency, step)
        ages = family("ft_seconds_since_heartbeat",
                      "Seconds since each rank's last heartbeat (or report).", labels=["rank"])
        for rank, secs in self._ages().items():
            ages.add_metric([str(rank)], secs)
        yield ages

    def _ages(self) -> dict[int, float]:
        if self._heartbeat_ages is None:
            return {}
        try:
            ages = self._heartbeat_ages()
        except Exception:  # a scrape never fails because of the launcher's state
            log.exception("metrics: heartbeat ages")
            return {}
        return {r: float(s) for r, s in dict(ages).items()
                if isinstance(r, int) and isinstance(s, (int, float)) and math.isfinite(s)}


class _Collector:
    """prometheus_client custom collector: the figures computed at scrape time."""

    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Any]:
        yield from self._exporter._scrape_figures()

    def describe(self) -> list[Any]:
        return []  # names vary with the run; nothing to check against other collectors
