"""One rank of a 2-rank NCCL job that calls the rerun state machine's ``_reduce_any``.

Run by tests/rerun/test_rerun_cuda.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set,
one GPU per rank (cuda:RANK). Rank r votes True for flag r only, so only a real reduction
across both ranks gives every rank [True, True, False]. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from rerun import RerunMode, RerunStateMachine  # noqa: E402


def main() -> None:
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=device)
    devices = []
    real = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        devices.append(tensor.device.type)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce  # still the real collective; records its input
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    flags = machine._reduce_any([rank == 0, rank == 1, False])
    single = machine._reduce_any(rank == 1)
    print(json.dumps({"rank": rank, "flags": flags, "single": single,
                      "backend": str(dist.get_backend()), "devices": devices}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
