"""Stragglers as a cycle service: each cycle's detector, fed by the ranks' closed sections,
and its exchange of medians with the other nodes (``stragglers/``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ft_launcher.config import FaultToleranceConfig
from ft_launcher.policy import CycleResult, Outcome
from ft_launcher.process.workers import Worker
from ft_launcher.services.seam import CycleService, CycleStart, RankFeeds
from ft_launcher.stragglers import straggler_exchange
from ft_launcher.stragglers.straggler import DETECTED, StragglerDetector

# A rank's first section times of a cycle are not scored for stragglers (warm-up noise).
STRAGGLER_WARMUP_STEPS = 5


class StragglerService(CycleService):
    """Scores this node's ranks each pass; a straggler ends the cycle unless the action is
    ``report``."""

    def __init__(self, ft: FaultToleranceConfig, rdzv: Any, host: str,
                 events: Callable[..., Any]) -> None:
        self.ft, self.rdzv, self.host, self.events = ft, rdzv, host, events
        self.cycle = 0
        self.detector = self._detector()
        # Other nodes' medians through the rendezvous store (several nodes only).
        self.exchange: straggler_exchange.Exchange | None = None

    def _detector(self) -> StragglerDetector:
        ft = self.ft
        return StragglerDetector(ft.straggler_threshold, ft.straggler_window,
                                 ft.straggler_section, host=self.host,
                                 warmup_steps=STRAGGLER_WARMUP_STEPS)

    def begin(self, start: CycleStart) -> None:
        rnd = start.round
        self.cycle = start.cycle
        self.detector = self._detector()
        self.exchange = straggler_exchange.for_round(self.rdzv, rnd.group_rank,
                                                     rnd.group_world_size, self.host)

    def feeds(self) -> RankFeeds:
        return RankFeeds(section_closed=self.detector.observe,
                         device_time=self.detector.observe_device)

    def polls(self) -> bool:
        return self.exchange is not None

    def worker_exited(self, worker: Worker) -> None:
        self.detector.forget(worker.rank)

    def check(self) -> CycleResult | None:
        det = self.detector
        if self.exchange is not None:
            for node in self.exchange.poll(det.local_medians(), det.active_clock()):
                for rank, median_s in node.medians.items():
                    det.observe_remote(rank, node.host, median_s, node.clock)
        for ev in det.evaluate():
            self.events(ev.event, **ev.fields())
            action = self.ft.straggler_action
            if ev.event == DETECTED and action != "report":
                return CycleResult(self.cycle, Outcome.STRAGGLER, straggler=ev.fields(),
                                   action=action)
        return None
