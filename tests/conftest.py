"""Fixtures shared by every test folder."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
from launch_helpers import processes_of


@pytest.fixture
def run_dir(tmp_path: Path):
    """A run directory; at teardown, asserts no process of this run is left (and kills any)."""
    path = tmp_path / "run"
    yield path
    deadline = time.monotonic() + 5
    left = processes_of(path)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes_of(path)
    for p in left:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {[(p.pid, p.info['cmdline']) for p in left]}"
