"""The machine's helpers: the replaying data iterator, the statistics, the error injector
and the default comparison of results."""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .identity import current_rank
from .types import COMPARISON_MATCH, COMPARISON_MISMATCH, RerunDiagnostic, RerunState

logger = logging.getLogger("rerun")

SerializableStateType = dict[str, Any]


def snapshot(obj: Any) -> Any:
    """A copy of a microbatch that later in-place edits of ``obj`` cannot reach.

    Tensors are cloned (detached: a batch is an input, not part of a graph); containers are
    copied element by element; anything else is deep-copied.
    """
    if isinstance(obj, torch.Tensor):
        copied = obj.detach().clone()
        if obj.requires_grad and obj.is_leaf:
            copied.requires_grad_(True)
        return copied
    if isinstance(obj, dict):
        new = copy.copy(obj)
        for key, value in obj.items():
            new[key] = snapshot(value)
        return new
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        items = [snapshot(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def scalar(value: Any) -> float:
    """``float(value)``; a tensor is detached first (no autograd warning for a loss)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
    return float(value)


def same_batch(a: Any, b: Any) -> bool:
    """Whether two microbatches hold the same data (tensors: same dtype, shape and values,
    NaN equal to NaN); True when they cannot be compared, so only a proven difference
    counts."""
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return False
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            a, b = a.detach().cpu(), b.detach().cpu()
            if a.is_floating_point() or a.is_complex():
                nan_a, nan_b = a.isnan(), b.isnan()
                zero = torch.zeros((), dtype=a.dtype)
                return bool(torch.equal(nan_a, nan_b)) and bool(
                    torch.equal(torch.where(nan_a, zero, a), torch.where(nan_b, zero, b))
                )
            return bool(torch.equal(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same_batch(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b, strict=True))
        return bool(a == b)
    except Exception:  # exotic batch types: no proof of a difference
        return True


class RerunDataIterator:
    """Wrap a data iterator so the machine can replay the microbatches of the current step.

    While the machine records (every mode except DISABLED), each microbatch read is kept as a
    private copy; ``rewind`` replays those copies, each time as a fresh copy, so a model that
    edits its input in place cannot change what the re-run sees.

    Example::

        data_iterator = RerunDataIterator(iter(my_loader))
        while machine.should_run_forward_backward(data_iterator):
            batch = next(data_iterator)
    """

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iter(iterable)
        self.saved_microbatches: list[Any] = []
        self.replaying: bool = False
        self.replay_pos: int = 0
        # Set by the machine at the start of each step; off in DISABLED mode so that mode
        # costs nothing and keeps no buffer.
        self._recording: bool = False

    def __iter__(self) -> RerunDataIterator:
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError(
                    f"the re-run asked for microbatch {self.replay_pos + 1} but the step read "
                    f"only {len(self.saved_microbatches)}: the step's control flow is not "
                    "deterministic"
                )
            batch = snapshot(self.saved_microbatches[self.replay_pos])
            self.replay_pos += 1
            return batch
        batch = next(self.iterable)
        if self._recording:
            self.saved_microbatches.append(snapshot(batch))
        return batch

    def rewind(self) -> None:
        """Replay the step's microbatches from the first one."""
        self.replaying = True
        self.replay_pos = 0

    def advance(self) -> None:
        """Drop the step's microbatches and read new ones from the wrapped iterator."""
        self.replaying = False
        self.replay_pos = 0
        self.saved_microbatches = []

    def state_dict(self) -> SerializableStateType:
        """The replay buffer and position, for the checkpoint of a step to re-run."""
        return {
            "saved_microbatches": list(self.saved_microbatches),
            "replaying": self.replaying,
            "replay_pos": self.replay_pos,
        }

    def load_state_dict(self, state_dict: SerializableStateType) -> None:
        """Restore what ``state_dict`` returned; raise ValueError for anything else."""
        missing = {"saved_microbatches", "replaying", "replay_pos"} - set(state_dict or {})
        if missing:
            raise ValueError(f"not a RerunDataIterator state dict: missing {sorted(missing)}")
        self.saved_microbatches = list(state_dict["saved_microbatches"])
        self.replaying = bool(state_dict["replaying"])
        self.replay_pos = int(state_dict["replay_pos"])
        self._recording = False


@dataclass
class QuickStats:
    """The distribution of one non-negative statistic (the spread between re-runs).

    Zeros (bit-identical re-runs) are only counted; other values are kept, up to
    ``max_size`` of them, oldest overwritten first. A dataclass, so it pickles for
    ``torch.distributed.gather_object``.
    """

    max_size: int = 100000
    samples: list[float] = field(default_factory=list)
    pos: int = 0
    zero_cnt: int = 0
    max: float = 0.0

    def record(self, data: float) -> None:
        """Add one sample; NaN is refused (ValueError) because no order holds it."""
        value = float(data)
        if math.isnan(value):
            raise ValueError("QuickStats cannot record NaN")
        if value == 0.0:
            self.zero_cnt += 1
            return
        if len(self.samples) < self.max_size:
            self.samples.append(value)
        else:
            self.samples[self.pos % self.max_size] = value
        self.pos += 1
        self.max = max(self.max, value)

    def combine(self, others: list[QuickStats]) -> None:
        """Fold the samples of ``others`` into this one, keeping at most ``max_size``."""
        for other in others:
            room = self.max_size - len(self.samples)
            self.samples.extend(other.samples[:room])
            self.pos += len(other.samples)
            self.zero_cnt += other.zero_cnt
            self.max = max(self.max, other.max)

    def reset(self) -> None:
        """Forget every sample."""
        self.samples = []
        self.pos = 0
        self.zero_cnt = 0
        self.max = 0.0

    def print_stats(self) -> str:
        """One line describing the distribution, zeros included in the percentiles."""
        n = len(self.samples)
        if n == 0:
            return f"{self.zero_cnt:,} samples, all identical"
        total = self.zero_cnt + n
        ordered = sorted(self.samples)

        def percentile(p: float) -> float:
            # Nearest rank over zeros followed by the sorted non-zero samples.
            index = min(total - 1, int(p * total))
            return 0.0 if index < self.zero_cnt else ordered[index - self.zero_cnt]

        average = sum(ordered) / total
        parts = ", ".join(
            f"{name}= {percentile(p):.3E}"
            for name, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999))
        )
        return (
            f"{total:,}/{self.zero_cnt:,} total/identical samples, rel. variability: "
            f"avg= {average:.3E}, {parts}, max: {self.max:.3E}"
        )


