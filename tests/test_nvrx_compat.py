"""NVRx code ports by changing one import: NVRx's names, timeouts views, checkpoint layout and
YAML files, proven with scripts written the way NVRx's examples are, under the real launcher.

The fast layout checks here use this package's classes of NVRx's fields; test_nvrx_real.py
saves and loads with NVRx's own client, and the states the two examples below save under the
launcher are loaded by NVRx's own ``RankMonitorClient.load_state_dict``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from pathlib import Path

import nvidia_resiliency_ext.fault_tolerance as nvrx
import pytest
from launch_helpers import NO_PRELOADS, SCRIPTS, events, named, run_launcher, summary

import ft_agent as ft
from ft_agent import nvrx_types

HB_YAML = """fault_tolerance:
    initial_rank_heartbeat_timeout: null
    rank_heartbeat_timeout: null
    log_level: "DEBUG"
"""
SECTIONS_YAML = """fault_tolerance:
    initial_rank_heartbeat_timeout: null
    rank_heartbeat_timeout: null
    rank_section_timeouts:
        init: 20
        step: 10
        checkpoint: 30
    rank_out_of_section_timeout: 30
    log_level: "DEBUG"
"""

# A state NVRx's client saves: dataclasses.asdict of its timeouts, calculated_sections sorted.
NVRX_SAVED = {
    "current_timeouts": {
        "heartbeat": {"initial": 120.5, "subsequent": 33.25, "were_calculated": True},
        "section": {"section": {"init": 20.0, "step": 4.5, "checkpoint": None},
                    "out_of_section": 12.0, "calculated_sections": ["step"],
                    "is_out_of_section_calculated": True},
    }
}


# -- names and views (fast) ------------------------------------------------------------------


def test_nvrx_public_names_and_signatures():
    assert ft.CURRENT_TIMEOUTS_STATE_KEY == ft.RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY \
        == "current_timeouts"
    assert [(a.name, a.value) for a in ft.WorkloadAction] == \
        [("Continue", 0), ("ExcludeThisNode", 1), ("ShutdownWorkload", 2)]
    req = ft.WorkloadControlRequest(ft.WorkloadAction.ExcludeThisNode, "bad NIC")
    assert (req.action, req.description) == (ft.WorkloadAction.ExcludeThisNode, "bad NIC")
    assert "ExcludeThisNode" in str(req) and "bad NIC" in str(req)
    assert issubclass(ft.RankMonitorClientError, Exception)
    client = ft.RankMonitorClient()
    # Keyword arguments NVRx's examples and Megatron pass.
    inspect.signature(client.init_workload_monitoring).bind(num_warmup_iters=5)
    inspect.signature(client.calculate_and_set_hb_timeouts).bind(skip_if_not_ready=True)
    inspect.signature(client.calculate_and_set_section_timeouts).bind(
        selected_sections=["step"], calc_out_of_section=False, skip_if_not_ready=True)
    inspect.signature(client.send_workload_control_request).bind(req)
    assert client.is_initialized is False
    for name in ("send_heartbeat", "start_section", "end_section", "end_all_sections",
                 "state_dict", "load_state_dict", "shutdown_workload_monitoring"):
        assert callable(getattr(client, name))


def test_timeouts_views_have_nvrx_fields_and_a_readable_str():
    hb = ft.HeartbeatTimeouts()
    assert not hb.are_valid and str(hb) == \
        "HeartbeatTimeouts(initial=off, subsequent=off, were_calculated=None)"
    hb = ft.HeartbeatTimeouts(initial=600, subsequent=12.345, were_calculated=True)
    assert hb.are_valid and str(hb) == \
        "HeartbeatTimeouts(initial=600.00s, subsequent=12.35s, were_calculated=True)"
    sec = ft.SectionTimeouts({"step": 4.0, "init": None}, 30.0, {"step"}, False)
    assert not sec.are_valid and not sec.were_calculated
    assert str(sec) == "SectionTimeouts(sections=[init=off, step=4.00s*], " \
                       "out_of_section=30.00s; *=calculated)"
    sec = ft.SectionTimeouts({"step": 4.0}, 30.0, ["step"], True)
    assert sec.are_valid and sec.were_calculated and sec.calculated_sections == {"step"}
    assert [f.name for f in dataclasses.fields(ft.HeartbeatTimeouts)] == \
        ["initial", "subsequent", "were_calculated"]
    assert [f.name for f in dataclasses.fields(ft.SectionTimeouts)] == \
        ["section", "out_of_section", "calculated_sections", "is_out_of_section_calculated"]


def test_views_of_the_monitors_timeouts():
    marks = nvrx_types.CalculatedMarks(heartbeat=True, sections={"step", "gone"})
    reply = {"initial_rank_heartbeat_timeout": 60.0, "rank_heartbeat_timeout": 5.0,
             "rank_out_of_section_timeout": None,
             "rank_section_timeouts": {"step": 2.0, "init": None}}
    hb = nvrx_types.heartbeat_timeouts(reply, marks)
    assert (hb.initial, hb.subsequent, hb.were_calculated) == (60.0, 5.0, True)
    sec = nvrx_types.section_timeouts(reply, marks)
    assert sec.section == {"step": 2.0, "init": None} and sec.calculated_sections == {"step"}
    assert sec.out_of_section is None and not sec.are_valid
    assert not nvrx_types.heartbeat_timeouts({}, nvrx_types.CalculatedMarks()).are_valid
    # When the monitor names the calculated kinds, they are what the views report.
    assert nvrx_types.marks_from_kinds(["initial", "heartbeat", "section:step"]) == \
        nvrx_types.CalculatedMarks(True, {"step"}, False)


# -- the checkpoint layout, both ways (fast) ----------------------------------------------------


def test_a_state_saved_by_nvrx_loads_here():
    timeouts, marks = nvrx_types.timeouts_from_state(json.loads(json.dumps(NVRX_SAVED)))
    # Only what NVRx calculated is put in force; configured sections stay configured.
    assert timeouts == {"initial_rank_heartbeat_timeout": 120.5,
                        "rank_heartbeat_timeout": 33.25,
                        "rank_section_timeouts": {"step": 4.5},
                        "rank_out_of_section_timeout": 12.0}
    assert marks == nvrx_types.CalculatedMarks(True, {"step"}, True)


def test_a_state_saved_here_loads_into_nvrxs_classes():
    hb = ft.HeartbeatTimeouts(120.5, 33.25, True)
    sec = ft.SectionTimeouts({"step": 4.5, "init": 20.0}, 12.0, {"step"}, True)
    saved = json.loads(json.dumps(nvrx_types.state_dict_of(hb, sec)))
    current = saved[ft.CURRENT_TIMEOUTS_STATE_KEY]
    # What NVRx's load_state_dict does with it:
    assert ft.HeartbeatTimeouts(**current["heartbeat"]) == hb
    assert ft.SectionTimeouts(**current["section"]) == sec
    assert current["section"]["calculated_sections"] == ["step"]  # a list, as NVRx writes
    # Configured timeouts are not saved (as in NVRx), so nothing is pinned by a checkpoint.
    assert nvrx_types.state_dict_of(ft.HeartbeatTimeouts(1.0, 2.0, False),
                                    ft.SectionTimeouts({"a": 1.0})) == {"current_timeouts": {}}


def test_the_earlier_layout_of_this_package_still_loads():
    timeouts, marks = nvrx_types.timeouts_from_state(
        {"timeouts": {"rank_heartbeat_timeout": 9.0, "initial_rank_heartbeat_timeout": None,
                      "rank_section_timeouts": {"step": 3.0}}})
    assert timeouts == {"rank_heartbeat_timeout": 9.0, "rank_section_timeouts": {"step": 3.0}}
    assert marks.heartbeat and marks.sections == {"step"} and not marks.out_of_section


@pytest.mark.parametrize(("state", "error"), [
    ([1, 2], "expected a mapping, got list"),
    ({"model": {}}, "no 'current_timeouts' entry"),
    ({"current_timeouts": "x"}, "current_timeouts: expected a mapping"),
    ({"current_timeouts": {"heartbeat": {"initial": math.nan, "subsequent": 1.0,
                                         "were_calculated": True}}},
     r"heartbeat.initial: nan is not a positive finite"),
    ({"current_timeouts": {"heartbeat": {"initial": 1.0, "subsequent": -1,
                                         "were_calculated": True}}},
     "heartbeat.subsequent: -1 is not a positive"),
    ({"current_timeouts": {"heartbeat": {"initial": "5", "subsequent": 1.0}}},
     "heartbeat.initial: expected seconds or None, got '5'"),
    ({"current_timeouts": {"heartbeat": {"initial": 1.0, "subsequent": 1.0, "extra": 1}}},
     r"heartbeat: unknown field\(s\) \['extra'\]"),
    ({"current_timeouts": {"section": {"section": {"step": math.inf},
                                       "calculated_sections": ["step"]}}},
     r"section.section\[step\]: inf is not"),
    ({"current_timeouts": {"section": {"section": {}, "calculated_sections": "step"}}},
     "calculated_sections: expected a list of names"),
    ({"timeouts": {"rank_heartbeat_timeout": 1e-9 * 0}}, "rank_heartbeat_timeout: 0.0 is not"),
])
def test_a_bad_state_is_a_clear_error(state, error):
    client = ft.RankMonitorClient()
    with pytest.raises(ValueError, match=error):
        client.load_state_dict(state)


def test_load_state_dict_before_init_is_kept_for_init(monkeypatch):
    monkeypatch.delenv("FT_ENDPOINT", raising=False)
    client = ft.RankMonitorClient()
    client.load_state_dict(NVRX_SAVED)
    # Outside ft_launcher nothing is connected; the loaded marks are still reported.
    assert client.hb_timeouts.were_calculated is True
    assert client._pending_state["rank_heartbeat_timeout"] == 33.25
    with pytest.warns(RuntimeWarning, match="FT_ENDPOINT is not set"):
        client.init_workload_monitoring()
    assert client.calculate_and_set_hb_timeouts() is False  # a no-op, as documented


# -- under the real launcher -------------------------------------------------------------------


def _read(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_control_request_readiness_and_nvrx_flags(tmp_path, run_dir):
    """No torch: NVRx's flags and YAML, the not-ready error, a WorkloadControlRequest."""
    cfg = tmp_path / "fault_tol_cfg_heartbeats.yaml"
    cfg.write_text(HB_YAML + "    workload_check_interval: 5.0\n")
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--ft-cfg-path", str(cfg),
                       "--ft-restart-policy", "any-failed", "--ft-enable-nic-monitor", "false",
                       "--ft-param-safety_factor", "4", str(SCRIPTS / "nvrx_control.py"),
                       str(tmp_path), "exclude", timeout=90)
    assert res.returncode == 1, res.stdout
    warned = [line for line in res.stdout.splitlines() if "is not applicable here" in line]
    assert len(warned) == 2, warned
    assert "fault_tolerance.workload_check_interval: NVRx setting 'workload_check_interval'" \
        in warned[0]
    assert "--ft-enable-nic-monitor: NVRx setting 'enable_nic_monitor'" in warned[1]
    seen = _read(tmp_path, "control_rank_0")
    assert seen["initialized_before"] is False and seen["initialized"] is True
    assert seen["before_init"] == "HeartbeatTimeouts(initial=off, subsequent=off, " \
                                  "were_calculated=False)"
    assert seen["not_ready"].startswith("RankMonitorClientError: timeouts not calculated")
    assert seen["skip_if_not_ready"] is False and seen["calculated"] is True
    assert seen["hb_timeouts"].endswith("were_calculated=True)")
    assert seen["state"]["current_timeouts"]["heartbeat"]["were_calculated"] is True
    s = summary(run_dir)
    assert s["next_action"]["exclude_nodes"], s
    controls = named(events(run_dir), "workload_control")
    assert [(c["rank"], c["action"]) for c in controls] == [(0, "exclude_node")]


