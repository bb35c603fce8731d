"""Who and where this process is: rank, host and device identity.

The device identity decides whether a resumed job landed on the suspicious device again, so
it must name the physical device, and it must work without a GPU so the whole flow can be
tested on CPU.
"""

from __future__ import annotations

import os
import socket

import torch


def current_rank() -> int | None:
    """The global rank: from torch.distributed when initialised, else env ``RANK``, else None."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    rank = os.environ.get("RANK")
    if rank is not None and rank.strip().isdigit():
        return int(rank)
    return None


def current_host() -> str:
    """This machine's host name."""
    return socket.gethostname()


def _cuda_device_identity() -> str | None:
    """The current CUDA device, named by UUID when torch exposes it, else by index.

    The UUID is preferred because the launcher rotates ``CUDA_VISIBLE_DEVICES``: index 0 in
    one cycle can be another physical GPU than index 0 in the next.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid:
        text = str(uuid)
        return text if text.startswith("GPU-") else f"GPU-{text}"
    return f"cuda:{index}"


def current_device_index() -> int:
    """The device index as Megatron-Core reports it (``torch.cuda.current_device()``).

    Without an initialised CUDA device: ``FT_DEVICE_ID``, else ``LOCAL_RANK``, else 0 (a
    value that is not a small non-negative integer counts as 0).
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    for name in ("FT_DEVICE_ID", "LOCAL_RANK"):
        value = os.environ.get(name, "").strip()
        if value:
            return int(value) if value.isdigit() and len(value) < 7 else 0
    return 0


def current_device_identity() -> tuple[str, str]:
    """Return ``(host, device)`` for the device this process computes on.

    The device is the current CUDA device when CUDA is available and initialised, else the
    launcher's ``FT_DEVICE_ID``, else ``LOCAL_RANK``, else ``"0"``.
    """
    device = _cuda_device_identity()
    if device is None:
        device = os.environ.get("FT_DEVICE_ID") or os.environ.get("LOCAL_RANK") or "0"
    return current_host(), device
