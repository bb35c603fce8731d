"""The launcher's side of NCCL flight-recorder dumps, end to end on CPU.

torch's NCCL monitor thread needs a GPU, so tests/gpu/fake_flight_recorder_job.py stands in
for it (same FIFO, same file names, same environment variables); the GPU run
(test_gpu_launcher.py) proves torch behaves like the stand-in. Everything else is real: the
launcher, its hang verdict, the workers, the files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_helpers import events, named, run_launcher

JOB = str(Path(__file__).resolve().parent / "fake_flight_recorder_job.py")
MARKER = b"fake flight recorder dump of rank "

pytestmark = pytest.mark.timeout(120)


def _launch(run_dir: Path, env: dict[str, str]):
    return run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "1",
                        "--ft-initial-rank-heartbeat-timeout", "60",
                        "--ft-rank-heartbeat-timeout", "3", JOB, env=env, timeout=100)


def test_launcher_collects_flight_recorder_dumps_on_a_hang(run_dir):
    res = _launch(run_dir, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})  # all a user sets
    assert res.returncode == 0, res.stdout[-3000:]
    assert named(events(run_dir), "hang_detected")
    for rank in (0, 1):
        dump = run_dir / "stacks" / f"cycle_0_rank_{rank}.nccl_trace"
        assert dump.exists(), sorted(p.name for p in (run_dir / "stacks").iterdir())
        assert dump.read_bytes() == MARKER + str(rank).encode()
        assert (run_dir / "stacks" / f"cycle_0_rank_{rank}.txt").exists()
    # Moved, not copied: a later hang cannot pick up this cycle's dump again.
    assert not list(run_dir.glob("ipc/nccl_trace/dump_rank_*"))


def test_no_flight_recorder_settings_unless_a_buffer_size_is_set(run_dir):
    res = _launch(run_dir, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "", "TORCH_FR_BUFFER_SIZE": ""})
    assert res.returncode == 0, res.stdout[-3000:]
    log = (run_dir / "logs" / "cycle_0" / "rank_0.log").read_text()
    assert "pipe None dump None" in log, log
    assert not list((run_dir / "stacks").glob("*.nccl_trace"))
