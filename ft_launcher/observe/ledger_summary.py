"""The goodput ledger's answers: a finished or running cycle cut into phases, and the sums
over attempts (see ``ledger.py`` for the phases and what they mean).

Pure functions of the marks (``ledger_marks``) a :class:`~ft_launcher.observe.ledger.Ledger`
collected. Each cycle's figures are a typed :class:`CycleSummary`; ``to_dict`` gives the
JSON-ready row that ``summary.json``, ``ft_report``, the metrics and the timeline read (its
keys and their order are part of the run directory's format).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ft_launcher.observe.ledger_marks import RawAttempt, RawCycle

PHASES = ("rendezvous", "spawn", "productive", "work_lost", "detection", "teardown", "other")
START_UP = "start-up and shutdown"
SPARE = "waiting as a spare"  # a node kept idle on purpose, not a fault's cost


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class Knowledge:
    """What the whole run tells about every cycle: whether the training reports its steps
    (``first_step``, checkpoints, ...) and whether ranks are seen connecting or training."""

    uses_progress: bool
    sees_training: bool


@dataclass
class CycleMarks:
    """The phase boundaries of a cycle (wall-clock seconds)."""

    rendezvous_done: float | None
    workers_started: float | None
    training: float | None
    stop: float
    detected: float
    torn_down: float
    end: float


@dataclass
class CycleSummary:
    """One cycle's figures. Field order is the key order of the JSON row."""

    cycle: int
    start_ts: float
    end_ts: float | None
    startup: bool
    outcome: str | None
    cause: str | None
    charged_to: str
    fault_ts: float | None
    fault_rank: int | None
    fault_source: str | None
    detected_ts: float | None
    detection_s: float | None
    teardown_s: float | None
    rendezvous_s: float | None
    spawn_to_first_step_s: float | None
    training_start_source: str | None
    productive_s: float | None
    first_step: int | None
    last_step: int | None
    checkpoint_step: int | None
    checkpoint_ts: float | None
    work_lost_s: float | None
    work_lost_steps: int | None
    next_cycle_first_step: int | None
    recovery_s: float | None
    no_progress: bool | None
    phases_s: dict[str, float]
    marks: CycleMarks
    checkpoint_source: str | None = None  # "checkpoint", or "snapshot" (restored from it)
    spare_wait_s: float | None = None  # the part of the run-up spent waiting as a spare

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready row."""
        return dataclasses.asdict(self)


@dataclass
class _Cut:
    """Where a cycle's phases begin and end, and the training lost to its fault."""

    end: float
    rendezvous: float
    training: float
    stop: float
    detected: float
    torn_down: float
    work_lost: float
    checkpoint: tuple[float, int] | None
    from_snapshot: bool = False  # the checkpoint is the snapshot the next cycle restored

    def phases(self, start: float) -> dict[str, float]:
        return {
            "rendezvous": self.rendezvous - start,
            "spawn": self.training - self.rendezvous,
            "productive": self.stop - self.training - self.work_lost,
            "work_lost": self.work_lost,
            "detection": self.detected - self.stop,
            "teardown": self.torn_down - self.detected,
            "other": self.end - self.torn_down,
        }


def _training_end(c: RawCycle) -> float | None:
    """When the training's last step was reported, for a cycle that did not fail."""
    if c.last_progress:
        return max(at for at, _ in c.last_progress.values())
    marks = [m for m in (c.goodbye, c.clean_exit) if m is not None]
    return min(marks) if marks else None


def _last_checkpoint(c: RawCycle, before: float) -> tuple[float, int] | None:
    saved = [(ts, it) for ts, it in c.checkpoints if ts <= before]
    return max(saved) if saved else None


def _snapshot_kept(c: RawCycle, nxt: RawCycle | None) -> tuple[float, int] | None:
    """(when, step) of the snapshot the next cycle restored, placed in this cycle's time."""
    if nxt is None or nxt.restored is None:
        return None
    ts = c.time_of(nxt.restored)
    return None if ts is None else (ts, nxt.restored)


def _fault(c: RawCycle, detected: float | None) -> tuple[float | None, int | None, str | None]:
    """(time, rank, how it is known) of the cycle's fault; all None without one."""
    if detected is not None:
        return c.fault_mark(detected)
    if c.fault is not None:  # injected, never seen to fail (yet)
        return c.fault["at"], c.fault.get("rank"), "injected"
    return None, None, None


