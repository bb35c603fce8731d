"""The rerun state machine, with the public names of Megatron-Core's ``rerun_state_machine``.

Port Megatron code by changing one import::

    from megatron.core import rerun_state_machine           # before
    import rerun.rerun_state_machine as rerun_state_machine  # after

See the package docstring (``help(rerun)``) for a usage example, the verdicts and the exit
codes, and for where this machine deliberately differs from Megatron-Core 0.16.
"""

from __future__ import annotations

import importlib.util
import logging
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import tracker
from .components import (
    QuickStats,
    RerunDataIterator,
    RerunErrorInjector,
    SerializableStateType,
    compare_floats,
    same_batch,
    scalar,
    snapshot,
)
from .events import add_diagnosis_listener, emit, remove_diagnosis_listener
from .identity import current_device_identity, current_device_index, current_rank
from .types import (
    COMPARISON_MATCH,
    COMPARISON_MISMATCH,
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    Call,
    Caller,
    RerunDiagnostic,
    RerunMode,
    RerunState,
    RerunValidationStatus,
)

try:  # NumPy is optional: its RNG is saved and restored only when it is installed.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we test
    np = None

__all__ = [
    "COMPARISON_MATCH",
    "COMPARISON_MISMATCH",
    "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
    "Call",
    "Caller",
    "DataIteratorArgType",
    "QuickStats",
    "RerunDataIterator",
    "RerunDiagnostic",
    "RerunErrorInjector",
    "RerunMode",
    "RerunState",
    "RerunStateMachine",
    "RerunValidationStatus",
    "SerializableStateType",
    "add_diagnosis_listener",
    "current_device_identity",
    "destroy_rerun_state_machine",
    "get_rerun_state_machine",
    "initialize_rerun_state_machine",
    "remove_diagnosis_listener",
    "share_iterations_to_skip",
]

logger = logging.getLogger("rerun")

DataIteratorArgType = RerunDataIterator | list[RerunDataIterator] | None

#: Identifies our state dicts; bumped whenever their layout changes.
STATE_DICT_FORMAT = "ft-launcher.rerun"
STATE_DICT_VERSION = 2

#: Key of the per-rank part when Megatron's distributed checkpoint stores it.
SHARDED_KEY = "ft_rerun_state_machine_state"

_GLOBAL_RERUN_STATE_MACHINE: RerunStateMachine | None = None

# What should_checkpoint_and_exit answers once the machine has decided to stop the job,
# keyed by the state it stopped in: (checkpoint?, exit code).
_EXIT_ACTIONS: dict[RerunState, tuple[bool, int, str]] = {
    RerunState.RERUNNING_IN_PLACE: (
        True,
        EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
        "saving a checkpoint of the step's start for examination and exiting",
    ),
    RerunState.WILL_RERUN_FROM_CHECKPOINT: (
        True,
        EXIT_CODE_RESUME_TO_DISAMBIGUATE,
        "saving a checkpoint and exiting; resume it on another device to finish the diagnosis",
    ),
    RerunState.RERUNNING_FROM_CHECKPOINT: (
        False,
        EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
        "exiting; the checkpoint of the step already exists",
    ),
    RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT: (
        False,
        EXIT_CODE_RESUME_TO_DISAMBIGUATE,
        "exiting; resume the same checkpoint again, on another device",
    ),
}


@dataclass
class _Verdict:
    """This rank's conclusion about its rejected result in the current step."""

    diagnostic: RerunDiagnostic | None
    message: str
    fatal: bool


