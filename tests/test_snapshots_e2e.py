"""In-memory snapshots end to end: a real launcher, the DDP example on 2 ranks (gloo).

With the defaults only (the frequency the ranks agree on): a rank SIGKILLed while its
write of a 50 MB snapshot is under way, one rank ahead of the other, and every rank resumes
from the newest iteration both committed. A rank SIGKILLed or hung: the next cycle resumes
from the newest step every rank holds a snapshot of, at most one step behind the last step
the world completed (the disk checkpoint is far older). A snapshot corrupted between
cycles: rejected by the launcher, never loaded, and the training resumes from the disk
checkpoint. A launcher stopped by SIGTERM removes the snapshots.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest
from launch_helpers import (
    EXAMPLES,
    ROOT,
    SCRIPTS,
    events,
    finish,
    launcher_cmd,
    named,
    run_launcher,
    summary,
    wait_for,
)

from ft_agent.snapshot_frequency import Grid, extend

pytestmark = pytest.mark.timeout(150)

TRAIN_DDP = str(EXAMPLES / "train_ddp.py")
FAST_STOP = ("--workers-stop-timeout", "2")
SNAPSHOTS = ("--ft-snapshot-every", "1")


def resumed(run_dir: Path, rank: int, cycle: int) -> tuple[str, int] | None:
    """("snapshot" or "disk", step) from the rank's log of that cycle."""
    log = (run_dir / "logs" / f"cycle_{cycle}" / f"rank_{rank}.log").read_text()
    m = re.search(r"resumed from (snapshot )?step (\d+)", log)
    return None if m is None else ("snapshot" if m.group(1) else "disk", int(m.group(2)))


def world_last_step(evs: list[dict], cycle: int) -> int:
    """The last step every rank completed in a cycle (the slowest rank's last report)."""
    return min(e["iteration"] for e in named(evs, "last_progress") if e["cycle"] == cycle)


def assert_resumed_from_snapshot(run_dir: Path) -> None:
    evs = events(run_dir)
    last = world_last_step(evs, 0)
    picked = [e for e in named(evs, "snapshot_picked") if e["cycle"] == 1]
    assert len(picked) == 1 and picked[0]["iteration"] is not None, picked
    for rank in (0, 1):
        assert resumed(run_dir, rank, 1) == ("snapshot", picked[0]["iteration"])
    assert last - 1 <= picked[0]["iteration"] <= last + 1, (picked[0], last)
    restored = [e for e in named(evs, "snapshot_restored") if e["cycle"] == 1]
    assert sorted(e["rank"] for e in restored) == [0, 1]
    assert all(e["iteration"] == picked[0]["iteration"] and e["source"] == "local"
               and e["bytes"] > 0 for e in restored)
    assert summary(run_dir)["exit_code"] == 0
    area = named(evs, "snapshots_ready")[0]["path"]
    assert not Path(area).exists(), "the launcher removes the snapshots when the job ends"


def started(run_dir: Path, rank: int) -> list[int]:
    """The iterations whose snapshot ``rank`` started in cycle 0 (snapshot_issue.py)."""
    log = (run_dir / "logs" / "cycle_0" / f"rank_{rank}.log").read_text()
    return [int(m) for m in re.findall(r"cycle 0: started (\d+)", log)]