def _cut(c: RawCycle, end: float, detected: float | None, fault_ts: float | None,
         train_ts: float | None, known: Knowledge,
         snapshot: tuple[float, int] | None = None) -> _Cut:
    """Consecutive boundaries, each clipped to [previous boundary, end of cycle]."""
    failed = detected is not None

    def clip(t: float | None, lo: float) -> float:
        return lo if t is None else min(max(t, lo), end)

    t_rdzv = clip(c.rendezvous_done, c.start)
    stop_training = fault_ts if failed else _training_end(c)
    if train_ts is None:  # never trained: the whole run-up is spawn time
        t_train = clip(stop_training if stop_training is not None else end, t_rdzv)
    else:
        t_train = clip(min(train_ts, stop_training) if stop_training is not None
                       else train_ts, t_rdzv)
    t_stop = clip(stop_training if stop_training is not None else end, t_train)
    ckpt = _last_checkpoint(c, t_stop)
    from_snapshot = snapshot is not None and (ckpt is None or snapshot[1] > ckpt[1])
    if from_snapshot:
        # The next cycle resumed from it, so every rank had that step before the fault:
        # only what came after is lost. Its time (interpolated from the ranks' reports)
        # can trail a hang's estimated fault, the last heartbeat, which a step sends just
        # before it reports its progress: it is clipped, never a reason to ignore it.
        ckpt = (min(snapshot[0], t_stop), snapshot[1])
    work_lost = 0.0
    # Without any step or checkpoint reported, what was kept is unknown: the training
    # counts as productive (the summary says so with progress_reported false).
    if failed and train_ts is not None and known.uses_progress:
        since = max(ckpt[0], t_train) if ckpt else t_train
        work_lost = max(0.0, t_stop - since)
    t_detect = clip(detected, t_stop) if failed else t_stop
    t_teardown = clip(c.last_exit, t_detect) if failed else t_detect
    return _Cut(end, t_rdzv, t_train, t_stop, t_detect, t_teardown, work_lost, ckpt,
                from_snapshot)


def _steps_lost(failed: bool, first_it: int | None, last_it: int | None,
                ckpt_it: int | None, known: Knowledge) -> int | None:
    if failed and last_it is not None:
        base = ckpt_it if ckpt_it is not None else (first_it - 1 if first_it else None)
        return max(0, last_it - base) if base is not None else None
    if failed and known.uses_progress:
        return 0  # no step was made in this cycle
    return None


def _no_progress(c: RawCycle, failed: bool, train_ts: float | None, last_it: int | None,
                 ckpt: tuple[float, int] | None, known: Knowledge) -> bool | None:
    if failed and train_ts is None and (known.uses_progress or known.sees_training):
        return True  # the fault came before every rank was training
    if failed and known.uses_progress:
        return not c.first_step or ckpt is None
    if c.end is not None and known.uses_progress:
        return not c.first_step and last_it is None
    return None


def summarize_cycle(c: RawCycle, nxt: RawCycle | None, attempt_end: float, first: bool,
                    known: Knowledge) -> CycleSummary:
    """The figures of cycle ``c``; ``nxt`` is the attempt's next cycle, if any."""
    end = max(c.end if c.end is not None else (nxt.start if nxt else attempt_end), c.start)
    detected = c.detection()
    failed = detected is not None
    fault_ts, fault_rank, fault_source = _fault(c, detected)
    train_ts, train_source = c.training_start()
    kept = _snapshot_kept(c, nxt)
    cut = _cut(c, end, detected, fault_ts, train_ts, known, kept)
    phases = cut.phases(c.start)
    first_it, last_it = c.steps()
    ckpt_it = cut.checkpoint[1] if cut.checkpoint else None
    next_train = nxt.training_start()[0] if nxt else None
    cause = c.cause() if failed else None
    return CycleSummary(
        cycle=c.n, start_ts=c.start, end_ts=c.end, startup=first,
        outcome=(c.decision or {}).get("outcome") or ("running" if c.end is None else None),
        cause=cause, charged_to=cause or START_UP,
        fault_ts=fault_ts, fault_rank=fault_rank, fault_source=fault_source,
        detected_ts=detected,
        detection_s=_r(cut.detected - cut.stop) if failed else None,
        teardown_s=_r(cut.torn_down - cut.detected) if failed else None,
        rendezvous_s=_r(phases["rendezvous"]),
        spawn_to_first_step_s=_r(train_ts - c.workers_started)
        if train_ts is not None and c.workers_started is not None else None,
        training_start_source=train_source,
        productive_s=_r(phases["productive"]),
        first_step=first_it, last_step=last_it, checkpoint_step=ckpt_it,
        checkpoint_ts=cut.checkpoint[0] if cut.checkpoint else None,
        work_lost_s=_r(cut.work_lost) if failed and known.uses_progress else None,
        work_lost_steps=_steps_lost(failed, first_it, last_it, ckpt_it, known),
        next_cycle_first_step=min((it for _, it in nxt.first_step.values()), default=None)
        if nxt else None,
        recovery_s=_r(next_train - fault_ts)
        if failed and next_train is not None and fault_ts is not None else None,
        no_progress=_no_progress(c, failed, train_ts, last_it, cut.checkpoint, known),
        phases_s={k: round(max(0.0, v), 6) for k, v in phases.items()},
        marks=CycleMarks(c.rendezvous_done, c.workers_started, train_ts, cut.stop,
                         cut.detected, cut.torn_down, end),
        checkpoint_source=None if cut.checkpoint is None else
        "snapshot" if cut.from_snapshot else "checkpoint",
        spare_wait_s=_spare_wait(c, cut.training),
    )


