"""The exit-code and fault policy: the one place that decides what follows a cycle.

Input: how the cycle ended (``CycleResult``) and the job's state so far (``JobState``).
Output: a ``Decision``: restart (maybe on rotated devices) or exit with a code, and what a
scheduler wrapper should do next. Nothing else in the launcher decides.

| cycle ended with | decision|
|-----------------------------------------|-----------------------------------------------------------|
| every worker 0 | exit 0, no requeue|
| launcher got SIGTERM / SIGINT | exit 128+signal; requeue after SIGTERM only|
| rank asked shutdown / exclude_node | exit 1; no requeue / requeue without this node|
| other nodes re-rendezvous | restart, not counted|
| a health check failed | exit 1, requeue without this node|
| rendezvous service lost | exit 1, requeue (no node blamed)|
| rendezvous closed by the others | exit 0 for a spare never needed, else exit 1|
| exit 16 (resume elsewhere) | restart on rotated devices while a new device is left,|
| | else exit 16, requeue excluding this node|
| exit 17, transient error | restart in place (counted)|
| exit 17, persistent error | restart away from the suspicious device if a spare exists,|
| | else exit 17, requeue excluding this node|
| exit 17, correct result (bad data) | restart to skip it with --ft-skip-bad-iterations,|
| | else exit 17, stop|
| exit 17, no diagnosis received | exit 17, stop|
| no progress for N cycles | exit 18, stop|
| any other failure or a hang | restart while --max-restarts lasts, else exit 1, requeue|
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ft_launcher.hang.liveness import HangVerdict

EXIT_SUCCESS = 0
EXIT_FAILURE = 1
EXIT_RESUME_ELSEWHERE = 16
EXIT_FAILED_VALIDATION = 17
EXIT_NO_PROGRESS = 18


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a worker exited non-zero or was killed
    HUNG = "hung"  # the monitor judged a rank hung
    SIGNALED = "signaled"  # the launcher itself got SIGTERM/SIGINT
    PEER_CHANGED = "peer_changed"  # other nodes are waiting in the rendezvous
    CONTROL = "control"  # a rank asked for shutdown or exclusion
    STRAGGLER = "straggler"  # a rank stayed slow (--ft-straggler-action restart|exclude)
    UNHEALTHY = "unhealthy"  # a node health check failed before the rendezvous
    RENDEZVOUS_LOST = "rendezvous_lost"  # the rendezvous service is unreachable
    RENDEZVOUS_CLOSED = "rendezvous_closed"  # the other nodes ended the job


@dataclass
class WorkerExit:
    """One worker's exit, as recorded in events.jsonl and summary.json."""

    rank: int
    local_rank: int
    pid: int
    exit_code: int | None  # None when a signal ended it
    signal: str | None  # e.g. "SIGKILL"
    warm: bool = False


@dataclass
class CycleResult:
    """How one cycle ended."""

    cycle: int
    outcome: Outcome
    failures: list[WorkerExit] = field(default_factory=list)  # first failure first
    hang: HangVerdict | None = None
    signum: int | None = None
    control: str | None = None
    straggler: dict[str, Any] | None = None  # the straggler_detected event's fields
    action: str | None = None  # --ft-straggler-action
    reason: str | None = None  # what a health check or the rendezvous said
    was_spare: bool = False  # RENDEZVOUS_CLOSED: this node only ever waited as a spare
    diagnoses: list[dict[str, Any]] = field(default_factory=list)
    progress_iteration: int | None = None


@dataclass
class JobState:
    """What the policy remembers across cycles of one job."""

    max_restarts: int
    num_devices: int
    nproc: int
    host: str
    max_no_progress_cycles: int | None = None
    skip_bad_iterations: bool = False
    excluded_devices: set[int] = field(default_factory=set)
    restarts: int = 0
    rotation: int = 0
    rotations_left: int = 0
    last_iteration: int | None = None
    cycles_without_progress: int = 0

    def __post_init__(self) -> None:
        self.rotations_left = max(0, self.num_devices - 1)

    def device_map(self) -> list[int]:
        """Device id for each local rank under the current rotation and exclusions."""
        usable = [d for d in range(self.num_devices) if d not in self.excluded_devices]
        return [usable[(i + self.rotation) % len(usable)] for i in range(self.nproc)]


@dataclass
class NextAction:
    """What a scheduler wrapper should do after the launcher exits."""

    requeue: bool
    exclude_nodes: list[str]
    why: str


@dataclass
class Decision:
    restart: bool
    reason: str
    exit_code: int | None = None
    next_action: NextAction | None = None
    counted: bool = True  # counts against --max-restarts
    rotate: bool = False
    exclude_device: int | None = None
    # The checkpoint progress seen this cycle: (iteration, cycles without progress).
    progress: tuple[int, int] | None = None


