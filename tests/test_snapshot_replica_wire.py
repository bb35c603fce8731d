"""The replica wire format: round trips, every field bounded, a wrong token refused, a
decoder that raises only WireError on any frames (hypothesis), and the streaming verifier
that accepts a real slot file only with its own commit record."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft_agent.snapshot import SnapshotStore, commit_file, slot_file
from ft_launcher.snapshots.replica_wire import (
    FIELDS,
    MAX_CHUNK,
    MAX_HEADER,
    Message,
    SlotVerifier,
    WireError,
    decode,
    encode,
)

TOKEN = "0f" * 16


def head(**fields) -> list[bytes]:
    base = {"v": 1, "op": "push", "token": TOKEN, "rank": 3, "iteration": 7, "slot": "a",
            "size": 4096}
    base.update(fields)
    return [json.dumps({k: v for k, v in base.items() if v is not ...}).encode()]


def test_round_trip_of_every_op():
    samples = [
        Message("push", 3, iteration=7, slot="b", size=10_000),
        Message("fetch", 0, iteration=None), Message("fetch", 1, iteration=-5),
        Message("list", 2), Message("abort", 2), Message("ready", 2),
        Message("have", 2, iteration=9), Message("send", 2, iteration=9, slot="a", size=99),
        Message("data", 2, offset=64, payload=b"xyz"), Message("ack", 2, offset=64),
        Message("commit", 2, payload=b"{}"), Message("done", 2, iteration=4),
        Message("error", 2, reason="busy"), Message("held", 2, iterations=(3, 5)),
    ]
    assert {m.op for m in samples} == set(FIELDS)
    for msg in samples:
        got = decode(encode(msg, TOKEN), TOKEN)
        assert got == msg
        if msg.payload is not None:
            assert bytes(got.payload) == msg.payload


@pytest.mark.parametrize("frames, reason", [
    (head(token="00" * 16), "token"),
    (head(token=TOKEN[:-1]), "token"),
    (head(token=5), "token"),
    (head(rank=-1), "bounds"),
    (head(rank=2**40), "bounds"),
    (head(rank=True), "bounds"),
    (head(rank=1.0), "bounds"),
    (head(iteration=2**64), "bounds"),
    (head(size=10**18), "bounds"),
    (head(size=3), "bounds"),
    (head(slot="d"), "format"),
    (head(extra=1), "format"),
    (head(size=...), "format"),
    (head(v=2), "format"),
    (head(op="exec"), "format"),
    ([b"\xff\xfe"], "format"),
    ([b"[1, 2]"], "format"),
    ([b'{"v": NaN}'], "format"),
    ([b"{" * 100_000], "bounds"),
    ([b" " * (MAX_HEADER + 1)], "bounds"),
    ([], "format"),
    (head() + [b"payload"], "format"),
    (encode(Message("data", 1, offset=0, payload=b""), TOKEN), "bounds"),
    (encode(Message("data", 1, offset=0, payload=b"x" * (MAX_CHUNK + 1)), TOKEN), "bounds"),
    (encode(Message("data", 1, offset=0, payload=b"x"), TOKEN)[:1], "format"),
])
def test_hostile_headers_are_refused(frames, reason):
    with pytest.raises(WireError) as e:
        decode(frames, TOKEN)
    assert e.value.reason == reason


def test_size_is_bounded_by_the_receiver():
    with pytest.raises(WireError):
        decode(head(size=2**30), TOKEN, max_size=2**20)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4), max_leaves=12)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_decoder_raises_only_wire_error_on_random_frames(frames):
    try:
        decode(frames, TOKEN)
    except WireError:
        pass


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(FIELDS)), st.dictionaries(
    st.sampled_from(["rank", "iteration", "slot", "size", "offset", "reason", "iterations",
                     "token", "v", "x"]), json_values, max_size=6), st.binary(max_size=40))
def test_decoder_raises_only_wire_error_on_near_valid_headers(op, fields, payload):
    obj = {"v": 1, "op": op, "token": TOKEN, "rank": 0, **fields}
    frames = [json.dumps(obj).encode(), payload]
    for cut in (frames[:1], frames):
        try:
            decode(cut, TOKEN)
        except WireError:
            pass


def _slot(tmp_path, state, iteration=5):
    d = tmp_path / "rank"
    with SnapshotStore(d) as store:
        store.snapshot(state, iteration, wait=True)
        store.wait()
    return (d / slot_file("a")).read_bytes(), (d / commit_file("a")).read_bytes()


STATE = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 7),
         "e": torch.empty(0), "step": 5}


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 10**9])
def test_verifier_accepts_a_real_slot_in_any_chunking(tmp_path, chunk):
    data, commit = _slot(tmp_path, STATE)
    v = SlotVerifier(len(data), 5)
    for i in range(0, len(data), chunk):
        v.feed(memoryview(data)[i:i + chunk])
    assert v.finish(commit).iteration == 5


def test_verifier_rejects_flipped_bits_truncation_and_a_foreign_commit(tmp_path):
    data, commit = _slot(tmp_path, STATE)
    # in the prefix, the header, a tensor's bytes (padding between tensors is not checked,
    # by the store's load either)
    for pos in (20, 40, data.find(struct.pack("<f", 500.0)), data.rfind(b"\x00\x00\x80?")):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        v = SlotVerifier(len(bad), 5)
        with pytest.raises(WireError):
            v.feed(memoryview(bytes(bad)))
            v.finish(commit)
    v = SlotVerifier(len(data), 5)
    v.feed(memoryview(data)[:-1])
    with pytest.raises(WireError) as e:
        v.finish(commit)
    assert e.value.reason == "truncated"
    v = SlotVerifier(len(data), 6)  # sent as another iteration than it holds
    with pytest.raises(WireError):
        v.feed(memoryview(data))
    other, other_commit = _slot(tmp_path / "x", {**STATE, "w": STATE["w"] + 1})
    v = SlotVerifier(len(data), 5)
    v.feed(memoryview(data))
    with pytest.raises(WireError) as e:
        v.finish(other_commit)
    assert e.value.reason == "checksum"
    with pytest.raises(WireError):
        SlotVerifier(len(data), 5).feed(memoryview(data + b"x"))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow,
                                                   HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=600), st.binary(max_size=100),
       st.integers(24, 700))
def test_verifier_raises_only_wire_error_on_garbage(data, commit, size):
    v = SlotVerifier(size, 0)
    try:
        v.feed(memoryview(data))
        v.finish(commit)
    except WireError:
        pass