class RerunStateMachine:
    """Re-run suspicious steps to attribute a rejected result.

    Create it through ``initialize_rerun_state_machine``; each method's docstring says where
    the training loop calls it.

    Args:
        state_save_func: returns extra state to restore before a re-run (the Python, NumPy,
            torch CPU and, when initialised, CUDA RNG states are always saved).
        state_restore_func: restores what ``state_save_func`` returned.
        mode: DISABLED (default), VALIDATE_RESULTS or REPORT_DETERMINISM_STATS. The latter
            re-runs every step to measure non-determinism and suspends result validation.
        error_injector: injects rejected results, to exercise the machine.
        result_rejected_tracker_filename: file receiving one JSON line per rejected result.

    Steps are numbered from 1: ``current_iteration`` is the number of the step in progress
    (the last one started), 0 before the first. A job resuming from a plain checkpoint sets
    it to the number of completed steps before its first step, as Megatron-LM does.

    Assumption: a re-run of a step makes the same ``validate_result`` calls in the same order
    (the control flow is deterministic); the computed values may differ.
    """

    #: In REPORT_DETERMINISM_STATS mode, report the statistics every this many steps.
    REPORTING_INTERVAL_ITERATIONS: int = 2

    def __init__(
        self,
        state_save_func: Callable[[], Any] | None = None,
        state_restore_func: Callable[[Any], None] | None = None,
        mode: RerunMode = RerunMode.DISABLED,
        error_injector: RerunErrorInjector | None = None,
        result_rejected_tracker_filename: str | None = None,
    ) -> None:
        self.mode: RerunMode = _as_mode(mode)
        self.state: RerunState = RerunState.NOT_RUNNING_YET
        self.current_iteration: int = 0
        #: True once a step has gone through should_checkpoint_and_exit (Megatron's name);
        #: informative only: the first step is validated too.
        self.first_iteration_complete: bool = False
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.error_injector: RerunErrorInjector = error_injector or RerunErrorInjector()
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        if result_rejected_tracker_filename is not None:
            tracker.check_writable(result_rejected_tracker_filename)

        self.saved_state: dict[str, Any] | None = None
        self.validation_counts: dict[Caller, int] = defaultdict(int)
        # Replay buffers loaded from a checkpoint, handed to the iterators at the next step.
        self.data_iterator_checkpoints: list[SerializableStateType] | None = None
        self.large_value_counts: dict[str, int] = {}
        self.max_values: dict[str, float] = {}
        self.saved_results: dict[Call, Any] = {}
        self.stats: dict[str, QuickStats] = defaultdict(QuickStats)
        self.last_stats_report: dict[str, str] = {}
        self.logged_sdc_enabled: bool = False
        # Microbatches the checkpoint says the resumed step read in the first job, to check
        # that the loader resumed at the step's first sample.
        self._expected_microbatches: list[list[Any]] | None = None
        self._resume_checked: bool = False
        # Flag tensors reused by _reduce_any (one per length), and the pass handlers.
        self._flag_buffers: dict[int, torch.Tensor] = {}
        self._handlers: dict[RerunState, Callable[[list[RerunDataIterator]], bool]] = {
            RerunState.NOT_RUNNING_YET: self._start_step,
            RerunState.INITIAL_RUN: self._end_initial_run,
            RerunState.RERUNNING_IN_PLACE: self._end_rerun_in_place,
            RerunState.WILL_RERUN_FROM_CHECKPOINT: self._start_rerun_from_checkpoint,
            RerunState.RERUNNING_FROM_CHECKPOINT: self._end_rerun_from_checkpoint,
        }
        self._reset_step()
        logger.warning("rerun state machine initialised in mode %s", self.mode.name)

    # ----------------------------------------------------------------------------- mode
    def set_mode(self, mode: RerunMode) -> None:
        """Change the mode between steps (RuntimeError in the middle of a step)."""
        if self._pass_in_progress():
            raise RuntimeError(f"cannot change the rerun mode during a step ({self.state.name})")
        self.mode = _as_mode(mode)
        logger.warning("rerun state machine mode set to %s", self.mode.name)

    def get_mode(self) -> RerunMode:
        """The current mode."""
        return self.mode

    # ----------------------------------------------------------------------------- loop
    def should_run_forward_backward(self, data_iterator: DataIteratorArgType) -> bool:
        """Whether to run (again) the forward-backward pass of the current step.

        Args:
            data_iterator: the step's RerunDataIterator, a list of them, or None.

        Use it as the loop around the step's forward and backward passes::

            while machine.should_run_forward_backward(data_iterator):
                optimizer.zero_grad()
                loss = loss_fn(model(next(data_iterator)))
                machine.validate_result(loss, torch.isnan, "loss is NaN")
                loss.backward()
            # then should_checkpoint_and_exit(), then optimizer.step()

        A skipped step must still pass through this loop (e.g. one that only drains the data
        iterator, like Megatron-LM's ``dummy_train_step``) so the machine knows the step went
        by and the loader moves past the skipped samples.

        The data iterator must resume where the loop's checkpoint says (Megatron-LM: at the
        consumed-samples count of the completed steps): a step re-run from a checkpoint reads
        its microbatches from it, and they are checked against those the checkpoint recorded.
        """
        if self.mode == RerunMode.DISABLED:
            return self._disabled_pass(data_iterator)
        self.validation_counts = defaultdict(int)
        iterators = _sanitize_data_iterators(data_iterator)
        if self._exit_code is not None:
            raise RuntimeError(
                f"step {self.current_iteration}: the rerun state machine asked the job to exit "
                f"with code {self._exit_code}; call should_checkpoint_and_exit() after the loop "
                "and exit with the code it returns"
            )
        if not self._resume_checked:
            self._resume_checked = True
            self._check_resume_agreement()
        return self._handlers[self.state](iterators)

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """After the loop: ``(save a checkpoint?, exit?, exit code)``.

        Call it after the ``should_run_forward_backward`` loop and before the optimizer
        step; save the checkpoint (with this machine's ``state_dict``) when asked, then
        ``sys.exit(exit_code)`` when asked.
        """
        self.first_iteration_complete = True
        if self.mode != RerunMode.VALIDATE_RESULTS or self._exit_code is None:
            return False, False, 0
        checkpoint, code, what = _EXIT_ACTIONS[self.state]
        logger.warning("step %d: %s (exit code %d)", self.current_iteration, what, code)
        return checkpoint, True, code

    # ------------------------------------------------------------------------ validation
    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str,
        comparison_func: Callable[[Any, Any], float] | None = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Check ``result``; a rejected one starts the re-runs that attribute it.

        Args:
            result: the value to check, e.g. the loss (a 0-dim tensor).
            rejection_func: returns true for a bad result, e.g. ``torch.isnan``. If it
                raises, RuntimeError is raised (a broken check gives no verdict).
            message: names the check; it identifies the call across re-runs.
            comparison_func: relative difference of two results; default: scalars. A NaN
                answer counts as a mismatch.
            tolerance: largest difference still counted as "the same result".
            fatal: stop the job once the diagnosis is complete (else log and continue).

        In DISABLED mode a rejected result raises RuntimeError when fatal, else is logged.
        In REPORT_DETERMINISM_STATS mode nothing is rejected: the value's spread between
        the two runs of each step is recorded instead.
        """
        if not (tolerance >= 0.0):  # also refuses NaN
            raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
        if self.mode == RerunMode.DISABLED:
            self._validate_disabled(result, rejection_func, message, fatal)
            return
        if not self._pass_in_progress():
            raise RuntimeError(
                f"validate_result({message!r}) called outside the should_run_forward_backward "
                f"loop (state {self.state.name})"
            )
        compare = comparison_func or compare_floats
        call = self._validation_call(message)
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self._record_spread(call, result, compare)
            return
        if not self.logged_sdc_enabled:
            self.logged_sdc_enabled = True
            logger.warning("result validation enabled")
        if self.state == RerunState.INITIAL_RUN:
            self._check_initial_result(call, result, rejection_func, message, fatal)
        elif call == self.failed_validation_call and self._verdict is None:
            reproduced = self._reproduced(compare, result, tolerance, message)
            if self.state == RerunState.RERUNNING_IN_PLACE:
                self._judge_in_place(reproduced, result, message, fatal)
            else:
                self._judge_from_checkpoint(reproduced, result, message, fatal)

    def is_unexpectedly_large(
        self,
        result: Any,
        threshold: float,
        context: str,
        num_samples: int = 100,
        resample: bool = False,
    ) -> bool:
        """Whether ``|result|`` is at least ``threshold`` times the largest of its first
        ``num_samples`` values (a rejection function for spiky losses or gradients).

        Args:
            result: a scalar (0-dim tensor or number).
            threshold: the factor, e.g. 10.
            context: names the tracked value ("loss", "grad norm").
            num_samples: how many first values set the reference maximum.
            resample: start counting the first values again; the maximum seen so far is
                kept (as in Megatron-Core), so the reference never drops.

        NaN and infinity return False: check them with their own validation. Use it with
        ``functools.partial(machine.is_unexpectedly_large, threshold=10, context="loss")``.
        """
        if not (threshold > 0) or num_samples < 1:
            raise ValueError(
                f"threshold must be > 0 and num_samples >= 1, got {threshold!r}, {num_samples!r}"
            )
        value = abs(scalar(result))
        if value != value or value == float("inf"):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if self.large_value_counts[context] == num_samples:
                logger.info("reference maximum of %s: %g", context, self.max_values[context])
            return False
        return value >= self.max_values[context] * threshold

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(
        self, data_iterator: DataIteratorArgType, ckpt_format: str, force: bool = False
    ) -> dict[str, Any] | None:
        """What the checkpoint must hold to continue the diagnosis after a restart.

        Args:
            data_iterator: the iterators of the step; their microbatches are recorded so the
                resumed job can check its loader gives the same ones (it reads them from its
                loader, resumed at the step's first sample, as in Megatron-LM).
            ckpt_format: with ``"torch_dist"`` and Megatron-Core importable, the per-rank
                part (``"sharded"``) is a Megatron ``ShardedObject``, so Megatron's
                distributed checkpoint stores every rank's own copy; otherwise it is plain
                per-rank data (``torch.load(weights_only=True)`` reads it): save it per rank.
            force: also return a dict between steps (Megatron builds its load template so).

        Returns None between steps (unless ``force``, or ``"torch_dist"`` outside DISABLED
        mode, where Megatron-Core keeps the checkpoint's structure constant); raises
        RuntimeError in the middle of a step's pass, where no consistent state exists.
        """
        between_steps = self.state == RerunState.NOT_RUNNING_YET
        if between_steps and not force:
            if ckpt_format != "torch_dist" or self.mode == RerunMode.DISABLED:
                return None
        if self._pass_in_progress():
            raise RuntimeError(f"cannot checkpoint the rerun state during a pass ({self.state})")
        # Between steps nothing is replayed, and the iterator need not be wrapped (as in
        # Megatron-Core, which checks the wrapping only when a re-run is pending).
        iterators = (
            [] if data_iterator is None or between_steps
            else _sanitize_data_iterators(data_iterator)
        )
        buffers = [d.state_dict() for d in iterators] or None
        world = (
            torch.distributed.get_world_size()
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else None
        )
        return {
            "format": STATE_DICT_FORMAT,
            "version": STATE_DICT_VERSION,
            "mode": self.mode.value,
            "state": self.state.name,
            "current_iteration": self.current_iteration,
            "world_size": world,
            "sharded": _maybe_sharded(self._rank_state(buffers), ckpt_format, world),
        }

    def _rank_state(self, buffers: list[SerializableStateType] | None) -> dict[str, Any]:
        """This rank's part of the state dict (it differs between ranks)."""
        call = self.failed_validation_call
        return {
            "rank": current_rank(),
            "rerun_requested": self.rerun_requested,
            "checkpoint_requested": self.checkpoint_requested,
            "restart_again_requested": self.restart_again_requested,
            "continue_requested": self.continue_requested,
            "fail_requested": self.fail_requested,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": (
                None if call is None else [call.caller.message, call.caller.rank, call.sequence]
            ),
            "initial_result": self.initial_result,
            "failed_fatal": self.failed_fatal,
            "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "suspicious_device_identity": self.suspicious_device_identity,
            "data_iterator_checkpoints": buffers,
            "large_value_counts": dict(self.large_value_counts),
            "max_values": dict(self.max_values),
        }

    def validate_state_dict(self, state_dict: dict[str, Any] | None) -> bool:
        """True when ``state_dict`` holds a step to resume; never raises.

        False for None, an empty dict, a dict saved between steps (NOT_RUNNING_YET) and any
        dict this version did not write (one from Megatron-Core or an older format: the
        machine then starts fresh, with one warning).
        """
        if not isinstance(state_dict, dict) or not state_dict:
            return False
        problem = _format_problem(state_dict)
        if problem is not None:
            if _state_name(state_dict.get("state")) != RerunState.NOT_RUNNING_YET.name:
                logger.warning("rerun state in the checkpoint ignored, starting fresh: %s", problem)
            return False
        return state_dict["state"] != RerunState.NOT_RUNNING_YET.name

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict`` (ValueError when it is not one this version wrote, or
        when it was saved by another rank or with another world size).

        A pending diagnosis (exit 16) is resumed: the next step re-runs the suspicious step.
        A final verdict (exit 17) resumes plain training from that step's start.
        """
        problem = _format_problem(state_dict)
        if problem is not None:
            raise ValueError(problem)
        if self.mode == RerunMode.DISABLED:
            logger.warning("rerun state machine disabled: ignoring its state in the checkpoint")
            return
        try:
            sharded = _unwrap_sharded(state_dict["sharded"])
            _check_topology(state_dict, sharded)
            self._load_fields(state_dict, sharded)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed rerun state dict: {exc!r}") from exc

    @classmethod
    def get_skipped_iterations_from_tracker_file(cls, tracker_file_name: str) -> list[int]:
        """The 1-based steps rejected reproducibly at least twice on the same rank, except
        those more than one rank reported in one job (Megatron-Core's rule).

        A resubmitted job skips step ``n`` when ``n`` is in this list, ``n`` counting from 1
        (Megatron-LM: ``if iteration + 1 in iterations_to_skip``, ``iteration`` being the
        completed steps). Reads JSON lines and Megatron's ``key=value`` lines. Every rank must
        skip the same steps: pass the result through ``share_iterations_to_skip``.
        """
        return tracker.skipped_iterations(tracker_file_name)

    # ======================================================================== internals
    def _reset_step(self) -> None:
        """Forget every per-step flag and failure (a stale failure would misjudge a later
        re-run triggered by another rank)."""
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.fail_requested = False
        self.failed_validation_call: Call | None = None
        self.initial_result: Any = None
        self.failed_fatal: bool = True
        self.suspicious_node: str | None = None
        # Megatron's type: the device index. The identity (GPU UUID or FT_DEVICE_ID) is what
        # is compared, since the launcher may renumber devices between jobs.
        self.suspicious_device: int | None = None
        self.suspicious_device_identity: str | None = None
        self._verdict: _Verdict | None = None
        self._exit_code: int | None = None
        self._pending_step: int | None = None
        self.saved_results = {}
        self.error_injector.clear()

    def _pass_in_progress(self) -> bool:
        return self._exit_code is None and self.state in (
            RerunState.INITIAL_RUN,
            RerunState.RERUNNING_IN_PLACE,
            RerunState.RERUNNING_FROM_CHECKPOINT,
        )

    def _disabled_pass(self, data_iterator: DataIteratorArgType) -> bool:
        """DISABLED: one pass per step, no saved state, no collective."""
        if self.state == RerunState.INITIAL_RUN:
            self.state = RerunState.NOT_RUNNING_YET
            return False
        self.state = RerunState.INITIAL_RUN
        self.current_iteration += 1
        # Iterators recorded in an earlier mode would otherwise keep their buffers forever.
        items = data_iterator if isinstance(data_iterator, (list, tuple)) else (data_iterator,)
        for d in items:
            if isinstance(d, RerunDataIterator) and (d._recording or d.saved_microbatches):
                d._recording = False
                d.advance()
        return True

    def _start_step(self, iterators: list[RerunDataIterator]) -> bool:
        self._reset_step()
        self.current_iteration += 1
        self._prepare_iterators(iterators)
        self._save_state()
        self.state = RerunState.INITIAL_RUN
        return True

    def _end_initial_run(self, iterators: list[RerunDataIterator]) -> bool:
        self._check_resumed_input(iterators)
        # Both modes, as Megatron-Core: re-run when any rank validated (REPORT_DETERMINISM_STATS)
        # or rejected (VALIDATE_RESULTS) something; a step without validation runs once.
        rerun = self._reduce_any(self.rerun_requested)
        if not rerun:
            self.state = RerunState.NOT_RUNNING_YET
            return False
        if self.mode == RerunMode.VALIDATE_RESULTS:
            logger.warning(
                "step %d: re-running in place to check a rejected result", self.current_iteration
            )
        self.state = RerunState.RERUNNING_IN_PLACE
        self._rewind(iterators)
        return True

    def _end_rerun_in_place(self, iterators: list[RerunDataIterator]) -> bool:
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            self.state = RerunState.NOT_RUNNING_YET
            self._maybe_report_stats()
            self.saved_results = {}
            return False
        if self.failed_validation_call is not None and self._verdict is None:
            # The re-run never reached the rejected check: nothing was compared, so there is
            # no verdict and no tracker record (as in Megatron-Core); a fatal check still
            # stops the job.
            fatal = self.failed_fatal
            self._verdict = _Verdict(
                None,
                f"{self.failed_validation_call.caller.message}: the re-run did not reach the "
                "rejected check; no verdict" + ("" if fatal else ", continuing"),
                fatal,
            )
            self.fail_requested = fatal
            self.continue_requested = not fatal
        checkpoint, fail = self._reduce_any([self.checkpoint_requested, self.fail_requested])
        if checkpoint:
            self.state, self._exit_code = (
                RerunState.WILL_RERUN_FROM_CHECKPOINT,
                EXIT_CODE_RESUME_TO_DISAMBIGUATE,
            )
        elif fail:
            self._exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        else:
            self.state = RerunState.NOT_RUNNING_YET
        self._announce()
        if self._exit_code is not None:
            # The checkpoint about to be taken must capture the step's start.
            self._rewind(iterators)
        return False

    def _start_rerun_from_checkpoint(self, iterators: list[RerunDataIterator]) -> bool:
        self.validation_counts = defaultdict(int)
        self.restart_again_requested = self.continue_requested = self.fail_requested = False
        self._verdict = None
        if self._pending_step is not None:
            self.current_iteration = self._pending_step  # whatever the loop assigned since
        self._prepare_iterators(iterators)
        self._save_state()
        self.state = RerunState.RERUNNING_FROM_CHECKPOINT
        logger.warning(
            "step %d: re-running from the checkpoint to finish its diagnosis",
            self.current_iteration,
        )
        return True

    def _end_rerun_from_checkpoint(self, iterators: list[RerunDataIterator]) -> bool:
        self._check_resumed_input(iterators)
        unresolved = self.failed_validation_call is not None and self._verdict is None
        again, fail = self._reduce_any([self.restart_again_requested, self.fail_requested])
        if again:
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            self._exit_code = EXIT_CODE_RESUME_TO_DISAMBIGUATE
        elif fail:
            self._exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        else:
            self.state = RerunState.NOT_RUNNING_YET
            if unresolved:
                # The step was skipped (or took another path): without the rejected check
                # there is nothing to compare, so training goes on instead of exiting.
                self._verdict = _Verdict(
                    None,
                    "diagnosis abandoned: the rejected check did not run again when re-running "
                    "from the checkpoint (step skipped?); continuing",
                    False,
                )
        self._pending_step = None
        self._announce()
        return False

    # ------------------------------------------------------------------ judgement helpers
    def _check_initial_result(
        self,
        call: Call,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str,
        fatal: bool,
    ) -> None:
        if self.failed_validation_call is not None:
            return  # one rejected result per rank and step is enough to re-run it
        if not (
            self.error_injector.maybe_inject() or self._rejects(rejection_func, result, message)
        ):
            return
        self.failed_validation_call = call
        self.initial_result = snapshot(result)
        self.failed_fatal = fatal
        self.rerun_requested = True
        self._track(RerunValidationStatus.INITIAL_RUN, result, message)
        text = f"result {_short(result)} rejected ({message}), sequence {call.sequence}"
        logger.error("step %d rank %s: %s", self.current_iteration, current_rank(), text)
        emit(self._event(None, text, None, fatal))

    def _rejects(self, rejection_func: Callable[[Any], Any], result: Any, message: str) -> bool:
        try:
            verdict = rejection_func(result)
        except Exception as exc:
            raise RuntimeError(
                f"step {self.current_iteration}: rejection_func of {message!r} raised {exc!r}; "
                "no verdict is possible"
            ) from exc
        try:
            return bool(verdict)
        except Exception as exc:
            raise RuntimeError(
                f"rejection_func of {message!r} must return a bool or a one-element tensor, "
                f"got {type(verdict).__name__}"
            ) from exc

    def _reproduced(
        self, compare: Callable[[Any, Any], float], result: Any, tolerance: float, message: str
    ) -> bool:
        """Whether ``result`` matches the initial result within ``tolerance``."""
        try:
            raw = self.error_injector.maybe_miscompare(
                compare, self.initial_result, result, self.state
            )
            difference = float(raw)
        except Exception as exc:
            raise RuntimeError(
                f"step {self.current_iteration}: comparison_func of {message!r} failed: {exc!r}"
            ) from exc
        if difference != difference:
            logger.warning(
                "step %d: comparison of %r returned NaN: counted as a mismatch",
                self.current_iteration,
                message,
            )
            return False
        return difference <= tolerance

    def _judge_in_place(self, reproduced: bool, result: Any, message: str, fatal: bool) -> None:
        if not reproduced:
            status = RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE
            how = (
                f"not reproduced on the same device ({_short(result)} vs "
                f"{_short(self.initial_result)})"
            )
            self._verdict = _Verdict(RerunDiagnostic.TRANSIENT_ERROR, f"{message}: {how}", fatal)
            self.fail_requested = fatal
            self.continue_requested = not fatal
        else:
            status = RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE
            self.suspicious_node, self.suspicious_device_identity = current_device_identity()
            self.suspicious_device = current_device_index()
            need = "needs a re-run on another device" if fatal else "not fatal, continuing"
            self._verdict = _Verdict(
                None, f"{message}: reproduced on the same device ({_short(result)}); {need}", fatal
            )
            self.checkpoint_requested = fatal
            self.continue_requested = not fatal
        self._track(status, result, message)

    def _judge_from_checkpoint(
        self, reproduced: bool, result: Any, message: str, fatal: bool
    ) -> None:
        here = current_device_identity()
        if here == (self.suspicious_node, self.suspicious_device_identity):
            self._verdict = _Verdict(
                None,
                f"{message}: resumed on the suspicious device {here[0]}/{here[1]} again; "
                "resume again elsewhere",
                fatal,
            )
            self.restart_again_requested = True
            return
        if reproduced:
            status, diagnostic = (
                RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE,
                RerunDiagnostic.CORRECT_RESULT,
            )
            how = "reproduced on another device: the result is what the input gives"
        else:
            status, diagnostic = (
                RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE,
                RerunDiagnostic.PERSISTENT_ERROR,
            )
            how = (
                f"not reproduced on another device ({_short(result)} vs "
                f"{_short(self.initial_result)}): the suspicious device computes wrong"
            )
        self._verdict = _Verdict(diagnostic, f"{message}: {how}", fatal)
        self.fail_requested = fatal
        self.continue_requested = not fatal
        self._track(status, result, message)

    def _announce(self) -> None:
        """Log and publish this rank's verdict, or the exit another rank's verdict causes."""
        verdict = self._verdict
        if verdict is None:
            if self._exit_code is None:
                return
            verdict = _Verdict(None, "stopping on another rank's verdict", True)
        level = logging.ERROR if verdict.fatal else logging.WARNING
        name = verdict.diagnostic.name if verdict.diagnostic else "no verdict yet"
        logger.log(
            level,
            "step %d rank %s: %s: %s (next state %s, exit code %s)",
            self.current_iteration,
            current_rank(),
            name,
            verdict.message,
            self.state.name,
            self._exit_code,
        )
        emit(self._event(verdict.diagnostic, verdict.message, self._exit_code, verdict.fatal))

    def _event(
        self, diagnostic: RerunDiagnostic | None, message: str, exit_code: int | None, fatal: bool
    ) -> dict[str, Any]:
        host, device = current_device_identity()
        return {
            "state": self.state.name,
            "diagnostic": diagnostic.name if diagnostic else None,
            "iteration": self.current_iteration,
            "message": message,
            "exit_code": exit_code,
            "fatal": bool(fatal),
            "host": host,
            "device": device,
            "rank": current_rank(),
            "suspicious_host": self.suspicious_node,
            "suspicious_device": self.suspicious_device_identity,
        }

    def _validate_disabled(
        self, result: Any, rejection_func: Callable[[Any], Any], message: str, fatal: bool
    ) -> None:
        """DISABLED still checks, as Megatron does: raise when fatal, else log."""
        if not self._rejects(rejection_func, result, message):
            return
        self._track(RerunValidationStatus.RERUN_DISABLED, result, message)
        host, device = current_device_identity()
        text = (
            f"rank {current_rank()}, node {host}, device {device}, step "
            f"{self.current_iteration}: unexpected result {_short(result)} ({message})"
        )
        emit(self._event(None, text, None, fatal))
        if fatal:
            raise RuntimeError(text)
        logger.warning(text)

    def _record_spread(self, call: Call, result: Any, compare: Callable[[Any, Any], float]) -> None:
        """REPORT_DETERMINISM_STATS: keep the first value, measure the re-run's against it."""
        if self.state == RerunState.INITIAL_RUN:
            self.saved_results[call] = snapshot(result)
            self.rerun_requested = True
            return
        if call not in self.saved_results:
            raise RuntimeError(
                f"step {self.current_iteration}: the re-run made validation call {call} that "
                "the first run did not: the step's control flow is not deterministic"
            )
        difference = float(compare(self.saved_results[call], result))
        if difference != difference:
            difference = COMPARISON_MISMATCH  # NaN has no place in a distribution
        self.stats[call.caller.message].record(difference)

    def _maybe_report_stats(self) -> None:
        """Every REPORTING_INTERVAL_ITERATIONS steps, log the spreads gathered on rank 0."""
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        stats = dict(self.stats)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            gathered: list[Any] | None = (
                [None] * torch.distributed.get_world_size() if rank == 0 else None
            )
            torch.distributed.gather_object(stats, gathered, dst=0)
            if rank != 0:
                for s in self.stats.values():
                    s.reset()  # rank 0 holds them now
                return
            for other in (gathered or [])[1:]:
                for message, s in (other or {}).items():
                    self.stats[message].combine([s])
        self.last_stats_report = {m: s.print_stats() for m, s in sorted(self.stats.items())}
        for message, line in self.last_stats_report.items():
            logger.info("step %d determinism of %r: %s", self.current_iteration, message, line)

    def _validation_call(self, message: str) -> Call:
        caller = Caller(message=message, rank=current_rank() or 0)
        self.validation_counts[caller] += 1
        return Call(caller=caller, sequence=self.validation_counts[caller])

    def _track(self, status: RerunValidationStatus, result: Any, message: str) -> None:
        if self.result_rejected_tracker_filename is None:
            return
        host, device = current_device_identity()
        tracker.append_record(
            self.result_rejected_tracker_filename,
            node=host,
            device=device,
            rank=current_rank(),
            iteration=self.current_iteration,
            status=status,
            result=result,
            message=message,
        )

    # ------------------------------------------------------------- collective and state
    def _reduce_any(self, value: bool | list[bool]) -> Any:
        """Logical OR across the world when torch.distributed is initialised."""
        values = value if isinstance(value, list) else [value]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            device = _collective_device()
            flags = self._flag_buffers.get(len(values))
            if flags is None or flags.device.type != device:
                flags = torch.zeros(len(values), dtype=torch.int32, device=device)
                self._flag_buffers[len(values)] = flags
            if device == "cpu":
                flags.numpy()[:] = values  # no tensor construction on the hot path
            else:
                flags.copy_(torch.tensor(values, dtype=torch.int32))
            torch.distributed.all_reduce(flags)
            values = [x > 0 for x in flags.tolist()]
        return values if isinstance(value, list) else values[0]

    def _prepare_iterators(self, iterators: list[RerunDataIterator]) -> None:
        """Start a step's buffers, empty and recording. Microbatches a checkpoint recorded
        for this step are kept aside to check the loader against, never replayed: the loop
        resumes its loader at the step's first sample (Megatron-LM: consumed samples), so a
        replay would train those samples twice."""
        pending, self.data_iterator_checkpoints = self.data_iterator_checkpoints, None
        if pending is not None:
            if len(pending) != len(iterators):
                raise ValueError(
                    f"the checkpoint holds {len(pending)} data iterator states but "
                    f"{len(iterators)} data iterators were passed"
                )
            self._expected_microbatches = [
                list((state or {}).get("saved_microbatches") or []) for state in pending
            ]
        for d in iterators:
            d.advance()
            d._recording = True

    def _check_resumed_input(self, iterators: list[RerunDataIterator]) -> None:
        """After the first pass of a resumed step: did the loader give the microbatches the
        checkpoint recorded? If not, it did not resume at the step's first sample, and a
        verdict would compare results of different inputs: say so loudly."""
        expected, self._expected_microbatches = self._expected_microbatches, None
        if not expected:
            return
        for index, (d, saved) in enumerate(zip(iterators, expected, strict=True)):
            read = d.saved_microbatches
            if not saved:
                continue
            if len(read) != len(saved) or not all(
                same_batch(a, b) for a, b in zip(read, saved, strict=False)
            ):
                text = (
                    f"step {self.current_iteration}: data iterator {index} gave other "
                    f"microbatches ({len(read)}) than the first run of the step recorded "
                    f"({len(saved)}): resume the loader at the step's first sample (the "
                    "consumed samples of the completed steps); a verdict now compares "
                    "different inputs"
                )
                logger.error(text)
                if self._verdict is not None:
                    self._verdict.message += " (WARNING: the re-run read other input)"
                emit(self._event(None, text, None, False))
                return

    def _check_resume_agreement(self) -> None:
        """First step of a job: every rank must resume the same diagnosis or none.

        A rank whose per-rank state was not restored (a checkpoint written by rank 0 only,
        or another rank's state refused) would otherwise run a plain step while the others
        re-run, and their collectives would not match. One all-reduce, once per job.
        """
        if self.mode == RerunMode.DISABLED:
            return
        pending = self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
        some, not_all = self._reduce_any([pending, not pending])
        if not (some and not_all) or not pending:
            if some and not_all:
                logger.error(
                    "rank %s: other ranks resumed a pending rerun diagnosis this rank did not "
                    "restore; all ranks drop it",
                    current_rank(),
                )
            return
        logger.error(
            "step %d rank %s: the pending rerun diagnosis was not restored on every rank "
            "(save the rerun state per rank: ckpt_format='torch_dist' with Megatron-Core, or "
            "one file per rank); dropped, the step runs as a plain step",
            self._pending_step or self.current_iteration,
            current_rank(),
        )
        step = self._pending_step or self.current_iteration
        self._reset_step()
        self._expected_microbatches = None
        self.data_iterator_checkpoints = None
        self.current_iteration = step - 1
        self.state = RerunState.NOT_RUNNING_YET

    def _rewind(self, iterators: list[RerunDataIterator]) -> None:
        self._restore_state()
        for d in iterators:
            d.rewind()

    def _save_state(self) -> None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.saved_state = {
            "random": random.getstate(),
            "numpy": np.random.get_state() if np is not None else None,
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if cuda else None,
            "other": self.state_save_func() if self.state_save_func else None,
        }

    def _restore_state(self) -> None:
        saved = self.saved_state
        if saved is None:
            raise RuntimeError("no saved state to restore: the step was not started")
        random.setstate(saved["random"])
        if saved["numpy"] is not None:
            np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state_all(saved["cuda"])
        if saved["other"] is not None and self.state_restore_func is not None:
            self.state_restore_func(saved["other"])

    def _load_fields(self, state_dict: dict[str, Any], sharded: dict[str, Any]) -> None:
        saved_state = RerunState[state_dict["state"]]
        self._reset_step()
        self.current_iteration = int(state_dict["current_iteration"])
        self.error_injector.load_state_dict(sharded["error_injector_checkpoint"])
        self.large_value_counts = dict(sharded["large_value_counts"])
        self.max_values = dict(sharded["max_values"])
        self.data_iterator_checkpoints = sharded["data_iterator_checkpoints"]
        for flag in (
            "rerun_requested",
            "checkpoint_requested",
            "restart_again_requested",
            "continue_requested",
            "fail_requested",
        ):
            setattr(self, flag, bool(sharded.get(flag, False)))
        if saved_state == RerunState.NOT_RUNNING_YET:
            self.state = saved_state
            logger.info("rerun state loaded: %d steps done", self.current_iteration)
            return
        if saved_state in (
            RerunState.WILL_RERUN_FROM_CHECKPOINT,
            RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT,
        ):
            message, rank, sequence = sharded["failed_validation_call"] or (None, None, None)
            if message is not None:
                self.failed_validation_call = Call(Caller(str(message), int(rank)), int(sequence))
            self.initial_result = sharded["initial_result"]
            self.failed_fatal = bool(sharded["failed_fatal"])
            self.suspicious_node = sharded["suspicious_node"]
            device = sharded["suspicious_device"]
            self.suspicious_device = None if device is None else int(device)
            self.suspicious_device_identity = sharded["suspicious_device_identity"]
            self._pending_step = self.current_iteration
            # A diagnosis in flight can only be finished by validating.
            self.mode = RerunMode.VALIDATE_RESULTS
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            logger.warning(
                "rerun state loaded: step %d will be re-run to finish its diagnosis",
                self.current_iteration,
            )
            return
        # A final verdict (exit 17): the step runs again as a plain step, validated as usual.
        self.current_iteration -= 1
        self.state = RerunState.NOT_RUNNING_YET
        logger.warning(
            "rerun state loaded after a final verdict at step %d: running it again",
            self.current_iteration + 1,
        )


# =============================================================================== helpers
def _as_mode(mode: Any) -> RerunMode:
    try:
        return RerunMode(mode)
    except ValueError as exc:
        raise ValueError(f"unknown rerun mode {mode!r}") from exc


def _short(value: Any) -> str:
    """A compact text form of a result for log lines."""
    try:
        if hasattr(value, "numel") and value.numel() == 1:
            return f"{scalar(value):.6g}"
    except Exception:  # exotic result: fall back to repr
        pass
    return repr(value)[:80]


def _sanitize_data_iterators(data_iterator: DataIteratorArgType) -> list[RerunDataIterator]:
    if data_iterator is None:
        return []
    items = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    items = [d for d in items if d is not None]
    for d in items:
        if not isinstance(d, RerunDataIterator):
            raise TypeError(
                f"data iterators must be wrapped in RerunDataIterator, got {type(d).__name__}"
            )
    return items


def _state_name(state: Any) -> str | None:
    """A state as saved by us (its name) or by Megatron-Core (its enum) -> its name."""
    return getattr(state, "name", state) if state is not None else None


def _format_problem(state_dict: Any) -> str | None:
    """Why ``state_dict`` is not one this version wrote, or None if it is."""
    if not isinstance(state_dict, dict):
        return f"rerun state dict must be a dict, got {type(state_dict).__name__}"
    fmt, version = state_dict.get("format"), state_dict.get("version")
    if fmt != STATE_DICT_FORMAT:
        hint = " (it looks like Megatron-Core's)" if "sharded" in state_dict else ""
        return f"not a {STATE_DICT_FORMAT} state dict{hint}: format={fmt!r}"
    if version != STATE_DICT_VERSION:
        return (
            f"rerun state dict version {version!r} is not supported "
            f"(expected {STATE_DICT_VERSION})"
        )
    if state_dict.get("state") not in RerunState.__members__:
        return f"rerun state dict holds unknown state {state_dict.get('state')!r}"
    return None


def _sharded_object_class() -> Any:
    """Megatron-Core's ShardedObject when Megatron-Core is importable, else None."""
    try:
        if importlib.util.find_spec("megatron.core") is None:
            return None
        from megatron.core.dist_checkpointing.mapping import ShardedObject
    except Exception:  # not installed, or broken: plain per-rank data then
        return None
    return ShardedObject


def _maybe_sharded(part: dict[str, Any], ckpt_format: str, world: int | None) -> Any:
    """Wrap the per-rank part for Megatron's distributed checkpoint (``torch_dist``): one
    shard per rank, so each rank stores and loads its own copy."""
    if ckpt_format != "torch_dist":
        return part
    sharded_object = _sharded_object_class()
    if sharded_object is None:
        return part
    rank = current_rank() or 0
    return sharded_object(SHARDED_KEY, part, (world or 1,), (rank,))


def _unwrap_sharded(sharded: Any) -> dict[str, Any]:
    """The per-rank dict, also when still wrapped in a ShardedObject (loaded in-process)."""
    data = getattr(sharded, "data", sharded) if hasattr(sharded, "global_offset") else sharded
    if not isinstance(data, dict):
        raise ValueError(f"malformed rerun state dict: per-rank part is {type(data).__name__}")
    return data


def _check_topology(state_dict: dict[str, Any], sharded: dict[str, Any]) -> None:
    """A per-rank state loaded by another rank would attribute another rank's result."""
    rank, saved_rank = current_rank(), sharded.get("rank")
    if saved_rank is not None and (rank or 0) != saved_rank:
        raise ValueError(f"rerun state dict was saved by rank {saved_rank}, loaded by {rank}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world, saved_world = torch.distributed.get_world_size(), state_dict.get("world_size")
        if saved_world is not None and saved_world != world:
            raise ValueError(
                f"rerun state dict was saved with world size {saved_world}, loaded with {world}"
            )


def _collective_device() -> str:
    """Where a collective's tensor must live: gloo reduces CPU tensors, NCCL CUDA ones."""
    backend = str(torch.distributed.get_backend())
    return "cpu" if "gloo" in backend or not torch.cuda.is_available() else "cuda"


def share_iterations_to_skip(iterations: list[int], src: int = 0) -> list[int]:
    """Rank ``src``'s list of steps to skip, on every rank (sorted, without duplicates).

    Ranks that each read the tracker file can disagree (a node with a stale view of a shared
    file, a line appended between two reads), and ranks that skip different steps run
    mismatched collectives. Call it on every rank once torch.distributed is initialised;
    without it, it returns the sorted list unchanged. In Megatron-LM, one line at the start
    of ``train()``::

        args.iterations_to_skip = rerun_state_machine.share_iterations_to_skip(
            args.iterations_to_skip)

    Tensors, not ``broadcast_object_list``: no pickle crosses the wire.
    """
    steps = sorted({int(i) for i in iterations})
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return steps
    device = _collective_device()
    count = torch.tensor([len(steps)], dtype=torch.long, device=device)
    torch.distributed.broadcast(count, src=src)
    mine = steps if torch.distributed.get_rank() == src else [0] * int(count.item())
    values = torch.tensor(mine, dtype=torch.long, device=device)
    if int(count.item()) > 0:
        torch.distributed.broadcast(values, src=src)
    shared = [int(v) for v in values.tolist()]
    if shared != steps:
        logger.warning(
            "rank %s: steps to skip %s replaced by rank %d's %s", current_rank(), steps, src, shared
        )
    return shared


# ============================================================================ singleton
def initialize_rerun_state_machine(**kwargs: Any) -> None:
    """Create the process-wide machine; kwargs as for RerunStateMachine."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is not None:
        raise RuntimeError(
            "rerun state machine already initialised; call destroy_rerun_state_machine() first"
        )
    _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine(**kwargs)


def destroy_rerun_state_machine() -> None:
    """Drop the process-wide machine."""
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = None


def get_rerun_state_machine() -> RerunStateMachine:
    """The process-wide machine, created DISABLED (with a warning) when none exists."""
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        logger.warning("rerun state machine used before initialisation: creating a DISABLED one")
        initialize_rerun_state_machine()
    assert _GLOBAL_RERUN_STATE_MACHINE is not None
    return _GLOBAL_RERUN_STATE_MACHINE
