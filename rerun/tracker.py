"""The result-rejected tracker file: one JSON object per line, per rejected result.

Fields: ``ts`` (unix seconds), ``node``, ``device``, ``job_id``, ``rank``, ``iteration``
(1-based step), ``status`` (a RerunValidationStatus name), ``result`` (text) and ``message``.
JSON rather than Megatron's ``key=value`` text so a message holding spaces or quotes cannot
corrupt the line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from typing import Any

from .types import RerunValidationStatus

logger = logging.getLogger("rerun")

# A result rejected with one of these statuses was reproduced where it was computed; seen
# twice for the same rank and step, the step's input itself is suspect and can be skipped.
_REPRODUCED_STATUSES = frozenset(
    {
        RerunValidationStatus.RERUN_DISABLED.name,
        RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE.name,
        RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE.name,
    }
)


def check_writable(path: str) -> None:
    """Raise RuntimeError now, at start-up, if ``path`` cannot be appended to."""
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise RuntimeError(f"rerun tracker file {path!r} cannot be appended to: {exc}") from exc


def append_record(
    path: str,
    *,
    node: str,
    device: str,
    rank: int | None,
    iteration: int,
    status: RerunValidationStatus,
    result: Any,
    message: str,
) -> None:
    """Append one record; an I/O error is logged, never raised into training."""
    record = {
        "ts": round(time.time(), 3),
        "node": node,
        "device": device,
        "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID"),
        "rank": rank if rank is not None else 0,
        "iteration": iteration,
        "status": status.name,
        "result": _result_text(result),
        "message": message,
    }
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as exc:
        logger.error("could not append to tracker file %s: %s", path, exc)


def _result_text(result: Any) -> str:
    """A short text form of a result (a 0-dim tensor becomes its number)."""
    try:
        if hasattr(result, "numel") and result.numel() == 1:
            return repr(float(result))
    except Exception:  # an exotic result type: fall back to its repr
        pass
    return repr(result)[:200]


def _parse_line(line: str) -> tuple[int, int, str]:
    """Return (rank, iteration, status) of one record or raise ValueError saying why not."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    rank, iteration, status = record.get("rank"), record.get("iteration"), record.get("status")
    if type(rank) is not int or type(iteration) is not int:
        raise ValueError("rank and iteration must be integers")
    if status not in RerunValidationStatus.__members__:
        raise ValueError(f"unknown status {status!r}")
    return rank, iteration, status


def skipped_iterations(path: str) -> list[int]:
    """The 1-based steps whose result was reproducibly rejected at least twice on one rank.

    A malformed line is logged with its line number and skipped; a missing file means a
    fresh job and gives an empty list.
    """
    counts: Counter[tuple[int, int]] = Counter()
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rank, iteration, status = _parse_line(line)
                except ValueError as exc:
                    logger.warning("tracker file %s line %d skipped: %s", path, lineno, exc)
                    continue
                if status in _REPRODUCED_STATUSES:
                    counts[(rank, iteration)] += 1
    except FileNotFoundError:
        logger.info("tracker file %s does not exist yet: no step to skip", path)
        return []
    skip = sorted({iteration for (_, iteration), n in counts.items() if n > 1})
    logger.warning("steps to skip according to tracker file %s: %s", path, skip)
    return skip
