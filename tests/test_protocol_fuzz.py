"""Decoding is total: any bytes are a valid message or a ProtocolError, nothing else.

Three generators feed the decoder. A sweep puts each of ~40 hostile JSON values (wrong
types, out of range, too long, not printable, lone surrogates, non-finite numbers, deep
nesting) into each field of a valid message of every kind, and every field must refuse
some of them by name (the fast tier). Hypothesis builds message-shaped JSON objects (every
kind, known and unknown fields, hostile values: NaN, huge integers, deep nesting, lone
surrogates, control characters); each generated frame then seeds a fast, seeded byte-level
mutation loop (flips, hostile tokens spliced in, cuts, duplications, splices of two frames)
for volume: 15,000 frames in the fast tier, 250,500 in the slow one. The monitor's
dispatcher (``Monitor.handle_frame``) gets 20,000 frames in the fast tier and 100,000 in
the slow one. Each prints its count and time.

How many frames are enough: measured with coverage.py's branch coverage of
ft_agent/protocol.py, the sweep and 250,500 frames reach every branch of the decoder that
the sweep and 1,000,500 frames reach but one, the full cache of stamped prefixes being
emptied (tests/test_units.py tests it). The sweep also reaches three that 1,000,500 random
frames alone did not: a lone surrogate in a text field, and a section-timeouts value that is
not an object. What more volume finds is more combinations of a kind, a field and a reason
to refuse it, which the sweep tries systematically. Set ``PROTOCOL_FUZZ_FRAMES`` (e.g.
1000000) to run the slow cases over that many frames (the dispatcher over 2/5 of them);
CONTRIBUTING.md says when.

Every frame must either raise ProtocolError, or decode to a message that carries only the
fields its kind defines, re-encodes without NaN, and decodes again to itself.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft_agent import protocol

KINDS = [protocol.HELLO, protocol.CONFIG, protocol.HEARTBEAT, protocol.SECTION_OPEN,
         protocol.SECTION_CLOSE, protocol.SECTION_CLOSE_ALL, protocol.CALCULATE,
         protocol.SET_TIMEOUTS, protocol.ACK, protocol.CONTROL, protocol.DIAGNOSIS,
         protocol.REPORT, protocol.PROGRESS, protocol.GOODBYE, protocol.FENCE]

# The slow tier's volume (the docstring says why it is enough); PROTOCOL_FUZZ_FRAMES asks
# for more (or less). Not an FT_ variable: tests/conftest.py unsets those for every test.
FRAMES = int(os.environ.get("PROTOCOL_FUZZ_FRAMES", "250000"))
EXAMPLES = 500
MUTATIONS_PER_EXAMPLE = max(1, FRAMES // EXAMPLES)
DISPATCHER_FRAMES = max(1000, FRAMES * 2 // 5)

# Valid frames of every kind: the mutation loop splices and corrupts these too.
VALID = [
    protocol.encode(protocol.HELLO, token="a" * 32, rank=3, local_rank=1, pid=4242,
                    host="node-1", cycle=2),
    protocol.encode(protocol.CONFIG, ok=True, error=None, stack_signal=12,
                    timeouts={"rank_heartbeat_timeout": 30.0,
                              "rank_section_timeouts": {"step": 5}}),
    protocol.HEARTBEAT_FRAME,
    protocol.heartbeat_frame(12345.678),
    protocol.encode(protocol.SECTION_OPEN, name="step", t=1.5),
    protocol.encode(protocol.SECTION_CLOSE, name="step", t=2.5),
    protocol.encode(protocol.SECTION_CLOSE_ALL, t=3.0),
    protocol.section_frames("compute").open(5.5),
    protocol.section_frames("compute").close(6.5, 0.0125),  # with a device time
    protocol.encode(protocol.CALCULATE, req=1, what="sections", sections=["a", "b"],
                    out_of_section=True),
    protocol.encode(protocol.SET_TIMEOUTS, req=2, timeouts={
        "initial_rank_heartbeat_timeout": None, "rank_heartbeat_timeout": 12.0}),
    protocol.encode(protocol.ACK, req=2, ok=False, error="no"),
    protocol.encode(protocol.CONTROL, action="exclude_node", description="ECC errors"),
    protocol.encode(protocol.DIAGNOSIS, state="WILL_RERUN_FROM_CHECKPOINT",
                    diagnostic="PERSISTENT_ERROR", iteration=7, message="m", exit_code=16,
                    fatal=True, host="h", device="0", suspicious_host="h",
                    suspicious_device=1),
    protocol.encode(protocol.REPORT, what="exception", message="Traceback...\n"),
    protocol.encode(protocol.PROGRESS, it=10, ckpt=True, t=4.0),
    protocol.encode(protocol.GOODBYE),
    protocol.encode(protocol.FENCE, req=3, stopped_s=0.25),
]

HOSTILE_TOKENS = [
    b"NaN", b"-Infinity", b"Infinity", b"1e999", b"-1e999", b"1e-400", b"-0", b"9" * 5000,
    b"9" * 4000, b"[" * 2000, b"{" * 1000, b'{"a":' * 500, b'"\\ud800"', b'"\\udfff\\ud800"',
    b'"\\u0000"', b'"\\u001b[2J"', b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b'"', b",",
    b":", b"}", b"]", b"null", b"true", b"false", b"[]", b"{}", b'"event"', b'"rank"',
    b'"ts"', b'"cycle"', b'"name"', b'"v":1', b'"k":"hb"', b'"t":', b"\\", b"\xef\xbb\xbf",
    b"1.7976931348623157e308", b"9223372036854775808", b"-9223372036854775809", b"1_000",
]


def check(frame: bytes) -> bool:
    """The property for one frame; True when it decoded to a valid message."""
    try:
        msg = protocol.decode(frame)
    except protocol.ProtocolError:
        return False
    except BaseException as exc:  # anything else is the bug this test exists for
        pytest.fail(f"decode raised {type(exc).__name__}: {exc!s:.200} for frame "
                    f"{frame[:300]!r} ({len(frame)} bytes)")
    kind = msg["k"]
    assert msg["v"] == protocol.VERSION and kind in KINDS, msg
    extra = set(msg) - {"v", "k"} - protocol.fields_of(kind)
    assert not extra, f"{kind} carried undeclared fields {extra} from {frame[:300]!r}"
    fields = {k: v for k, v in msg.items() if k not in ("v", "k")}
    again = protocol.encode(kind, **fields)  # raises on NaN/inf: none may survive decoding
    again.decode("utf-8")
    assert protocol.decode(again) == msg
    return True


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """One to three random byte-level corruptions of ``frame``."""
    data = bytearray(frame)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(7)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:  # overwrite one byte
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif op == 1:  # a hostile token spliced in
            data[at:at] = rng.choice(HOSTILE_TOKENS)
        elif op == 2:  # a token replaces a slice
            data[at:at + rng.randrange(1, 12)] = rng.choice(HOSTILE_TOKENS)
        elif op == 3:  # cut a slice out
            del data[at:at + rng.randrange(1, 16)]
        elif op == 4:  # truncate
            del data[at:]
        elif op == 5:  # duplicate a slice
            data[at:at] = data[at:at + rng.randrange(1, 32)]
        else:  # splice with another valid frame
            other = rng.choice(VALID)
            cut = rng.randrange(len(other) + 1)
            data[at:] = other[cut:]
    return bytes(data)


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["\ud800", "\x1b[31mred", "a\nb", "\x00", "hb", "step", "é" * 300]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=20,
)
FIELD_NAMES = sorted({f for k in KINDS for f in protocol.fields_of(k)} |
                     {"event", "ts", "rank", "cycle", "name", "pid", "x"})


@st.composite
def message_frames(draw) -> bytes:
    """A message-shaped JSON object as bytes (sometimes plain random bytes)."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.binary(max_size=200))
    obj = {
        "v": draw(st.sampled_from([1, 1, 1, 2, 0, True, 1.0, "1", None])),
        "k": draw(st.sampled_from([*KINDS, *KINDS, "boom", "", 7, None])),
    }
    for name in draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=8)):
        obj[name] = draw(JSON_VALUES)
    if draw(st.booleans()):  # start from a valid message of the kind, then add to it
        base = json.loads(draw(st.sampled_from(VALID)))
        obj = {**base, **{k: v for k, v in obj.items() if k not in ("v", "k")}}
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()), allow_nan=True)
    return text.encode("utf-8", errors="surrogatepass")


