"""The run directory: events.jsonl, summary.json, ft_state.json, per-cycle logs and stacks."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ft_launcher")


class RunDirError(OSError):
    """The run directory cannot be created or written."""


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so a reader never sees half a file (temp file + rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunDir:
    """One job's directory, shared by every cycle."""

    def __init__(self, path: Path, log_dir: Path | None = None) -> None:
        self.path = Path(path).absolute()
        self.logs = Path(log_dir).absolute() if log_dir else self.path / "logs"
        self.stacks = self.path / "stacks"
        try:
            for d in (self.path, self.logs, self.stacks):
                d.mkdir(parents=True, exist_ok=True)
            # Private: the monitor's socket and the agents' stack files live here.
            self.private = self.path / "ipc"
            self.private.mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.private, 0o700)
            self._events = open(self.path / "events.jsonl", "a", buffering=1)  # noqa: SIM115
        except OSError as exc:
            raise RunDirError(f"run directory {self.path}: {exc.strerror or exc}") from None

    # -- events ------------------------------------------------------------------------

    def event(self, name: str, cycle: int, **fields: Any) -> dict[str, Any]:
        """Append one event line and flush it; returns the record."""
        record = {"ts": round(time.time(), 6), "event": name, "cycle": cycle, **fields}
        self._events.write(json.dumps(record, default=str) + "\n")
        self._events.flush()
        return record

    def close(self) -> None:
        self._events.close()

    # -- files -------------------------------------------------------------------------

    def cycle_log_dir(self, cycle: int) -> Path:
        d = self.logs / f"cycle_{cycle}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def rank_log(self, cycle: int, rank: int) -> Path:
        return self.cycle_log_dir(cycle) / f"rank_{rank}.log"

    def stack_file(self, cycle: int, rank: int) -> Path:
        return self.stacks / f"cycle_{cycle}_rank_{rank}.txt"

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.path / "summary.json", summary)


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of a run directory (skipping a torn last line)."""
    events = []
    try:
        lines = (Path(path) / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return events
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("events.jsonl: skipping malformed line %r", line[:80])
    return events
