"""``RUN_DIR/workers.json``: which process is which rank, for tools outside the launcher.

Node tools map processes to ranks by their environment (``RANK``, ``LOCAL_RANK`` in
``/proc/PID/environ``), but a warm worker's environment there is the zygote's: the rank's own
lives only in its ``os.environ``. This file says it instead: rewritten (atomically, so a
reader never sees half of it) when a cycle's workers start and whenever one exits, and
emptied when the cycle's workers are stopped, so it only ever lists running workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ft_launcher.rundir import write_json_atomic

WORKERS_FILE = "workers.json"


class _Worker(Protocol):
    rank: int
    local_rank: int
    pid: int
    warm: bool
    alive: bool


def describe(cycle: int | None, workers: Iterable[_Worker]) -> dict[str, Any]:
    """The file's content: ``{"cycle": N, "workers": {"PID": {rank, local_rank, cycle,
    warm}}}`` for the live workers (pids as strings: JSON keys)."""
    live = {str(w.pid): {"rank": w.rank, "local_rank": w.local_rank, "cycle": cycle,
                         "warm": bool(w.warm)}
            for w in workers if w.alive}
    return {"cycle": cycle if live else None, "workers": live}


def write(run_dir: Path, cycle: int | None, workers: Iterable[_Worker]) -> bool:
    """Rewrite ``run_dir/workers.json``; False (and nothing raised) when it cannot be
    written: a full disk must not stop the job, and the next write tries again."""
    try:
        write_json_atomic(run_dir / WORKERS_FILE, describe(cycle, workers))
    except OSError:
        return False
    return True