def test_hostile_frames_from_the_issue_are_protocol_errors():
    """The frames that ended the whole job (issue 11), each now a ProtocolError."""
    nested = b"[" * protocol.MAX_FRAME_BYTES  # 64 KiB, just within the size limit
    cases = {
        "nested brackets": nested,
        "nested objects": b'{"a":' * (protocol.MAX_FRAME_BYTES // 5),
        "5000-digit int": b'{"v":1,"k":"hello","rank":' + b"9" * 5000 + b"}",
        "4000-digit int": b'{"v":1,"k":"progress","it":' + b"9" * 4000 + b',"ckpt":true}',
        "huge frame": b'{"v":1,"k":"hb","x":"' + b"a" * (10 * 2**20) + b'"}',
        "not UTF-8": b'{"v":1,"k":"report","what":"x","message":"\xff\xfe"}',
        "UTF-16": '{"v":1,"k":"goodbye"}'.encode("utf-16"),
        "lone surrogate": b'{"v":1,"k":"report","what":"x","message":"\\ud800"}',
        "NaN stamp": b'{"v":1,"k":"hb","t":NaN}',
        "inf stamp": b'{"v":1,"k":"hb","t":1e999}',
        "NaN timeout": b'{"v":1,"k":"set_timeouts","req":1,"timeouts":'
                       b'{"rank_heartbeat_timeout":NaN}}',
        "negative timeout": b'{"v":1,"k":"set_timeouts","req":1,"timeouts":'
                            b'{"rank_section_timeouts":{"step":-1}}}',
        "bool version": b'{"v":true,"k":"hb"}',
        "float rank": b'{"v":1,"k":"hello","token":"t","rank":0.0,"local_rank":0,"pid":1,'
                      b'"host":"h","cycle":0}',
        "rank out of range": b'{"v":1,"k":"hello","token":"t","rank":4294967296,'
                             b'"local_rank":0,"pid":1,"host":"h","cycle":0}',
        "escape in a section name": b'{"v":1,"k":"sec_open","name":"\\u001b[2Jx"}',
        "long section name": b'{"v":1,"k":"sec_open","name":"' + b"s" * 300 + b'"}',
        "unknown control": b'{"v":1,"k":"control","action":"rm -rf"}',
        "list for timeouts": b'{"v":1,"k":"set_timeouts","req":1,"timeouts":[]}',
    }
    for what, frame in cases.items():
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(frame)
        assert not check(frame), what


def test_unknown_fields_are_dropped_never_passed_on():
    """A diagnosis cannot forge event fields (issue 11: event/ts/rank forged hang_detected)."""
    frame = (b'{"v":1,"k":"diagnosis","state":"X","iteration":3,"diagnostic":null,'
             b'"event":"hang_detected","ts":1,"rank":5,"cycle":9,"name":"n","extra":[1]}')
    assert protocol.decode(frame) == {"v": 1, "k": "diagnosis", "state": "X", "iteration": 3,
                                      "diagnostic": None}


def test_a_config_reply_carries_no_path():
    """Item 12: an agent never writes to a path received over the socket."""
    frame = protocol.encode(protocol.CONFIG, ok=True, stack_file="/etc/shadow", stack_signal=12)
    assert protocol.decode(frame) == {"v": 1, "k": "config", "ok": True, "stack_signal": 12}


def test_encode_refuses_nan_and_unencodable_values():
    with pytest.raises(protocol.ProtocolError, match="cannot encode"):
        protocol.encode(protocol.SET_TIMEOUTS, req=1,
                        timeouts={"rank_heartbeat_timeout": float("nan")})
    with pytest.raises(protocol.ProtocolError, match="cannot encode"):
        protocol.encode(protocol.REPORT, what="x", message=object())


def test_every_valid_frame_round_trips():
    for frame in VALID:
        assert check(frame), frame
    assert {json.loads(f)["k"] for f in VALID} == set(KINDS)


def test_the_fuzz_knows_every_kind_of_the_protocol():
    """A kind added to the protocol and not to KINDS and VALID would never be fuzzed."""
    assert set(KINDS) == set(protocol._SCHEMA)


# JSON values, as raw text, for the sweep: every field refuses some of them.
HOSTILE_VALUES = [
    b"null", b"true", b"false", b"0", b"-1", b"0.5", b"-0.0", b"4294967296",
    b"9223372036854775808", b"-9223372036854775809", b"1e308", b"1e999", b"-1e999", b"NaN",
    b"Infinity", b"1e-400", b"9" * 5000, b'""', b'"x"', b'"step"', b'"\\u0000"',
    b'"\\u001b[2J"', b'"a\\nb"', b'"\\ud800"', b'"' + b"s" * 300 + b'"',
    b'"' + b"m" * 16_001 + b'"', b"[]", b'["a"]', b"[1]", b'["\\u001b"]', b'["a",1]',
    b"[" * 100 + b"]" * 100, b"{}", b'{"a":1}', b'{"rank_section_timeouts":[]}',
    b'{"rank_heartbeat_timeout":-1}', b'{"rank_heartbeat_timeout":"1"}',
    b'{"rank_section_timeouts":{"\\u001b":1}}', b'{"rank_section_timeouts":{"s":NaN}}',
    b"[" * 2000 + b"]" * 2000,
]


def test_every_field_of_every_kind_refuses_hostile_values_by_name():
    """Each hostile value in each field of a valid message of every kind (and each field
    left out): the decoder is total on all of them, and every field refuses some value
    with a ProtocolError that names it (so each field has a validator)."""
    refused: dict[tuple[str, str], set[bytes]] = {}
    frames = 0
    for valid in VALID:
        base = json.loads(valid)
        kind = base.pop("k")
        del base["v"]
        for field in sorted(protocol.fields_of(kind)):
            rest = {k: v for k, v in base.items() if k != field}
            without = protocol.encode(kind, **rest)
            check(without)  # a required field missing is a ProtocolError, like any other
            for value in HOSTILE_VALUES:
                frame = without[:-1] + b',"' + field.encode() + b'":' + value + b"}"
                frames += 1
                if check(frame):
                    continue
                try:
                    protocol.decode(frame)
                except protocol.ProtocolError as exc:
                    if f"field {field!r}" in str(exc):
                        refused.setdefault((kind, field), set()).add(value)
    every_field = {(k, f) for k in KINDS for f in protocol.fields_of(k)}
    assert set(refused) == every_field, sorted(every_field - set(refused))
    counts = [len(values) for values in refused.values()]
    print(f"\n{frames:,} frames; each field refused {min(counts)} to {max(counts)} of the "
          f"{len(HOSTILE_VALUES)} values by name")


def _fuzz(examples: int, mutations: int) -> dict[str, float]:
    """Run ``examples`` hypothesis frames, each followed by ``mutations`` mutated ones."""
    counted = {"frames": 0, "valid": 0}

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(frame=message_frames(), seed=st.integers(0, 2**32 - 1))
    def fuzz_one(frame: bytes, seed: int) -> None:
        rng = random.Random(seed)
        valid = check(frame)
        bases = (frame, rng.choice(VALID))
        for i in range(mutations):
            valid += check(mutate(rng, bases[i & 1]))
        counted["frames"] += 1 + mutations
        counted["valid"] += valid

    started = time.perf_counter()
    fuzz_one()
    counted["seconds"] = round(time.perf_counter() - started, 1)
    print(f"\n{counted['frames']:,} frames ({counted['valid']:,} valid) in "
          f"{counted['seconds']} s")
    return counted


def test_decoder_is_total_quick():
    """The fast tier's share: 60 generated frames and 15,000 mutated ones (~1 s idle)."""
    counted = _fuzz(60, 250)
    assert counted["frames"] >= 15_000 and counted["valid"] > 50


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_decoder_is_total_over_many_generated_and_mutated_frames():
    """500 generated frames, each seeding FRAMES / 500 mutations: 250,500 frames by default
    (PROTOCOL_FUZZ_FRAMES=1000000: 1,000,500)."""
    counted = _fuzz(EXAMPLES, MUTATIONS_PER_EXAMPLE)
    assert counted["frames"] >= FRAMES
    # Not a vacuous property: some mutated frames are still valid messages.
    assert counted["valid"] > FRAMES // 1000


# -- the dispatcher: Monitor.handle_frame ------------------------------------------------------

ALLOWED_EVENTS = {"rank_connected", "diagnosis", "rank_report", "rank_goodbye",
                  "workload_control", "timeouts_updated", "first_step", "checkpoint_saved",
                  "fault_injected"}


def _monitor(tmp_path):
    # The state file is rewritten on every accepted calc/set_timeouts: keep it in memory.
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ft_fuzz_"))
    from ft_launcher.config import FaultToleranceConfig
    from ft_launcher.hang.monitor import DIAGNOSIS_FIELDS, Monitor, RankSlot
    from ft_launcher.hang.timeouts import TimeoutBook

    recorded: list[tuple[str, dict]] = []
    ft = FaultToleranceConfig(rank_section_timeouts={"step": 30.0})
    monitor = Monitor(f"ipc://{tmp_path}/m.sock", TimeoutBook(ft), tmp_path / "state.json",
                      lambda name, **fields: recorded.append((name, fields)))
    slots = [RankSlot(rank=r, local_rank=r, pid=os.getpid(), token=f"tok{r}") for r in (0, 1)]
    monitor.start_cycle(0, slots, {0: 1.0, 1: 1.0}, tmp_path)
    return monitor, recorded, set(DIAGNOSIS_FIELDS) | {"rank"}


def _hello(rank: int) -> bytes:
    return protocol.encode(protocol.HELLO, token=f"tok{rank}", rank=rank, local_rank=rank,
                           pid=os.getpid(), host="h", cycle=0)


def _fuzz_dispatcher(tmp_path, frames: int) -> dict[str, int]:
    """``frames`` mutated frames through Monitor.handle_frame, from an authenticated peer
    (rank 0) and a stranger; every handler runs. Returns the monitor's counters."""
    monitor, recorded, diagnosis_fields = _monitor(tmp_path)
    try:
        monitor.handle_frame(b"rank0", _hello(0), 2.0)
        assert monitor.agent_pid(0) is not None, monitor.protocol_errors()
        rng = random.Random(11)
        stale = protocol.encode(protocol.HELLO, token="tok0", rank=0, local_rank=0,
                                pid=os.getpid(), host="h", cycle=1)  # another cycle's
        bases = [*VALID, _hello(0), _hello(1), stale]
        now = 2.0
        for i in range(frames):
            now += 0.001
            frame = mutate(rng, rng.choice(bases)) if i % 4 else rng.choice(bases)
            identity = b"rank0" if i % 8 else b"stranger"
            monitor.handle_frame(identity, frame, now)  # must not raise
            if i % 1000 == 0 and monitor.agent_pid(0) is None:  # keep rank 0 connected
                monitor.handle_frame(b"rank0", _hello(0), now)
        errors = monitor.protocol_errors()
    finally:
        monitor.close()
        if str(monitor.state_path).startswith("/dev/shm/"):
            shutil.rmtree(monitor.state_path.parent, ignore_errors=True)
    assert "handler_error" not in errors, errors
    for name, fields in recorded:
        assert name in ALLOWED_EVENTS, (name, fields)
        assert fields.get("rank", 0) in (0, 1), (name, fields)
        if name == "diagnosis":
            assert set(fields) <= diagnosis_fields, fields
    assert errors.get("malformed", 0) > frames // 4, errors
    return errors


def test_dispatcher_never_raises_quick(tmp_path):
    """20,000 valid and mutated frames through the monitor's dispatcher (~2 s)."""
    _fuzz_dispatcher(tmp_path, 20_000)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dispatcher_never_raises_over_many_frames(tmp_path):
    """100,000 frames through Monitor.handle_frame (decoder included), every handler
    reached (PROTOCOL_FUZZ_FRAMES / 2.5 of them when set)."""
    started = time.perf_counter()
    errors = _fuzz_dispatcher(tmp_path, DISPATCHER_FRAMES)
    print(f"\n{DISPATCHER_FRAMES:,} frames through the dispatcher in "
          f"{time.perf_counter() - started:.1f} s; counted: {errors}")
