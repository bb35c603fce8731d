"""The rerun state machine on a real GPU: CUDA RNG replay, GPU UUID identity, NCCL reduction.

Skipped, with a reason starting "no CUDA device", where torch sees no GPU; scripts/gpu_check.sh
runs these on a GPU machine. Nothing here is mocked: all_reduce is wrapped only to record
which device its tensor lives on, and still runs the real collective.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from gpu.gpu_support import cuda_device_count, gpu_uuids, require_cuda
from rerun_test_support import clean_rerun_globals  # noqa: F401

require_cuda()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rerun import RerunDataIterator, RerunMode, RerunStateMachine  # noqa: E402
from rerun.identity import current_device_identity  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

REDUCE_WORKER = Path(__file__).resolve().parents[1] / "gpu" / "reduce_any_worker.py"


@pytest.fixture
def cuda0():
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # a training job has CUDA initialised before its steps
    yield torch.device("cuda", 0)
    torch.cuda.synchronize()


@pytest.fixture
def nccl_world_1(tmp_path, cuda0):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60), device_id=cuda0)
    yield
    dist.destroy_process_group()


@pytest.fixture
def all_reduce_devices(monkeypatch):
    """The device type of every tensor the machine all-reduces (the real collective runs)."""
    seen = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append((tensor.device.type, str(dist.get_backend())))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", recording)
    return seen


def _always_suspicious_step(machine: RerunStateMachine) -> tuple[list, tuple[bool, bool, int]]:
    """One step that draws CUDA random numbers and whose result is always rejected: the
    machine re-runs it in place; returns each pass's draws and should_checkpoint_and_exit."""
    data = RerunDataIterator(iter([torch.ones(8)]))
    draws = []
    while machine.should_run_forward_backward(data):
        x = next(data).cuda()
        noise = torch.rand(4096, device="cuda")
        kept = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), p=0.5)
        draws.append((noise.cpu(), kept.cpu()))
        result = noise.sum() + kept.sum() + x.sum()
        machine.validate_result(result, lambda r: True, "always suspicious", fatal=True)
    return draws, machine.should_checkpoint_and_exit()


def test_rerun_in_place_replays_the_cuda_random_numbers(cuda0):
    torch.manual_seed(1234)
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    draws, (checkpoint, stop, code) = _always_suspicious_step(machine)
    assert len(draws) == 2, "the rejected step is run a second time in place"
    (noise1, kept1), (noise2, kept2) = draws
    assert torch.equal(noise1, noise2) and torch.equal(kept1, kept2), \
        "the re-run drew other CUDA random numbers: the CUDA RNG state was not restored"
    # Reproduced on the same device: the machine asks to resume elsewhere (16), which it
    # would not do had the re-run differed (17, transient error).
    assert (checkpoint, stop, code) == (True, True, 16)
    # With an exit code the machine rewinds to the step's start, so the checkpoint taken now
    # replays the same draws on the other device.
    after = torch.rand(4096, device="cuda").cpu()
    assert torch.equal(after, noise1), "the checkpoint would not hold the step's CUDA RNG state"


def test_device_identity_is_the_gpu_uuid(cuda0, monkeypatch):
    # FT_DEVICE_ID and LOCAL_RANK name the launcher's slot, not the physical GPU: with CUDA
    # initialised the identity must be the GPU itself.
    monkeypatch.setenv("FT_DEVICE_ID", "7")
    monkeypatch.setenv("LOCAL_RANK", "3")
    _host, device = current_device_identity()
    uuids = gpu_uuids()  # from NVML (or nvidia-smi), not from torch
    assert device.startswith("GPU-"), device
    assert device in uuids, f"{device} is not one of this machine's GPUs {uuids}"
    if len(uuids) == 1:
        assert device == uuids[0]
    if cuda_device_count() >= 2:
        torch.cuda.set_device(1)
        torch.zeros(1, device="cuda")
        try:
            other = current_device_identity()[1]
        finally:
            torch.cuda.set_device(0)
        assert other in uuids and other != device


def test_reduce_any_runs_over_nccl_world_size_1(nccl_world_1, all_reduce_devices):
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    assert machine._reduce_any(True) is True
    assert machine._reduce_any(False) is False
    assert machine._reduce_any([False, True, False]) == [False, True, False]
    assert all_reduce_devices == [("cuda", "nccl")] * 3


def test_rerun_step_over_nccl_world_size_1(nccl_world_1, all_reduce_devices):
    torch.manual_seed(99)
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    draws, outcome = _always_suspicious_step(machine)
    assert outcome == (True, True, 16)
    assert torch.equal(draws[0][0], draws[1][0])
    assert all_reduce_devices, "the step's re-run decision went through the process group"
    assert set(all_reduce_devices) == {("cuda", "nccl")}


def test_reduce_any_over_nccl_two_ranks(tmp_path):
    if cuda_device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 NCCL ranks (found {cuda_device_count()})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(REDUCE_WORKER)],
            env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        for r in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=90))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"{out}\n{err}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    for res in results:
        assert res["flags"] == [True, True, False], res
        assert res["single"] is True and res["backend"] == "nccl"
        assert set(res["devices"]) == {"cuda"}
