"""What the GPU tests need to know about the machine, observed independently of the code
under test: is there a CUDA device, which GPUs exist (NVML UUIDs), and which processes hold
a CUDA context on them (NVML's process list, else ``nvidia-smi``).

Every GPU test module calls ``require_cuda()`` at import: on a machine without a CUDA device
the whole module is skipped with a reason that starts with ``NO_CUDA`` (scripts/gpu_check.sh
counts those skips as "not checked", never as a pass).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ft_launcher.warm.worker_side.activation import gpu_files

NO_CUDA = "no CUDA device"


def no_cuda_reason() -> str | None:
    """Why CUDA tests cannot run here, or None when a CUDA device is usable."""
    import torch

    if torch.version.cuda is None:
        return f"{NO_CUDA}: torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return f"{NO_CUDA}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


def require_cuda() -> None:
    """Skip the calling test module (at import) when no CUDA device is usable."""
    reason = no_cuda_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nvml():
    """The pynvml module, initialised; None when it or the NVML library is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # ImportError, or NVMLError when the library or driver is missing
        return None


def _smi(*query: str) -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise RuntimeError("neither nvidia-ml-py (pip install '.[gpu]') nor nvidia-smi found")
    out = subprocess.run([smi, *query, "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_uuids() -> list[str]:
    """UUIDs ("GPU-...") of every GPU on the machine, in NVML's (PCI) order."""
    nvml = _nvml()
    if nvml is None:
        return _smi("--query-gpu=uuid")
    uuids = []
    for i in range(nvml.nvmlDeviceGetCount()):
        uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
        uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    return uuids


def gpu_context_pids() -> set[int]:
    """Pids that hold a CUDA context on any GPU (compute and graphics processes), as the
    driver reports them. Inside a container these can be the host's pids."""
    nvml = _nvml()
    if nvml is None:
        return {int(p) for p in _smi("--query-compute-apps=pid") if p.isdigit()}
    pids = set()
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        for query in (nvml.nvmlDeviceGetComputeRunningProcesses,
                      nvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                pids.update(p.pid for p in query(handle))
            except nvml.NVMLError:
                continue
    return pids


def gpu_device_files(pid: int) -> list[str]:
    """GPU device nodes a process holds open (the launcher's own check, by pid)."""
    return gpu_files(pid)