def stop(code: int, reason: str, requeue: bool, exclude: list[str] | None = None) -> Decision:
    """A decision to exit with ``code`` and tell the scheduler what to do next."""
    return Decision(
        restart=False,
        reason=reason,
        exit_code=code,
        next_action=NextAction(requeue=requeue, exclude_nodes=exclude or [], why=reason),
    )


def _restart_or_exhausted(state: JobState, reason: str) -> Decision:
    if state.restarts < state.max_restarts:
        return Decision(restart=True, reason=reason)
    return stop(
        EXIT_FAILURE,
        f"{reason}; restarts exhausted ({state.restarts} of {state.max_restarts})",
        requeue=True,
    )


def _verdict(diagnoses: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last diagnosis that carries a final diagnostic, if any rank sent one."""
    for d in reversed(diagnoses):
        if d.get("diagnostic") in ("TRANSIENT_ERROR", "PERSISTENT_ERROR", "CORRECT_RESULT"):
            return d
    return None


def _decide_17(result: CycleResult, state: JobState) -> Decision:
    verdict = _verdict(result.diagnoses)
    here = [state.host]
    if verdict is None:
        return stop(EXIT_FAILED_VALIDATION, "exit 17 without a diagnosis from the rank",
                     requeue=False)
    diagnostic = verdict["diagnostic"]
    where = f"iteration {verdict.get('iteration')}"
    if diagnostic == "TRANSIENT_ERROR":
        return _restart_or_exhausted(state, f"transient error at {where}; restart in place")
    if diagnostic == "PERSISTENT_ERROR":
        device = _device_number(verdict.get("suspicious_device") or verdict.get("device"))
        spare = state.num_devices - len(state.excluded_devices) - 1 >= state.nproc
        if device is not None and spare:
            return Decision(
                restart=True,
                reason=f"persistent error at {where} on device {device}; excluding it",
                exclude_device=device,
            )
        return stop(
            EXIT_FAILED_VALIDATION,
            f"persistent error at {where} on device {verdict.get('suspicious_device')} of "
            f"{state.host}; no spare device here",
            requeue=True,
            exclude=here,
        )
    if state.skip_bad_iterations:
        return _restart_or_exhausted(state, f"{where} gives the same result on other "
                                     "hardware (bad data); restart to skip it")
    return stop(
        EXIT_FAILED_VALIDATION,
        f"{where} failed validation with the same result on other hardware: the data, not "
        "the hardware; stopping (use --ft-skip-bad-iterations to skip it)",
        requeue=False,
    )


def _device_number(device: Any) -> int | None:
    try:
        return int(str(device).rsplit(":", 1)[-1])
    except (TypeError, ValueError):
        return None


def _progress(result: CycleResult, state: JobState) -> tuple[int, int] | None:
    """(iteration, cycles without progress) after this cycle; None when not tracked."""
    if state.max_no_progress_cycles is None or result.progress_iteration is None:
        return None
    stalled = state.last_iteration is not None and \
        result.progress_iteration <= state.last_iteration
    return result.progress_iteration, state.cycles_without_progress + 1 if stalled else 0


def _no_progress(progress: tuple[int, int] | None, state: JobState) -> Decision | None:
    if progress is None or state.max_no_progress_cycles is None:
        return None
    iteration, stalled_cycles = progress
    if stalled_cycles >= state.max_no_progress_cycles:
        return stop(
            EXIT_NO_PROGRESS,
            f"no progress past iteration {iteration} in {stalled_cycles} cycles",
            requeue=False,
        )
    return None


def decide(result: CycleResult, state: JobState) -> Decision:
    """The decision for a finished cycle (see the module table). Reads ``state`` only;
    ``apply`` makes the changes a decision implies."""
    decision = _decide(result, state)
    if result.outcome in (Outcome.FAILED, Outcome.HUNG):
        decision.progress = _progress(result, state)
    return decision


def _decide(result: CycleResult, state: JobState) -> Decision:
    judge = _BY_OUTCOME.get(result.outcome)
    if judge is not None:
        return judge(result, state)
    stuck = _no_progress(_progress(result, state), state)
    if stuck is not None:
        return stuck
    if result.outcome is Outcome.HUNG:
        return _decide_hung(result, state)
    return _decide_failed(result, state)


def _decide_signaled(result: CycleResult, state: JobState) -> Decision:
    name = signal.Signals(result.signum).name if result.signum else "a signal"
    return stop(128 + (result.signum or 0), f"launcher received {name}",
                requeue=result.signum == signal.SIGTERM)


def _decide_control(result: CycleResult, state: JobState) -> Decision:
    if result.control == "exclude_node":
        return stop(EXIT_FAILURE, "a rank asked to exclude this node", requeue=True,
                    exclude=[state.host])
    return stop(EXIT_FAILURE, "a rank asked to shut the workload down", requeue=False)


def _decide_rendezvous_closed(result: CycleResult, state: JobState) -> Decision:
    if result.was_spare:
        return stop(EXIT_SUCCESS, "spare not needed: the job ended without it",
                    requeue=False)
    return stop(EXIT_FAILURE, result.reason or "the other nodes closed the rendezvous",
                requeue=False)


def _decide_straggler(result: CycleResult, state: JobState) -> Decision:
    s = result.straggler or {}
    what = (f"straggler rank {s.get('rank')} on {s.get('host') or state.host} "
            f"({s.get('section')} {s.get('score', 0):.2f}x the other ranks)")
    if result.action == "exclude":
        return stop(EXIT_FAILURE, what, requeue=True, exclude=[s.get("host") or state.host])
    return _restart_or_exhausted(state, what)


# Outcomes judged without looking at progress or the ranks' exit codes.
_BY_OUTCOME: dict[Outcome, Callable[[CycleResult, JobState], Decision]] = {
    Outcome.SUCCEEDED: lambda result, state: stop(
        EXIT_SUCCESS, "all workers finished with 0", requeue=False),
    Outcome.SIGNALED: _decide_signaled,
    Outcome.CONTROL: _decide_control,
    Outcome.PEER_CHANGED: lambda result, state: Decision(
        restart=True, reason=result.reason or "other nodes re-joined the rendezvous",
        counted=False),
    Outcome.UNHEALTHY: lambda result, state: stop(
        EXIT_FAILURE, result.reason or "health check failed", requeue=True,
        exclude=[state.host]),
    # Not this node's fault: no exclusion.
    Outcome.RENDEZVOUS_LOST: lambda result, state: stop(
        EXIT_FAILURE, result.reason or "rendezvous lost", requeue=True),
    Outcome.RENDEZVOUS_CLOSED: _decide_rendezvous_closed,
    Outcome.STRAGGLER: _decide_straggler,
}


def _decide_hung(result: CycleResult, state: JobState) -> Decision:
    hang = result.hang
    return _restart_or_exhausted(
        state, f"rank {hang.rank if hang else None} hung "
        f"({hang.timeout_kind if hang else 'unknown'} timeout)"
    )


def announced_exits(diagnoses: list[dict[str, Any]]) -> list[int]:
    """The exit codes 16/17 that ranks announced in their diagnoses before exiting."""
    return [d["exit_code"] for d in diagnoses
            if d.get("exit_code") in (EXIT_RESUME_ELSEWHERE, EXIT_FAILED_VALIDATION)]


def _decide_failed(result: CycleResult, state: JobState) -> Decision:
    # A rank that announced its exit 16/17 in a diagnosis but died otherwise (an abort on
    # the way out) is judged by what it announced.
    codes = [f.exit_code for f in result.failures] + announced_exits(result.diagnoses)
    if EXIT_RESUME_ELSEWHERE in codes:
        return _decide_16(state)
    if EXIT_FAILED_VALIDATION in codes:
        return _decide_17(result, state)
    if not result.failures:
        return _restart_or_exhausted(state, "a rank failed")
    return _restart_or_exhausted(state, _failure_reason(result))


def _decide_16(state: JobState) -> Decision:
    if state.rotations_left > 0:
        return Decision(
            restart=True,
            reason="exit 16: re-run the step from the checkpoint on rotated devices",
            rotate=True,
        )
    return stop(
        EXIT_RESUME_ELSEWHERE,
        "exit 16: the step must be re-run on other hardware and no other device is "
        f"left on {state.host}",
        requeue=True,
        exclude=[state.host],
    )


def _failure_reason(result: CycleResult) -> str:
    first = result.failures[0]
    how = f"exit code {first.exit_code}" if first.exit_code is not None \
        else f"signal {first.signal}"
    reason = f"rank {first.rank} failed ({how})"
    # The ranks that failed after it (in their collective, most often) are its consequence.
    later = sorted({f.rank for f in result.failures[1:]} - {first.rank})
    if later:
        reason += f"; then rank{'s' if len(later) > 1 else ''} " \
                  f"{', '.join(map(str, later))} failed in consequence"
    return reason


def apply(decision: Decision, state: JobState) -> None:
    """Update the job state with what a decision implies."""
    if decision.progress is not None:
        state.last_iteration, state.cycles_without_progress = decision.progress
    if not decision.restart:
        return
    if decision.counted:
        state.restarts += 1
    if decision.rotate:
        state.rotation += 1
        state.rotations_left -= 1
    if decision.exclude_device is not None:
        state.excluded_devices.add(decision.exclude_device)
