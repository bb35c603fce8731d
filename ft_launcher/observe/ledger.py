"""The goodput ledger: where the wall-clock time of a run went, cycle by cycle.

Pure logic, no I/O: a :class:`Ledger` consumes the records of ``events.jsonl`` one at a time
(``add``) and answers at any moment (``summary``). ``ft_report`` feeds it a finished run;
the launcher feeds it live for its metrics and status line.

Each cycle's wall time (from its start — the launch or the ``restart`` event — to the next
cycle's start or the launcher's exit) is cut into consecutive phases, so the phases of a
run add up to its wall time exactly::

    rendezvous   start -> rendezvous_done
    spawn        rendezvous_done -> first step of every rank (spawn -> first step)
    productive   first step of every rank -> fault (or end of training), less work lost
    work_lost    last checkpoint -> fault: training that has to be redone (the snapshot
                 the next cycle restored counts as a checkpoint of its step)
    detection    fault -> detection (hang verdict, first failed exit, signal, nodes
                 waiting or lost, this node dropped from its round)
    teardown     detection -> last worker exit
    other        the rest: decision and bookkeeping, or after the training's last step

The fault's time is the injected fault's exact time (``fault_injected.at``), else the
worker's death (its exit) or, for a hang, its last heartbeat (verdict − silence). The first
cycle's rendezvous and spawn are the job's start-up cost, not a fault's; a failed cycle's
loss, plus the next cycle's rendezvous and spawn, is charged to that cycle's cause.

Goodput = productive ÷ wall. Several attempts in one run directory (a requeued job;
``launcher_started.attempt``) are kept apart; the run's figures add the attempts up and do
not count the time between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ft_launcher.observe.ledger_summary import PHASES, START_UP, Knowledge, summarize_run

__all__ = ["PHASES", "START_UP", "Ledger", "attempt_number", "ledger_of", "split_attempts",
           "well_formed"]


def _num(value: Any) -> float | None:
    """A finite float, or None (the ledger reads files it cannot trust)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _when(rec: dict[str, Any], ts: float) -> float:
    """When it happened: the record's ``at`` (the rank's own time, read in a later batch)
    when it is a sane time close to ``ts``, else when it was recorded."""
    at = _num(rec.get("at"))
    return at if at is not None and ts - 60.0 <= at <= ts else ts


@dataclass
class _Cycle:
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
class _Attempt:
    n: int
    start: float
    cycles: dict[int, _Cycle] = field(default_factory=dict)
    current: int | None = None
    restarts: int = 0
    end: float | None = None
    exit_code: int | None = None
    reason: str | None = None
    last_ts: float = 0.0


