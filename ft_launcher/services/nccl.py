"""NCCL's flight recorder as a cycle service: when the user turned it on, each rank dumps
into the run's private directory, where a hang's response collects the traces
(``hang/nccl_trace.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ft_launcher.hang import nccl_trace
from ft_launcher.process.worker_env import EnvDoc
from ft_launcher.services.seam import CycleService

# nccl_trace.worker_env's variables, as docs/reference/environment.md lists them.
NCCL_ENV = (
    EnvDoc(("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", nccl_trace.PIPE_VAR, nccl_trace.DUMP_ON_TIMEOUT_VAR),
           "set unless you set them, when `TORCH_NCCL_TRACE_BUFFER_SIZE` or "
           "`TORCH_FR_BUFFER_SIZE` is set: where NCCL's flight recorder dumps and the pipe "
           "that asks for a dump, in the run's private `ipc/`, and dump-on-timeout "
           "([NCCL's flight recorder](../gpus.md#nccls-flight-recorder))"),
)


class NcclTraces(CycleService):
    """Adds the flight recorder's dump and pipe paths to a rank's environment."""

    def __init__(self, private_dir: Path) -> None:
        self.private_dir = private_dir

    def worker_env(self, rank: int, env: Mapping[str, str]) -> dict[str, str]:
        traces = nccl_trace.worker_env(env, self.private_dir)
        if traces:
            nccl_trace.trace_dir(self.private_dir)
        return traces