@pytest.mark.slow
def test_heartbeats_pattern_calculates_arms_a_hang_and_resumes(tmp_path, run_dir):
    """NVRx's heartbeat example: timeouts calculated once not valid, a hang armed once they
    are, detected with them, and the checkpointed state loaded on resume."""
    cfg = tmp_path / "fault_tol_cfg_heartbeats.yaml"
    cfg.write_text(HB_YAML)
    out = tmp_path / "out"
    res = run_launcher(run_dir, "--nproc-per-node=2", "--max-restarts", "1",
                       f"--ft-cfg-path={cfg}", "--ft-min-learned-timeout", "5",
                       str(SCRIPTS / "nvrx_heartbeats.py"), str(out),
                       "--simulated_fault", "rank_hung,0.3", timeout=150)
    assert res.returncode == 0, res.stdout[-4000:]
    hangs = named(events(run_dir), "hang_detected")
    assert [(h["cycle"], h["rank"]) for h in hangs] == [(0, 1)], hangs
    assert summary(run_dir)["restarts"] == 1
    start = _read(out, "record_c0_r0_init")
    assert start["are_valid"] is False and start["state"] == {"current_timeouts": {}}
    calc = _read(out, "record_c0_r0_calculated")
    assert calc["are_valid"] and calc["were_calculated"]
    assert calc["initial"] > 0 and calc["subsequent"] >= 5.0  # the floor given
    saved = _read(out, "record_c0_r0_saved_e1")["saved"]
    assert saved == {"current_timeouts": {"heartbeat": {
        "initial": calc["initial"], "subsequent": calc["subsequent"], "were_calculated": True}}}
    assert ft.HeartbeatTimeouts(**saved["current_timeouts"]["heartbeat"]).are_valid
    nvrx_client = nvrx.RankMonitorClient()  # NVRx's own, loading what ours saved
    nvrx_client.load_state_dict(saved)
    assert nvrx_client.loaded_hb_timeouts.are_valid and \
        nvrx_client.loaded_hb_timeouts.subsequent == calc["subsequent"]
    loaded = _read(out, "record_c1_r0_loaded")
    assert loaded["checkpoint_ft_state"] == saved
    assert loaded["were_calculated"] is True and loaded["subsequent"] >= calc["subsequent"]
    assert loaded["str"].startswith("HeartbeatTimeouts(initial=")
    for rank in (0, 1):
        assert _read(out, f"record_c1_r{rank}_done")["are_valid"]


