"""Shared fixtures of the rerun tests: a fresh global machine and no leftover listeners."""

from __future__ import annotations

import logging

import pytest

import rerun
from rerun import events


@pytest.fixture(autouse=True)
def _clean_rerun_globals(monkeypatch):
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
