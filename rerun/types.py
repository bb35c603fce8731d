"""Enums, named tuples and constants shared by the rerun package.

The names and values match Megatron-Core's ``rerun_state_machine`` module so that code and
logs written for it keep working.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple

#: Exit code asking the scheduler to resume the job from the last checkpoint on other hardware.
EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16

#: Exit code of a job whose result failed validation and whose diagnosis is final.
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17

#: What a comparison function returns for two results it considers identical.
COMPARISON_MATCH: float = 0.0

#: What a comparison function returns for two results it considers different.
COMPARISON_MISMATCH: float = math.inf


class Caller(NamedTuple):
    """Where ``validate_result`` was called from: its message and the calling rank."""

    message: str
    rank: int


class Call(NamedTuple):
    """One call of ``validate_result``: the caller and its 1-based sequence number in a pass."""

    caller: Caller
    sequence: int


class RerunDiagnostic(str, Enum):
    """The attribution of a rejected result.

    CORRECT_RESULT: another device computes the same result, so it is what the input gives.
    TRANSIENT_ERROR: re-running on the same device gives another result.
    PERSISTENT_ERROR: the same device reproduces the result, another device does not.
    """

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    """How the machine runs each step."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(Enum):
    """The six states of the machine.

    NOT_RUNNING_YET: between steps.
    INITIAL_RUN: during the first pass of a step.
    RERUNNING_IN_PLACE: during the re-run on the same device; stays there after the loop when
        a transient error is fatal (exit 17).
    WILL_RERUN_FROM_CHECKPOINT: the re-run reproduced the rejected result; the job checkpoints,
        exits 16 and, once resumed, re-runs the step on another device.
    RERUNNING_FROM_CHECKPOINT: during the re-run of the resumed job; stays there after the loop
        when the final verdict is fatal (exit 17).
    RERUNNING_AGAIN_FROM_CHECKPOINT: the resumed job landed on the suspicious device again and
        must be resumed once more from the same checkpoint (exit 16).
    """

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunValidationStatus(str, Enum):
    """The status written to the tracker file for each rejected result."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"