class RerunErrorInjector:
    """Inject rejected results to exercise the machine, about one in ``error_injection_rate``.

    The injected type decides how the re-runs compare: TRANSIENT_ERROR mismatches in place;
    PERSISTENT_ERROR matches in place and mismatches on the other device; CORRECT_RESULT
    matches both times.
    """

    def __init__(
        self,
        error_injection_rate: int = 0,
        error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR,
    ) -> None:
        if not isinstance(error_injection_type, RerunDiagnostic):
            raise ValueError(
                f"error_injection_type must be a RerunDiagnostic, got {error_injection_type!r}"
            )
        if isinstance(error_injection_rate, bool) or not isinstance(error_injection_rate, int):
            raise ValueError(f"error_injection_rate must be an int, got {error_injection_rate!r}")
        if error_injection_rate < 0:
            raise ValueError(f"error_injection_rate must be >= 0, got {error_injection_rate}")
        self.error_injection_rate: int = error_injection_rate
        self.error_injection_type: RerunDiagnostic = error_injection_type
        self.should_inject_errors: bool = error_injection_rate > 0
        # The type of the injection in flight, until the re-runs have consumed it.
        self.injected_error_type: RerunDiagnostic | None = None

    def maybe_inject(self) -> bool:
        """Decide whether to reject the current result; at most one injection in flight."""
        if not self.should_inject_errors or self.injected_error_type is not None:
            return False
        # Offset by rank so that ranks sharing an RNG seed do not all inject together.
        draw = random.randrange(self.error_injection_rate) + (current_rank() or 0)
        if draw % self.error_injection_rate != 0:
            return False
        self.injected_error_type = self.error_injection_type
        logger.warning("injecting a rejected result of type %s", self.error_injection_type.name)
        return True

    def maybe_miscompare(
        self,
        comparison_func: Callable[[Any, Any], float],
        initial_result: Any,
        result: Any,
        state: RerunState,
    ) -> float:
        """Compare with ``comparison_func``, or fake the outcome an injection calls for."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        if state == RerunState.RERUNNING_FROM_CHECKPOINT:
            self.injected_error_type = None
            if injected == RerunDiagnostic.PERSISTENT_ERROR:
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        raise RuntimeError(f"maybe_miscompare called in state {state.name}")

    def clear(self) -> None:
        """Drop an injection the re-runs did not consume (the step ended without one)."""
        self.injected_error_type = None

    def state_dict(self) -> SerializableStateType:
        """Rate, type and the injection in flight."""
        return {
            "error_injection_rate": self.error_injection_rate,
            "error_injection_type": self.error_injection_type.value,
            "injected_error_type": (
                self.injected_error_type.value if self.injected_error_type else None
            ),
        }

    def load_state_dict(self, state_dict: SerializableStateType) -> None:
        """Restore what ``state_dict`` returned; raise ValueError for anything else."""
        try:
            rate = int(state_dict["error_injection_rate"])
            kind = RerunDiagnostic(state_dict["error_injection_type"])
            injected = state_dict["injected_error_type"]
            injected = RerunDiagnostic(injected) if injected is not None else None
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a RerunErrorInjector state dict: {exc!r}") from exc
        self.error_injection_rate = rate
        self.error_injection_type = kind
        self.should_inject_errors = rate > 0
        self.injected_error_type = injected


def compare_floats(a: Any, b: Any) -> float:
    """Default comparison of two scalar results (0-dim tensors or numbers).

    Returns COMPARISON_MATCH when equal (NaN equals NaN), COMPARISON_MISMATCH when exactly
    one is NaN or they are unequal infinities, else the symmetric relative difference
    ``2|a-b| / (|a|+|b|)``, which is finite for ``a == -b`` (it is 2).
    """
    af, bf = scalar(a), scalar(b)
    if af == bf or (math.isnan(af) and math.isnan(bf)):
        return COMPARISON_MATCH
    if math.isnan(af) or math.isnan(bf) or math.isinf(af) or math.isinf(bf):
        return COMPARISON_MISMATCH
    # Scale by the larger magnitude first so huge values cannot overflow to inf/inf; not
    # both are zero (they would be equal), so the scale is positive.
    scale = max(math.fabs(af), math.fabs(bf))
    a1, b1 = af / scale, bf / scale
    return 2.0 * math.fabs(a1 - b1) / (math.fabs(a1) + math.fabs(b1))
