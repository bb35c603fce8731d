"""Straggler detection on GPU time (issue 14), on a real GPU: skipped without one.

1. ft_agent.device_time with real CUDA events: a close returns at once while the kernels
   run (nothing synchronises), and the device times reported later grow with the work.
2. End to end: two ranks whose sections queue kernels (the wall time of such a section is
   the launch time only); rank 1 queues twice the work. The launcher reports rank 1 with
   ``clock`` "device" (tests/gpu/straggler_gpu_job.py).
The CPU tests of the same code mock the CUDA event (tests/test_straggler_agent.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gpu_support import require_cuda
from launch_helpers import events, named, run_launcher

require_cuda()

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

JOB = str(Path(__file__).resolve().parent / "straggler_gpu_job.py")


def test_device_times_are_read_without_waiting_and_follow_the_work():
    import torch

    from ft_agent.device_time import DeviceTimer

    timer = DeviceTimer()
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    reported = []
    for work in (40, 10, 20):
        timer.open("s")
        x = a
        for _ in range(work):
            x = x @ a
        t0 = time.perf_counter()
        reported.append(timer.close("s"))
        returned_in = time.perf_counter() - t0
        assert returned_in < 0.01, "close() waited for the device"
    assert reported[0] is None, "the first section's kernels cannot have completed yet"
    torch.cuda.synchronize()
    later = [timer.close("s") for _ in range(3)]
    got = [v for v in reported + later if v is not None]
    assert len(got) == 3 and all(v > 0 for v in got)
    assert got[0] > got[2] > got[1], f"device times do not follow the work: {got}"


def test_the_launcher_names_the_rank_with_twice_the_gpu_work(run_dir: Path):
    # The job's ranks take turns on the GPU, so 2x the work measures ~2x even on one GPU.
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--ft-straggler-window", "10", JOB,
                       "--steps", "80", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    detected = named(events(run_dir), "straggler_detected")
    assert detected, res.stdout[-3000:]
    assert {e["rank"] for e in detected} == {1}
    assert detected[0]["clock"] == "device"
    assert 1.3 < detected[0]["score"] < 3.0
