"""NCCL's flight recorder as a cycle service: when the user turned it on, each rank dumps
into the run's private directory, where a hang's response collects the traces
(``hang/nccl_trace.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ft_launcher.hang import nccl_trace
from ft_launcher.services.seam import CycleService


class NcclTraces(CycleService):
    """Adds the flight recorder's dump and pipe paths to a rank's environment."""

    def __init__(self, private_dir: Path) -> None:
        self.private_dir = private_dir

    def worker_env(self, rank: int, env: Mapping[str, str]) -> dict[str, str]:
        traces = nccl_trace.worker_env(env, self.private_dir)
        if traces:
            nccl_trace.trace_dir(self.private_dir)
        return traces
