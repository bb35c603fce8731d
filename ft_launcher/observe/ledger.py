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
from typing import Any

from ft_launcher.observe.ledger_marks import RawAttempt, RawCycle
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


class Ledger:
    """Incremental goodput ledger over event records (see the module docstring)."""

    def __init__(self) -> None:
        self.attempts: list[RawAttempt] = []
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
            cyc = att.cycles[n] = RawCycle(n, ts)
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
        self.attempts.append(RawAttempt(given, ts))

    @staticmethod
    def _close_cycle(att: RawAttempt, ts: float) -> None:
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
