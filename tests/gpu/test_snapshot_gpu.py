"""The snapshot store with CUDA tensors: copied into pinned host buffers, restored on the
CPU bit for bit, and snapshot() blocking no longer than a few device-to-host copies.
Skipped, with a reason starting "no CUDA device", where torch sees no GPU."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gpu_support import require_cuda

require_cuda()

import torch  # noqa: E402

from ft_agent.snapshot import SnapshotStore, load  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_cuda_state_round_trips_through_pinned_buffers(tmp_path: Path, record_property) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    state = {"w": torch.randn(200 * 2**20 // 4, device="cuda", generator=g),
             "h": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
             "cuda_rng": torch.cuda.get_rng_state(), "it": 7}
    with SnapshotStore(tmp_path / "r") as store:
        status = store.snapshot(state, 7, wait=True)
        assert status.started and store.wait().ok
        assert store._pinned and all(b.is_pinned() for b in store._pinned)
        # The bound: one plain device-to-host copy into a pinned buffer of the same size.
        dst = torch.empty(state["w"].shape, pin_memory=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(state["w"])
        copy_s = time.perf_counter() - start
        again = store.snapshot(state, 8, wait=True)
        written = store.wait()
        assert again.started and written.ok
    # Figures for scripts/gpu_check.sh: what the step waits for, against the plain copy, and
    # the background part (into the slot, checksummed, checked for NaN).
    record_property("snapshot_200mb_blocking_s", round(again.blocking_s, 4))
    record_property("plain_d2h_copy_200mb_s", round(copy_s, 4))
    record_property("snapshot_200mb_background_s", round(written.seconds, 4))
    assert again.blocking_s < 10 * copy_s + 0.05, (again.blocking_s, copy_s)
    snap = load(tmp_path / "r", 7)
    assert torch.equal(snap.state["w"], state["w"].cpu())
    assert torch.equal(snap.state["h"].view(torch.int16), state["h"].cpu().view(torch.int16))
    assert snap.state["w"].device.type == "cpu"
