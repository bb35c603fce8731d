"""Unit tests of the pure pieces: protocol, configuration, policy, fault plans, agent no-op."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_agent import protocol
from ft_launcher import faults
from ft_launcher.cli import build_ft_config
from ft_launcher.config import ConfigError, load_yaml_section, parse_section_timeouts

# -- protocol ------------------------------------------------------------------------------


def test_protocol_round_trip_and_heartbeat_frame():
    frame = protocol.encode(protocol.HELLO, token="t", rank=1, local_rank=1, pid=5, host="h",
                            cycle=0)
    assert protocol.decode(frame)["rank"] == 1
    assert protocol.decode(protocol.HEARTBEAT_FRAME) == {"v": protocol.VERSION, "k": "hb"}
    assert protocol.decode(protocol.heartbeat_frame(12.5)) == {"v": 1, "k": "hb", "t": 12.5}
    assert b"pickle" not in frame and frame.startswith(b"{")


@pytest.mark.parametrize(("frame", "error"), [
    (b"\x80\x04\x95", "not JSON"),
    (b"[]", "not a JSON object"),
    (b'{"v": 2, "k": "hb"}', "protocol version"),
    (b'{"v": 1, "k": "boom"}', "unknown message kind"),
    (b'{"v": 1, "k": "sec_open"}', "field 'name'"),
    (b'{"v": 1, "k": "hello", "token": "t", "rank": true, "local_rank": 0, "pid": 1, '
     b'"host": "h", "cycle": 0}', "field 'rank'"),
    (b"{" + b" " * protocol.MAX_FRAME_BYTES + b"}", "exceeds"),
])
def test_protocol_rejects_malformed_frames(frame, error):
    with pytest.raises(protocol.ProtocolError, match=error):
        protocol.decode(frame)


# The prefixes of the hot frames the agent sends (heartbeats, section opens and closes).
STAMPED = [protocol.heartbeat_frame(1.0), protocol.heartbeat_frame(1.0, folds=True),
           protocol.section_frames("compute").open(1.0),
           protocol.section_frames("compute").close(1.0),
           protocol.section_frames("шаг \\ \"x\"").open(1.0)]
STAMP_TAILS = st.one_of(
    st.binary(max_size=24),
    st.from_regex(rb"\A-?[0-9]{1,25}(\.[0-9]{0,20})?([eE][-+]?[0-9]{1,4})?\Z"),
    st.sampled_from([b"NaN", b"Infinity", b"-0", b"1e999", b"1e12", b"1000000000001",
                     b"9" * 5000, b"1_0", b" 1", b"1 ", b"0x10", b"1.5,\"dev\":2"]))


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(base=st.sampled_from(STAMPED), tail=STAMP_TAILS, closed=st.booleans())
def test_the_hot_frames_decode_exactly_as_the_json_decoder_decodes_them(base, tail, closed):
    """The stamp path (a known prefix and a number, no JSON decoder) gives the message or
    the error the full decoder gives, for any stamp bytes."""
    protocol.decode(base)  # the prefix is known once a frame with it decoded in full
    frame = base[:base.rindex(b'"t":') + 4] + tail + (b"}" if closed else b"")
    try:
        full = protocol._decode_json(frame)
    except protocol.ProtocolError as exc:
        with pytest.raises(protocol.ProtocolError, match=re.escape(str(exc))):
            protocol.decode(frame)
    else:
        assert protocol.decode(frame) == full
        assert type(protocol.decode(frame)["t"]) is float


def test_the_hot_frames_skip_the_json_decoder_and_remember_boundedly(monkeypatch):
    monkeypatch.setattr(protocol, "_STAMPED", {})
    frames = protocol.section_frames("fwd")

    def fast_path_only(frame: bytes) -> dict:
        with monkeypatch.context() as m:
            m.setattr(protocol, "_decode_json", None)  # no full decode in here
            return protocol.decode(frame)

    for _ in range(2):
        assert protocol.decode(frames.open(2.0)) == {"v": 1, "k": "sec_open", "name": "fwd",
                                                     "t": 2.0}
        assert fast_path_only(frames.open(3.5)) == {"v": 1, "k": "sec_open", "name": "fwd",
                                                    "t": 3.5}
        # Names made up per step fill the memory; it starts again, never grows past it.
        for i in range(protocol.MAX_STAMPED + 50):
            frame = protocol.section_frames(f"s{i}").close(1.0)
            assert protocol.decode(frame)["name"] == f"s{i}"
            assert len(protocol._STAMPED) <= protocol.MAX_STAMPED
    # A device time is not a stamp: the full decoder reads it.
    assert protocol.decode(frames.close(4.0, 0.25)) == {"v": 1, "k": "sec_close", "name": "fwd",
                                                        "t": 4.0, "dev": 0.25}


def test_an_agent_folds_heartbeats_closer_than_the_fold_interval_once_it_said_so(monkeypatch):
    """Injected clock: the first heartbeat within HEARTBEAT_FOLD_S is sent and says
    ``folds``; later ones within it of the last sent are folded; a slow rank never folds."""
    from ft_agent import client as client_module

    sent: list[dict] = []
    now = [100.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: now[0])
    c = client_module.RankMonitorClient()
    c._enabled = True
    c._link = types.SimpleNamespace(send=lambda frame: sent.append(protocol.decode(frame)))
    fold = protocol.HEARTBEAT_FOLD_S

    def beat_at(*times: float) -> list[tuple[float, bool]]:
        sent.clear()
        for t in times:
            now[0] = t
            c.send_heartbeat()
        return [(m["t"], m.get("folds", False)) for m in sent]

    slow = [100.0 + i * fold * 1.5 for i in range(5)]
    assert beat_at(*slow) == [(t, False) for t in slow]
    base = slow[-1] + fold * 1.5
    fast = [base + i * fold * 0.3 for i in range(12)]  # no time on a fold's boundary
    got = beat_at(*fast)
    assert got[:2] == [(fast[0], False), (fast[1], True)]  # said before the first fold
    assert [t for t, _ in got[2:]] == [fast[5], fast[9]] and all(f for _, f in got[1:])
    assert all(b - a >= fold for (a, _), (b, _) in zip(got[1:], got[2:], strict=False))


# -- configuration -------------------------------------------------------------------------


def test_yaml_then_command_line_precedence(tmp_path):
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  rank_heartbeat_timeout: 30\n"
                   "  rank_section_timeouts: {step: 10, ckpt: none}\n"
                   "  rank_termination_signal: SIGTERM\n  safety_factor: 3\n")
    ft = build_ft_config(str(cfg), {"rank_heartbeat_timeout": "7", "safety_factor": None})
    assert ft.rank_heartbeat_timeout == 7.0  # the flag beats the file
    assert ft.safety_factor == 3.0  # an unset flag does not beat the file
    assert ft.rank_section_timeouts == {"step": 10.0, "ckpt": None}
    assert ft.rank_termination_signal == signal.SIGTERM
    assert build_ft_config(None, {}).rank_heartbeat_timeout is None


@pytest.mark.parametrize(("text", "error"), [
    ("fault_tolerance:\n  safety_factr: 2\n", "did you mean 'safety_factor'"),
    ("fault_tolerance:\n  rank_heartbeat_timeout: soon\n", "rank_heartbeat_timeout"),
    ("fault_tolerance:\n  rank_termination_signal: SIGNOPE\n", "unknown signal"),
    ("faults:\n  x: 1\n", "unknown top-level key"),
    ("fault_tolerance: [1, 2]\n", "must be a mapping"),
    ("fault_tolerance:\n  a: [\n", "not valid YAML"),
])
def test_yaml_errors_name_the_key(tmp_path, text, error):
    cfg = tmp_path / "ft.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_yaml_section(str(cfg))


def test_section_timeouts_option_syntax():
    assert parse_section_timeouts("x", "a:1.5, b:none") == {"a": 1.5, "b": None}
    with pytest.raises(ConfigError, match="name:seconds"):
        parse_section_timeouts("--ft-rank-section-timeouts", "a=1")


# -- fault plans -----------------------------------------------------------------------------


def test_fault_plan_parsing_and_agreement():
    plan = faults.parse_fault("random:base_delay=2,rand_delay=1,cycles=0-2,seed=7")
    assert plan.cycles == range(0, 3) and plan.fires_in(2) and not plan.fires_in(3)
    a, b = faults.arm(plan, 1, 4, "run"), faults.arm(plan, 1, 4, "run")
    assert (a.rank, a.fault_type) == (b.rank, b.fault_type)  # every node agrees
    assert a.fault_type in ("rank_killed", "rank_hung")
    assert faults.arm(plan, 5, 4, "run") is None
    assert faults.parse_fault("rank_exit:code=16").code == 16
    for bad, error in [("rank_exit", "needs code"), ("rank_killed:delay=1", "unknown key"),
                       ("rank_killed:cycles=3-1", "empty range"),
                       ("rank_killed:base_delay=-1", "base_delay")]:
        with pytest.raises(ConfigError, match=error):
            faults.parse_fault(bad)


# -- agent -----------------------------------------------------------------------------------


def test_agent_import_is_light_and_a_no_op_without_launcher():
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "import ft_agent\n"
        "assert not {'torch', 'zmq', 'click'} & set(sys.modules), sorted(sys.modules)\n"
        "c = ft_agent.RankMonitorClient()\n"
        "try:\n"
        "    c.init_workload_monitoring()\n"
        "except RuntimeWarning as w:\n"
        "    print('WARN', w)\n"
        "c.send_heartbeat(); c.start_section('x'); c.end_section('x')\n"
        "assert c.calculate_and_set_hb_timeouts() is False\n"
        "print(c.state_dict())\n"
    )
    env = {"PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert "WARN ft_agent: FT_ENDPOINT is not set" in res.stdout
    assert json.loads(res.stdout.splitlines()[-1].replace("'", '"')) == {"current_timeouts": {}}


def test_simulated_fault_draw_and_exit_format_are_shared_by_launcher_and_agent():
    from ft_agent import simulated_fault
    from ft_agent.lightning import SimulatedFaultParams, plan_fault

    draws = {simulated_fault.draw("job", 3, 8, "random", 2.0, 1.0) for _ in range(5)}
    assert len(draws) == 1
    (d,) = draws
    assert d.fault_type in simulated_fault.SIGNAL_FAULTS and 0 <= d.rank < 8
    assert 2.0 <= d.delay <= 3.0
    # A fixed victim leaves the type and the delay as drawn.
    fixed = simulated_fault.draw("job", 3, 8, "random", 2.0, 1.0, rank=5)
    assert (fixed.fault_type, fixed.rank, fixed.delay) == (d.fault_type, 5, d.delay)
    # The launcher's plan and the Lightning callback's plan use the same draw.
    plan = faults.arm(faults.parse_fault("random:base_delay=2,rand_delay=1,seed=42"), 0, 8, "x")
    same = simulated_fault.draw("42", 0, 8, "random", 2.0, 1.0)
    assert (plan.fault_type, plan.rank) == (same.fault_type, same.rank)
    planned = plan_fault(SimulatedFaultParams("random", 2.0, 1.0), 8, "job", 0)
    agent = simulated_fault.draw("ft_agent.lightning:job", 0, 8, "random", 2.0, 1.0)
    assert (planned.fault_type, planned.rank, planned.delay) == \
        (agent.fault_type, agent.rank, agent.delay)
    value = simulated_fault.exit_fault_value(16, 1234.5)
    assert simulated_fault.parse_exit_fault(value) == (16, 1234.5)
    for bad in ("rank_exit:code=0,at=1", "rank_exit:code=16,at=nan", "rank_exit:at=1",
                "rank_killed:code=1,at=1", ""):
        assert simulated_fault.parse_exit_fault(bad) is None
