"""Shared set-up of the rerun tests: the real package on sys.path, and an autouse fixture
giving each test a fresh global machine and no leftover listeners.

Not a conftest.py: a second module named "conftest" would shadow tests/conftest.py for the
other test folders that import helpers from it. Test modules import this one before rerun.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

# This folder is named like the package: with tests/ on sys.path (pytest's prepend mode puts
# it there for tests/conftest.py) "import rerun" would find this folder as a namespace
# package before the editable install's finder. The repository root first avoids that.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path[:1]:
    sys.path.insert(0, _ROOT)
if getattr(sys.modules.get("rerun"), "__file__", "") is None:
    del sys.modules["rerun"]  # a namespace package picked up before this ran

import rerun  # noqa: E402
from rerun import events  # noqa: E402


@pytest.fixture(autouse=True)
def clean_rerun_globals(monkeypatch):
    # Each test owns the singleton, the listeners and the device identity variables.
    for name in ("RANK", "LOCAL_RANK", "FT_DEVICE_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    rerun.destroy_rerun_state_machine()
    saved = list(events._listeners)
    events._listeners.clear()
    logging.getLogger("rerun").setLevel(logging.DEBUG)
    yield
    events._listeners[:] = saved
    rerun.destroy_rerun_state_machine()