@pytest.mark.slow
def test_sections_pattern_calculates_each_section_and_resumes_from_json_state(tmp_path,
                                                                              run_dir):
    """NVRx's sections example: init/step/checkpoint sections, each timeout calculated once
    observed, the state saved as JSON and loaded before init_workload_monitoring."""
    cfg = tmp_path / "fault_tol_cfg_sections.yaml"
    cfg.write_text(SECTIONS_YAML)
    out = tmp_path / "out"
    res = run_launcher(run_dir, "--nproc-per-node=2", "--max-restarts", "1",
                       f"--ft-cfg-path={cfg}", str(SCRIPTS / "nvrx_sections.py"), str(out),
                       "--epochs", "2", "--exit-after-epoch", "0", timeout=150)
    assert res.returncode == 0, res.stdout[-4000:]
    assert summary(run_dir)["restarts"] == 1
    assert not named(events(run_dir), "hang_detected")
    first = _read(out, "record_c0_r0_epoch0")
    assert first["calculated_sections"] == ["checkpoint", "step"]
    assert set(first["section"]) == {"init", "step", "checkpoint"} and first["are_valid"]
    # Cycle 1 loaded cycle 0's ft_state.json before connecting.
    resumed = _read(out, "record_c1_r0_init")
    assert resumed["calculated_sections"] == ["checkpoint", "step"]
    done = _read(out, "record_c1_r0_done")
    assert done["calculated_sections"] == ["checkpoint", "init", "step"]
    assert done["is_out_of_section_calculated"] is True
    assert all(v is not None and v > 0 for v in done["section"].values())
    state = json.loads((out / "ft_state.json").read_text())
    assert state == done["state"]
    section = state["current_timeouts"]["section"]
    assert ft.SectionTimeouts(**section).were_calculated
    nvrx_client = nvrx.RankMonitorClient()  # NVRx's own, loading what ours saved
    nvrx_client.load_state_dict(state)
    loaded = nvrx_client.loaded_section_timeouts
    assert loaded.section == section["section"] and loaded.is_out_of_section_calculated
    assert sorted(loaded.calculated_sections) == ["checkpoint", "init", "step"]
