"""Checkpoints move both ways between NVRx's real client and this one.

NVRx (``nvidia-resiliency-ext==0.4.1``, a test dependency: its fault-tolerance client imports
and saves/loads its state on CPU, no GPU and no launcher needed) writes a state with its own
``RankMonitorClient.state_dict`` from its own dataclasses; this package loads it. This package's
state is loaded by NVRx's own ``RankMonitorClient.load_state_dict``. Each state goes through
``torch.save``/``torch.load`` (a Megatron checkpoint) or JSON (NVRx's examples) on the way.
"""

from __future__ import annotations

import json

import nvidia_resiliency_ext.fault_tolerance as nvrx
import pytest
import torch
from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts as NvrxHeartbeat
from nvidia_resiliency_ext.fault_tolerance.data import SectionTimeouts as NvrxSections

import ft_agent as ft
from ft_agent import nvrx_types


def _through(how: str, state: dict, tmp_path) -> dict:
    if how == "torch":
        path = tmp_path / "ckpt.pt"
        torch.save({"model": {}, "ft_state": state}, path)
        return torch.load(path, weights_only=True)["ft_state"]
    path = tmp_path / "ft_state.json"
    path.write_text(json.dumps(state))
    return json.loads(path.read_text())


def _nvrx_client(monkeypatch, hb: NvrxHeartbeat, sec: NvrxSections) -> nvrx.RankMonitorClient:
    """NVRx's client with these timeouts in force, as after its calculate_and_set_* calls."""
    monkeypatch.delenv("FT_LAUNCHER_IPC_SOCKET", raising=False)
    client = nvrx.RankMonitorClient()
    client.hb_timeouts, client.section_timeouts = hb, sec
    return client


@pytest.mark.parametrize("how", ["torch", "json"])
def test_a_state_saved_by_nvrxs_client_loads_here(monkeypatch, tmp_path, how):
    saver = _nvrx_client(
        monkeypatch, NvrxHeartbeat(initial=120.5, subsequent=33.25, were_calculated=True),
        NvrxSections(section={"init": 20.0, "step": 4.5, "checkpoint": None},
                     out_of_section=12.0, calculated_sections={"step"},
                     is_out_of_section_calculated=True))
    state = _through(how, saver.state_dict(), tmp_path)
    monkeypatch.delenv("FT_ENDPOINT", raising=False)
    client = ft.RankMonitorClient()
    client.load_state_dict(state)
    # Only what NVRx calculated is put in force; its configured sections stay configured.
    assert client._pending_state == {"initial_rank_heartbeat_timeout": 120.5,
                                     "rank_heartbeat_timeout": 33.25,
                                     "rank_section_timeouts": {"step": 4.5},
                                     "rank_out_of_section_timeout": 12.0}
    assert client.hb_timeouts.were_calculated is True
    assert client._marks == nvrx_types.CalculatedMarks(True, {"step"}, True)


def test_a_state_nvrx_saved_before_calculating_loads_as_nothing(monkeypatch, tmp_path):
    saver = _nvrx_client(monkeypatch, NvrxHeartbeat(), NvrxSections())
    state = _through("torch", saver.state_dict(), tmp_path)
    assert state == {"current_timeouts": {}}  # NVRx's own layout, not ours
    assert nvrx_types.timeouts_from_state(state) == ({}, nvrx_types.CalculatedMarks())


def test_a_heartbeat_only_state_of_nvrx_loads_here(monkeypatch, tmp_path):
    saver = _nvrx_client(monkeypatch, NvrxHeartbeat(60.0, 7.0, True),
                         NvrxSections(section={"step": 9.0}))  # configured: not saved
    timeouts, marks = nvrx_types.timeouts_from_state(
        _through("json", saver.state_dict(), tmp_path))
    assert timeouts == {"initial_rank_heartbeat_timeout": 60.0, "rank_heartbeat_timeout": 7.0}
    assert marks == nvrx_types.CalculatedMarks(True, set(), False)


@pytest.mark.parametrize("how", ["torch", "json"])
def test_a_state_saved_here_loads_into_nvrxs_client(monkeypatch, tmp_path, how):
    hb = ft.HeartbeatTimeouts(120.5, 33.25, True)
    sec = ft.SectionTimeouts({"step": 4.5, "init": 20.0}, 12.0, {"step"}, True)
    # RankMonitorClient.state_dict is state_dict_of(hb_timeouts, section_timeouts); the
    # launcher-backed client's own states are loaded by NVRx in test_nvrx_compat.py.
    state = _through(how, nvrx_types.state_dict_of(hb, sec), tmp_path)
    loader = _nvrx_client(monkeypatch, NvrxHeartbeat(), NvrxSections())
    loader.load_state_dict(state)
    assert loader.loaded_hb_timeouts == NvrxHeartbeat(120.5, 33.25, True)
    assert loader.loaded_section_timeouts == NvrxSections(
        section={"step": 4.5, "init": 20.0}, out_of_section=12.0,
        calculated_sections=["step"], is_out_of_section_calculated=True)
    # Put in force there and saved again by NVRx: the same state, key for key.
    loader.hb_timeouts = loader.loaded_hb_timeouts
    loader.section_timeouts = loader.loaded_section_timeouts
    assert loader.state_dict() == state


def test_nvrxs_own_dataclasses_have_the_fields_of_ours():
    assert [f for f in NvrxHeartbeat.__dataclass_fields__] == \
        [f for f in ft.HeartbeatTimeouts.__dataclass_fields__]
    assert [f for f in NvrxSections.__dataclass_fields__] == \
        [f for f in ft.SectionTimeouts.__dataclass_fields__]
    assert nvrx.RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY == ft.CURRENT_TIMEOUTS_STATE_KEY
    assert [(a.name, a.value) for a in nvrx.WorkloadAction] == \
        [(a.name, a.value) for a in ft.WorkloadAction]
