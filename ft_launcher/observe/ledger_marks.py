"""The marks the goodput ledger collects as the records of ``events.jsonl`` arrive: one
cycle's (``RawCycle``) and one attempt's (``RawAttempt``).

``ledger.Ledger`` fills them; ``ledger_summary`` cuts them into phases. Both read these
types, so they live here, apart from either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawCycle:
    """Raw marks of one cycle, as the records arrive."""

    n: int
    start: float
    ranks: list[int] = field(default_factory=list)  # the ranks workers_started names
    rendezvous_done: float | None = None
    workers_started: float | None = None
    first_step: dict[int, tuple[float, int]] = field(default_factory=dict)  # rank -> ts, it
    connected: dict[int, float] = field(default_factory=dict)
    training_started: float | None = None
    checkpoints: list[tuple[float, int]] = field(default_factory=list)  # ts, iteration
    last_progress: dict[int, tuple[float, int]] = field(default_factory=dict)  # at, it
    live_step: int | None = None
    restored: int | None = None  # the snapshot's step this cycle resumed from
    fault: dict[str, Any] | None = None  # the first injected fault
    hang: dict[str, Any] | None = None
    failed_exit: dict[str, Any] | None = None
    signal: dict[str, Any] | None = None
    peers_waiting: float | None = None
    # A node of this cycle's round is missing from the next (its rendezvous_done.left): what
    # ended this cycle here (ranks failing in a collective, a hang) followed from its loss.
    lost_a_node: bool = False
    dropped: float | None = None  # the others went on without this node (node_dropped)
    spare_since: float | None = None  # this node waited as a spare from then
    spare_until: float | None = None  # ... until it was admitted
    last_exit: float | None = None
    goodbye: float | None = None
    clean_exit: float | None = None
    decision: dict[str, Any] | None = None
    end: float | None = None  # next cycle's start, or the launcher's exit
    last_ts: float = 0.0

    # -- derived ---------------------------------------------------------------------

    def training_start(self) -> tuple[float | None, str | None]:
        """When every rank was training, and what says so."""
        expected = set(self.ranks)
        if self.first_step and (not expected or expected <= set(self.first_step)):
            return max(ts for ts, _ in self.first_step.values()), "first_step"
        if self.training_started is not None:
            return self.training_started, "training_started"
        if self.connected and (not expected or expected <= set(self.connected)):
            return max(self.connected.values()), "rank_connected"
        return None, None

    def detection(self) -> float | None:
        marks = [self.hang and self.hang["ts"], self.failed_exit and self.failed_exit["ts"],
                 self.signal and self.signal["ts"], self.peers_waiting, self.dropped]
        marks = [m for m in marks if m is not None]
        return min(marks) if marks else None

    def fault_mark(self, detected: float | None) -> tuple[float | None, str | None, str]:
        """(time of the fault, rank, how it is known) for a cycle that ended in a fault."""
        if self.fault is not None and (detected is None or self.fault["at"] <= detected + 1):
            return self.fault["at"], self.fault.get("rank"), "injected"
        if self.hang is not None and detected == self.hang["ts"]:
            return self.hang["ts"] - self.hang["silence"], self.hang.get("rank"), \
                "last heartbeat"
        if self.failed_exit is not None and detected == self.failed_exit["ts"]:
            return self.failed_exit["ts"], self.failed_exit.get("rank"), "worker exit"
        return detected, None, "detection"

    def cause(self) -> str:
        if self.fault is not None:
            return f"injected {self.fault['type']}"
        if self.dropped is not None:
            return "dropped from its round"
        if self.lost_a_node and self.signal is None:
            return "another node"
        detected = self.detection()
        if self.hang is not None and detected == self.hang["ts"]:
            return f"hang ({self.hang['kind']} timeout)"
        if self.failed_exit is not None and detected == self.failed_exit["ts"]:
            e = self.failed_exit
            return f"signal {e['signal']}" if e.get("signal") else f"exit {e.get('exit_code')}"
        if self.signal is not None:
            return f"launcher got {self.signal['name']}"
        if self.peers_waiting is not None:
            return "another node"
        if self.decision is not None:
            return str(self.decision.get("outcome") or "other")
        return "other"

    def time_of(self, iteration: int) -> float | None:
        """When this cycle completed ``iteration``, interpolated between the steps it
        reported (first steps, checkpoints, last steps); None without two of them."""
        points = sorted({(it, ts) for ts, it in (*self.first_step.values(), *self.checkpoints,
                                                 *self.last_progress.values())})
        if len(points) < 2 or not points[0][0] <= iteration <= points[-1][0]:
            return None
        for (i0, t0), (i1, t1) in zip(points, points[1:], strict=False):
            if i0 <= iteration <= i1:
                return t0 if i1 == i0 else t0 + (t1 - t0) * (iteration - i0) / (i1 - i0)
        return None  # pragma: no cover - the range check above covers every iteration

    def steps(self) -> tuple[int | None, int | None]:
        """(first iteration of the cycle, last iteration reported in it)."""
        first = min((it for _, it in self.first_step.values()), default=None)
        seen = [it for _, it in self.first_step.values()]
        seen += [it for _, it in self.last_progress.values()]
        seen += [it for _, it in self.checkpoints]
        if self.live_step is not None:
            seen.append(self.live_step)
        return first, max(seen, default=None)


@dataclass
class RawAttempt:
    """Raw marks of one attempt (a launch of the job in this run directory)."""

    n: int
    start: float
    cycles: dict[int, RawCycle] = field(default_factory=dict)
    current: int | None = None
    restarts: int = 0
    end: float | None = None
    exit_code: int | None = None
    reason: str | None = None
    last_ts: float = 0.0
