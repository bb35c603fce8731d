"""The result-rejected tracker file: one line per rejected result.

We write JSON lines: ``ts`` (unix seconds), ``node``, ``device``, ``job_id``, ``rank``,
``iteration`` (1-based step), ``status`` (a RerunValidationStatus name), ``result`` (text)
and ``message``. JSON so that a message holding spaces, quotes or ``key=value`` text cannot
corrupt the line.

We also read the ``key=value`` lines Megatron-Core writes::

    ts=2025-01-01 10:00:00.123 node=n1 device=0 jobID=42 rank=1 iteration=5 \
status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE result=tensor(nan) message='...'

(``status`` is spelled ``rerun_disabled`` by Python 3.10 and
``RerunValidationStatus.RERUN_DISABLED`` by 3.11+; both are read). Fields are read from the
line's start up to ``result=``, never out of the free text after it, and one malformed line
is skipped with a warning, not the rest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
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

# Megatron's fields before the free text; every value but the timestamp is one word.
_KEY_VALUE_LINE = re.compile(
    r"ts=(?P<ts>[^=]+?) node=(?P<node>\S+) device=(?P<device>\S+) jobID=(?P<job>\S+) "
    r"rank=(?P<rank>\S+) iteration=(?P<iteration>\S+) status=(?P<status>\S+) result="
)
_MAX_LINE = 1 << 16  # a longer line is not a record (and is not worth parsing)


@dataclass(frozen=True)
class TrackerRecord:
    """The fields of one tracker line that decide which steps to skip."""

    job: str
    rank: int
    iteration: int
    status: str


def check_writable(path: str) -> None:
    """Raise RuntimeError now, at start-up, if ``path`` cannot be appended to."""
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise RuntimeError(f"rerun tracker file {path!r} cannot be appended to: {exc}") from exc


def job_id() -> str | None:
    """The Slurm job id (kept by a requeued job), or None outside Slurm."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")


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
        "job_id": job_id(),
        "rank": rank if rank is not None else 0,
        "iteration": iteration,
        "status": status.name,
        "result": result_text(result),
        "message": message,
    }
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as exc:
        logger.error("could not append to tracker file %s: %s", path, exc)


def result_text(result: Any) -> str:
    """A short text form of a result (a one-element tensor becomes its number)."""
    try:
        if hasattr(result, "numel") and result.numel() == 1:
            return repr(float(result.detach()))  # detached: no autograd warning
    except Exception:  # an exotic result type: fall back to its repr
        pass
    return repr(result)[:200]


def _status_name(text: Any) -> str:
    """``RerunValidationStatus.X``, ``x`` or ``X`` -> ``X``; ValueError if unknown."""
    name = str(text).rsplit(".", 1)[-1].upper()
    if name not in RerunValidationStatus.__members__:
        raise ValueError(f"unknown status {text!r}")
    return name


def _as_int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,18}", value):
        return int(value)
    raise ValueError(f"{field} must be an integer, got {value!r}")


def parse_line(line: str) -> TrackerRecord:
    """One record from a JSON line or a Megatron ``key=value`` line; ValueError saying why
    not."""
    if len(line) > _MAX_LINE:
        raise ValueError(f"line longer than {_MAX_LINE} characters")
    text = line.strip()
    if text.startswith("{"):
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        job = record.get("job_id")
        return TrackerRecord(
            job="N/A" if job is None else str(job),
            rank=_as_int(record.get("rank"), "rank"),
            iteration=_as_int(record.get("iteration"), "iteration"),
            status=_status_name(record.get("status")),
        )
    match = _KEY_VALUE_LINE.match(text)
    if match is None:
        raise ValueError("neither a JSON object nor a Megatron key=value record")
    return TrackerRecord(
        job=match["job"],
        rank=_as_int(match["rank"], "rank"),
        iteration=_as_int(match["iteration"], "iteration"),
        status=_status_name(match["status"]),
    )


def read_records(path: str) -> list[TrackerRecord] | None:
    """Every readable record of ``path`` (None if it does not exist); malformed lines are
    logged with their line number and skipped."""
    records: list[TrackerRecord] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(parse_line(line))
                except ValueError as exc:
                    logger.warning("tracker file %s line %d skipped: %s", path, lineno, exc)
    except FileNotFoundError:
        return None
    return records


def iterations_to_skip(records: list[TrackerRecord]) -> tuple[list[int], list[int]]:
    """Megatron's rule: ``(skip, ignored)``.

    A step is skipped when one rank reported it reproducibly (statuses in
    ``_REPRODUCED_STATUSES``) at least twice; it is not skipped (``ignored``) when, within
    one job, more than one rank reported it so: an error on several ranks at once points at
    something other than one bad sample.
    """
    seen: set[tuple[int, int]] = set()
    candidates: set[int] = set()
    ranks_by_job: dict[tuple[str, int], set[int]] = defaultdict(set)
    for r in records:
        if r.status not in _REPRODUCED_STATUSES:
            continue
        if (r.rank, r.iteration) in seen:
            candidates.add(r.iteration)
        seen.add((r.rank, r.iteration))
        ranks_by_job[(r.job, r.iteration)].add(r.rank)
    ignored = {it for (_, it), ranks in ranks_by_job.items() if len(ranks) > 1}
    return sorted(candidates - ignored), sorted(ignored & candidates)


def skipped_iterations(path: str) -> list[int]:
    """The 1-based steps to skip according to the tracker file at ``path`` (see
    ``iterations_to_skip``); a missing file means a fresh job and gives an empty list."""
    records = read_records(path)
    if records is None:
        logger.info("tracker file %s does not exist yet: no step to skip", path)
        return []
    skip, ignored = iterations_to_skip(records)
    logger.warning("steps to skip according to tracker file %s: %s", path, skip)
    if ignored:
        logger.warning(
            "steps not skipped because several ranks of one job reported them: %s", ignored
        )
    return skip