class Ledger:
    """Incremental goodput ledger over event records (see the module docstring)."""

    def __init__(self) -> None:
        self.attempts: list[_Attempt] = []
        self.uses_progress = False  # the training reports its steps (first_step, ...)
        self.sees_training = False  # ranks connect or start training: a cycle without can tell

    # -- input -----------------------------------------------------------------------

    def add(self, record: dict[str, Any]) -> None:
        """Consume one event record; malformed records are ignored."""
        if not well_formed(record):
            return
        ts, name, n = float(record["ts"]), record["event"], record["cycle"]
        if name == "launcher_started" or not self.attempts:
            self._new_attempt(record, ts)
        att = self.attempts[-1]
        att.last_ts = max(att.last_ts, ts)
        if name == "restart":
            self._close_cycle(att, ts)
            att.restarts = _int(record.get("restarts")) or att.restarts + 1
        cyc = att.cycles.get(n)
        if cyc is None:
            cyc = att.cycles[n] = _Cycle(n, ts)
        if att.current is None or n > att.current:
            if att.current is not None and name != "restart":
                self._close_cycle(att, ts)
            att.current = n
        cyc.last_ts = max(cyc.last_ts, ts)
        handler = getattr(self, "_on_" + name, None)
        if handler is not None:
            handler(att, cyc, record, ts)

    def progress(self, rank: int, iteration: int) -> None:
        """A step a rank reported, live (each report, not an event): feeds ``last_step``
        of the current cycle for the status line and metrics; cheap."""
        if not self.attempts or _int(iteration) is None:
            return
        att = self.attempts[-1]
        cyc = att.cycles.get(att.current) if att.current is not None else None
        if cyc is not None:
            cyc.live_step = iteration if cyc.live_step is None else max(iteration, cyc.live_step)
            self.uses_progress = True

    def _new_attempt(self, record: dict[str, Any], ts: float) -> None:
        given = attempt_number(record, self.attempts[-1].n if self.attempts else None)
        if self.attempts:
            prev = self.attempts[-1]
            if prev.end is None:  # the previous launcher died without a word
                prev.end = prev.last_ts
                self._close_cycle(prev, prev.last_ts)
        self.attempts.append(_Attempt(given, ts))

    @staticmethod
    def _close_cycle(att: _Attempt, ts: float) -> None:
        if att.current is not None:
            cyc = att.cycles.get(att.current)
            if cyc is not None and cyc.end is None:
                cyc.end = ts

    # One handler per event that matters; the others only move the clock.

    def _on_launcher_started(self, att, cyc, rec, ts) -> None:
        cyc.start = min(cyc.start, ts)

    def _on_rendezvous_done(self, att, cyc, rec, ts) -> None:
        cyc.rendezvous_done = ts
        left = rec.get("left")
        earlier = [n for n in att.cycles if n < cyc.n]
        if isinstance(left, list) and left and earlier:
            att.cycles[max(earlier)].lost_a_node = True

    def _on_workers_started(self, att, cyc, rec, ts) -> None:
        cyc.workers_started = ts
        ranks = rec.get("ranks")
        if isinstance(ranks, list):
            cyc.ranks = [r for r in ranks if _int(r) is not None]

    def _on_rank_connected(self, att, cyc, rec, ts) -> None:
        rank = _int(rec.get("rank"))
        if rank is not None:
            cyc.connected.setdefault(rank, ts)
            self.sees_training = True

    def _on_first_step(self, att, cyc, rec, ts) -> None:
        ts = _when(rec, ts)
        rank, it = _int(rec.get("rank")), _int(rec.get("iteration"))
        if rank is not None and it is not None:
            cyc.first_step.setdefault(rank, (ts, it))
            self.uses_progress = True

    def _on_training_started(self, att, cyc, rec, ts) -> None:
        ts = _when(rec, ts)
        if cyc.training_started is None:
            cyc.training_started = ts
            self.sees_training = True

    def _on_checkpoint_saved(self, att, cyc, rec, ts) -> None:
        ts = _when(rec, ts)
        it = _int(rec.get("iteration"))
        if it is not None:
            cyc.checkpoints.append((ts, it))
            self.uses_progress = True

    def _on_snapshot_picked(self, att, cyc, rec, ts) -> None:
        cyc.restored = _int(rec.get("iteration"))

    def _on_last_progress(self, att, cyc, rec, ts) -> None:
        rank, it = _int(rec.get("rank")), _int(rec.get("iteration"))
        at = _num(rec.get("at"))
        if rank is not None and it is not None:
            cyc.last_progress[rank] = (at if at is not None else ts, it)
            self.uses_progress = True

    def _on_fault_injected(self, att, cyc, rec, ts) -> None:
        if cyc.fault is None:
            at = _num(rec.get("at"))
            cyc.fault = {"at": at if at is not None else ts, "rank": _int(rec.get("rank")),
                         "type": str(rec.get("fault_type", "fault"))[:40]}

    def _on_hang_detected(self, att, cyc, rec, ts) -> None:
        # The verdict's own moment; the event follows the stack capture.
        ts = _num(rec.get("detected_at")) or ts
        if cyc.hang is None:
            silence = _num(rec.get("silence_s"))
            cyc.hang = {"ts": ts, "rank": _int(rec.get("rank")),
                        "silence": max(0.0, silence) if silence is not None else 0.0,
                        "kind": str(rec.get("timeout_kind", "?"))[:40]}

    def _on_worker_exited(self, att, cyc, rec, ts) -> None:
        cyc.last_exit = max(cyc.last_exit or ts, ts)
        code = rec.get("exit_code")
        if code == 0 and not rec.get("signal"):
            cyc.clean_exit = min(cyc.clean_exit or ts, ts)
        elif cyc.failed_exit is None and not rec.get("stopped_by_launcher"):
            cyc.failed_exit = {"ts": ts, "rank": _int(rec.get("rank")),
                               "exit_code": _int(code), "signal": rec.get("signal")}

    def _on_rank_goodbye(self, att, cyc, rec, ts) -> None:
        if cyc.goodbye is None:
            cyc.goodbye = ts

    def _on_signal_received(self, att, cyc, rec, ts) -> None:
        if cyc.signal is None:
            cyc.signal = {"ts": ts, "name": str(rec.get("signal", "?"))[:20]}

    def _on_peers_waiting(self, att, cyc, rec, ts) -> None:
        if cyc.peers_waiting is None:
            cyc.peers_waiting = ts

    def _on_node_dropped(self, att, cyc, rec, ts) -> None:
        if cyc.dropped is None:
            cyc.dropped = ts

    def _on_spare_waiting(self, att, cyc, rec, ts) -> None:
        if cyc.spare_since is None:
            cyc.spare_since = ts

    def _on_spare_admitted(self, att, cyc, rec, ts) -> None:
        cyc.spare_until = ts

    def _on_decision(self, att, cyc, rec, ts) -> None:
        cyc.decision = {"ts": ts, "outcome": rec.get("outcome"), "reason": rec.get("reason")}

    def _on_launcher_exited(self, att, cyc, rec, ts) -> None:
        att.end = ts
        att.exit_code = _int(rec.get("exit_code"))
        att.reason = rec.get("reason") if isinstance(rec.get("reason"), str) else None
        self._close_cycle(att, ts)

    # -- output ----------------------------------------------------------------------

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """The ledger so far, JSON-ready (``ledger_summary``). ``now`` ends a running cycle
        (default: the last event's time)."""
        return summarize_run(self.attempts, now, Knowledge(self.uses_progress,
                                                            self.sees_training))


