"""RUN_DIR/workers.json: pid -> rank for tools outside the launcher (a warm worker's
/proc/PID/environ is the zygote's, so they cannot read the rank there)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ft_launcher.process import workers_file
from ft_launcher.services.seam import CycleStart
from ft_launcher.services.workers_file import WorkersFile


@dataclass
class _W:
    rank: int
    local_rank: int
    pid: int
    warm: bool
    alive: bool = True


def _read(run_dir) -> dict:
    return json.loads((run_dir / workers_file.WORKERS_FILE).read_text())


def test_the_file_lists_the_running_cycles_live_workers_and_is_emptied_at_its_end(tmp_path):
    service = WorkersFile(tmp_path)
    service.begin(CycleStart(3, None, (2, 3)))  # type: ignore[arg-type]
    workers = [_W(2, 0, 1234, True), _W(3, 1, 1240, False)]
    service.started(workers)
    assert _read(tmp_path) == {"cycle": 3, "workers": {
        "1234": {"rank": 2, "local_rank": 0, "cycle": 3, "warm": True},
        "1240": {"rank": 3, "local_rank": 1, "cycle": 3, "warm": False}}}
    workers[1].alive = False  # its pid may be reused: it leaves the file at once
    service.worker_exited(workers[1])
    assert list(_read(tmp_path)["workers"]) == ["1234"]
    service.ended(None)  # type: ignore[arg-type]
    assert _read(tmp_path) == {"cycle": None, "workers": {}}
    leftovers = [n for n in os.listdir(tmp_path) if n != workers_file.WORKERS_FILE]
    assert leftovers == [], "the atomic write leaves no temporary file"


def test_a_job_that_ends_inside_a_cycle_empties_the_file(tmp_path):
    service = WorkersFile(tmp_path)
    service.begin(CycleStart(0, None, (0,)))  # type: ignore[arg-type]
    service.started([_W(0, 0, 99, True)])
    service.close()
    assert _read(tmp_path)["workers"] == {}


def test_an_unwritable_run_dir_never_raises(tmp_path):
    gone = tmp_path / "gone"
    assert workers_file.write(gone, 0, [_W(0, 0, 1, False)]) is False