def test_with_the_defaults_a_kill_during_a_write_resumes_from_the_newest_common_copy(
        tmp_path: Path):
    """The issue's case, no snapshot option given: 2 ranks, a 50 MB tensor each, 0.1 s
    steps; rank 1 SIGKILLed during the write of the first snapshot it started at or after
    step 40 (after the copy, before the commit record). Every rank resumes from the newest
    iteration both had started (and so committed) before it: never from scratch, never
    older."""
    run_dir = tmp_path / "run"
    proc = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "1", *FAST_STOP,
                        str(SCRIPTS / "snapshot_issue.py"), "--steps", "50", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    evs = events(run_dir)
    frequency = [e for e in named(evs, "snapshot_frequency") if e["cycle"] == 0]
    assert frequency and frequency[0]["reason"] == "first measure", frequency
    killed_at = started(run_dir, 1)[-1]
    assert killed_at >= 40, (started(run_dir, 1), frequency)
    both = set(started(run_dir, 0)) & set(started(run_dir, 1)) - {killed_at}
    expected = max(both)
    # Once the frequency is agreed, both ranks snapshot the same steps: the grid's, built
    # as the ranks build it (a loaded machine can change the frequency during the run).
    # The kill came at a grid point, and the copy restored is the grid point before it.
    segments: tuple[tuple[int, int], ...] = ()
    for f in frequency:
        segments = extend(segments, f["start"], f["every"])
    grid = Grid(segments)
    for point in (expected, killed_at):
        assert grid.position(point) != grid.position(point - 1), (point, frequency)
    assert grid.position(killed_at - 1) == grid.position(expected), \
        (expected, killed_at, frequency)
    picked = [e for e in named(evs, "snapshot_picked") if e["cycle"] == 1]
    assert [p["iteration"] for p in picked] == [expected], picked
    restored = [e for e in named(evs, "snapshot_restored") if e["cycle"] == 1]
    assert sorted((e["rank"], e["iteration"]) for e in restored) == [(0, expected),
                                                                       (1, expected)]
    for rank in (0, 1):
        assert resumed(run_dir, rank, 1) == ("snapshot", expected)
    area = Path(named(evs, "snapshots_ready")[0]["path"])
    assert not area.exists(), "the launcher removes the snapshots when the job ends"


def test_rank_killed_resumes_from_the_snapshots(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP,
                        *SNAPSHOTS, "--ft-simulated-fault", "rank_killed:base_delay=2,rank=1",
                        TRAIN_DDP, "--steps", "70", "--step-time", "0.05",
                        "--ckpt-every", "1000", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert_resumed_from_snapshot(run_dir)


@pytest.mark.slow  # the restore is the kill case's; the hang verdict is test_monitoring's
def test_rank_hung_resumes_from_the_snapshots(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP,
                        *SNAPSHOTS, "--ft-rank-heartbeat-timeout", "3",
                        "--ft-initial-rank-heartbeat-timeout", "60",
                        "--ft-simulated-fault", "rank_hung:base_delay=2,rank=1",
                        TRAIN_DDP, "--steps", "70", "--step-time", "0.05",
                        "--ckpt-every", "1000", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert named(events(run_dir), "hang_detected")
    assert_resumed_from_snapshot(run_dir)


# Slow tier: a corrupted copy refused by its checks is test_snapshot_replica's (a replica)
# and test_snapshots.py's (a rank's own); this is the launcher's choice falling back to disk.
@pytest.mark.slow
def test_corrupt_snapshot_is_rejected_and_the_disk_checkpoint_used(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP,
                        *SNAPSHOTS, str(SCRIPTS / "snapshot_corrupt.py"), "--steps", "40",
                        "--ckpt-every", "5", timeout=120, env={"CORRUPT_AT": "12"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    evs = events(run_dir)
    rejected = [e for e in named(evs, "snapshot_rejected") if e["cycle"] == 1]
    assert rejected and all(e["rank"] == 1 and e["by"] == "launcher"
                            and "checksum" in e["reason"] for e in rejected), rejected
    picked = [e for e in named(evs, "snapshot_picked") if e["cycle"] == 1]
    assert picked[0]["iteration"] is None
    assert not [e for e in named(evs, "snapshot_restored") if e["cycle"] == 1]
    assert resumed(run_dir, 0, 1) == resumed(run_dir, 1, 1) == ("disk", 10)


def test_sigterm_to_the_launcher_removes_the_snapshots(tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(launcher_cmd(run_dir, "--nproc-per-node", "2", *FAST_STOP,
                                         *SNAPSHOTS, TRAIN_DDP, "--steps", "100000",
                                         "--step-time", "0.05"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    try:
        ready = wait_for(lambda: named(events(run_dir), "snapshots_ready"), 60, "snapshots")
        area = Path(ready[0]["path"])
        wait_for(lambda: list(area.glob("rank_*/commit_*.json")), 60, "a committed snapshot")
        proc.send_signal(signal.SIGTERM)
        finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not area.exists()