def well_formed(record: Any) -> bool:
    """A record with a finite ``ts``, a string ``event`` and a cycle number ≥ 0."""
    if not isinstance(record, dict):
        return False
    cycle = _int(record.get("cycle"))
    return _num(record.get("ts")) is not None and isinstance(record.get("event"), str) \
        and cycle is not None and cycle >= 0


def attempt_number(launcher_started: dict[str, Any], previous: int | None) -> int:
    """The attempt a ``launcher_started`` record opens: its ``attempt`` field, never below
    the one after ``previous`` (the run directory's own numbering, ``RunDir``); records of
    an older launcher carry none and count one more."""
    after = (previous or 0) + 1
    given = _int(launcher_started.get("attempt"))
    return max(after, given) if given is not None else after


def split_attempts(records: list[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """The well-formed records of a run directory, cut at each ``launcher_started``, with
    the attempt number of each part (records before the first one belong to attempt 1)."""
    parts: list[tuple[int, list[dict[str, Any]]]] = []
    for record in records:
        if not well_formed(record):
            continue
        if record.get("event") == "launcher_started" or not parts:
            n = attempt_number(record, parts[-1][0] if parts else None) \
                if record.get("event") == "launcher_started" else 1
            parts.append((n, []))
        parts[-1][1].append(record)
    return parts


def ledger_of(records: list[dict[str, Any]]) -> Ledger:
    """A ledger fed with every record of a run (``rundir.read_events``)."""
    ledger = Ledger()
    for record in records:
        ledger.add(record)
    return ledger