def _spare_wait(c: RawCycle, run_up_end: float) -> float | None:
    """Seconds of the cycle's run-up (rendezvous and spawn) this node waited as a spare:
    until it was admitted, or to the run-up's end; None if it never waited."""
    if c.spare_since is None:
        return None
    since = min(max(c.spare_since, c.start), run_up_end)
    until = min(c.spare_until if c.spare_until is not None else run_up_end, run_up_end)
    return _r(max(0.0, until - since))


def _losses(rows: list[CycleSummary]) -> tuple[float, dict[str, float], dict[str, float]]:
    """(productive seconds, lost seconds by phase, lost seconds by cause) over the rows."""
    lost = {"start-up": 0.0, **{p: 0.0 for p in PHASES if p != "productive"}}
    by_cause: dict[str, float] = {}
    productive = 0.0
    for i, row in enumerate(rows):
        productive += row.phases_s["productive"]
        spare = row.spare_wait_s or 0.0
        for phase, secs in row.phases_s.items():
            if phase == "productive":
                continue
            key = "start-up" if row.startup and phase in ("rendezvous", "spawn") else phase
            lost[key] += secs
            cause = row.charged_to if key != "start-up" else START_UP
            if phase in ("rendezvous", "spawn") and not row.startup and i > 0:
                cause = rows[i - 1].cause or START_UP
            if phase in ("rendezvous", "spawn") and spare:
                taken = min(spare, secs)
                spare, secs = spare - taken, secs - taken
                by_cause[SPARE] = by_cause.get(SPARE, 0.0) + taken
            if secs:
                by_cause[cause] = by_cause.get(cause, 0.0) + secs
    return productive, lost, by_cause


def _rounded(figures: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in figures.items()}


def summarize_attempt(att: RawAttempt, now: float | None, known: Knowledge) -> dict[str, Any]:
    """One attempt's figures and its cycles' rows, JSON-ready."""
    end = att.end if att.end is not None else max(now or att.last_ts, att.last_ts)
    order = sorted(att.cycles)
    rows = [summarize_cycle(att.cycles[n],
                            att.cycles[order[i + 1]] if i + 1 < len(order) else None,
                            end, i == 0, known)
            for i, n in enumerate(order)]
    productive, lost, by_cause = _losses(rows)
    wall = end - att.start
    covered = productive + sum(lost.values())
    lost["other"] += max(0.0, wall - covered)  # before the first cycle, after the last
    if wall - covered > 0:
        by_cause[START_UP] = by_cause.get(START_UP, 0.0) + (wall - covered)
    steps = [r.last_step for r in rows if r.last_step is not None]
    return {
        "attempt": att.n,
        "start_ts": att.start,
        "end_ts": att.end,
        "wall_s": round(wall, 3),
        "productive_s": round(productive, 3),
        "lost_s": _rounded(lost),
        "lost_by_cause_s": _rounded(by_cause),
        "goodput": round(productive / wall, 4) if wall > 0 else None,
        "cycle": att.current,
        "restarts": att.restarts,
        "last_step": rows[-1].last_step if rows and rows[-1].last_step is not None
        else (steps[-1] if steps else None),
        "exit_code": att.exit_code,
        "reason": att.reason,
        "cycles": [row.to_dict() for row in rows],
    }


def summarize_run(attempts: list[RawAttempt], now: float | None,
                  known: Knowledge) -> dict[str, Any]:
    """The whole run: every attempt's summary and their sums, JSON-ready."""
    rows = [summarize_attempt(a, now, known) for a in attempts]
    lost: dict[str, float] = {}
    by_cause: dict[str, float] = {}
    for a in rows:
        for k, v in a["lost_s"].items():
            lost[k] = lost.get(k, 0.0) + v
        for k, v in a["lost_by_cause_s"].items():
            by_cause[k] = by_cause.get(k, 0.0) + v
    wall = sum(a["wall_s"] for a in rows)
    productive = sum(a["productive_s"] for a in rows)
    last = rows[-1] if rows else None
    return {
        "attempts": rows,
        "wall_s": round(wall, 3),
        "productive_s": round(productive, 3),
        "lost_s": _rounded(lost),
        "lost_by_cause_s": _rounded(by_cause),
        "goodput": round(productive / wall, 4) if wall > 0 else None,
        "attempt": last["attempt"] if last else None,
        "start_ts": attempts[0].start if attempts else None,
        "cycle": last["cycle"] if last else None,
        "restarts": sum(a["restarts"] for a in rows),
        "last_step": last["last_step"] if last else None,
        "running": bool(last and last["end_ts"] is None),
        "progress_reported": known.uses_progress,
    }
