"""Straggler medians shared between launchers (ft_launcher/stragglers/straggler_exchange.py).

The decoder is total on untrusted bytes (hypothesis); the exchange runs against a real
torch TCPStore (what the c10d rendezvous hosts), with an injected clock for its rate limit.
The two-launcher run is tests/multinode (not here: it takes a real rendezvous).
"""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_launcher.stragglers.straggler import DETECTED, StragglerDetector
from ft_launcher.stragglers.straggler_exchange import (
    KEY_PREFIX,
    MAX_BYTES,
    Exchange,
    NodeMedians,
    decode_medians,
    encode_medians,
    for_round,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def server():
    from torch.distributed import TCPStore  # importing torch is most of this test's time

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def store(server, request):
    """A fresh key space of the real store per test (torch's PrefixStore)."""
    from torch.distributed import PrefixStore

    return PrefixStore(request.node.name, server)


def test_round_trip():
    data = encode_medians("node-a", "wall", {0: 0.1, 7: 0.25})
    assert decode_medians(data) == NodeMedians("node-a", "wall", {0: 0.1, 7: 0.25})


@pytest.mark.parametrize("data, words", [
    ("text", "not bytes"),
    (b"x" * (MAX_BYTES + 1), "more than"),
    (b"\xff", "not JSON"),
    (b"[1]", "version 1"),
    (b'{"v":true,"host":"h","clock":"wall","ranks":{}}', "version 1"),
    (b'{"v":1,"host":"a\\nb","clock":"wall","ranks":{}}', "host"),
    (b'{"v":1,"host":"h","clock":"cpu","ranks":{}}', "clock"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":[]}', "ranks"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":{"-1":0.1}}', "not a rank"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":{"\xd9\xa3":0.1}}', "not a rank"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":{"99999999999":0.1}}', "not a rank"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":{"0":NaN}}', "not JSON"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":{"0":1e999}}', "seconds"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":{"0":"0.1"}}', "seconds"),
    (b'{"v":1,"host":"h","clock":"wall","ranks":{"0":true}}', "seconds"),
    (b"[" * 100_000, "more than"),
    (b"[" * 5000, "not"),
])
def test_bad_publications_are_rejected_saying_why(data, words):
    got = decode_medians(data)
    assert isinstance(got, str) and words in got, got


@settings(max_examples=150, deadline=None)
@given(st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=5),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                       max_size=3),
                 max_leaves=10).map(lambda v: json.dumps({"v": 1, "host": "h",
                                                         "clock": "wall", "ranks": v}).encode()),
))
def test_decoding_is_total(data):
    got = decode_medians(data)
    assert isinstance(got, (str, NodeMedians))
    if isinstance(got, NodeMedians):
        assert decode_medians(encode_medians(got.host, got.clock, got.medians)) == got


def test_two_nodes_see_each_other_through_a_real_store(store):
    clock = Clock()
    a = Exchange(store, node=0, nodes=2, host="node-a", interval_s=3.0, now=clock)
    b = Exchange(store, node=1, nodes=2, host="node-b", interval_s=3.0, now=clock)
    assert a.poll({0: 0.1}) == [], "node b has not published yet"
    assert b.poll({1: 0.2}) == [NodeMedians("node-a", "wall", {0: 0.1})]
    clock.t += 1.0
    assert a.poll({0: 0.1}) == [], "rate-limited: no store traffic before interval_s"
    clock.t += 2.0
    assert a.poll({0: 0.12}) == [NodeMedians("node-b", "wall", {1: 0.2})]
    clock.t += 3.0
    assert b.poll({1: 0.2}) == [NodeMedians("node-a", "wall", {0: 0.12})]


def test_a_node_publishing_garbage_is_skipped_and_logged_once(store, caplog):
    clock = Clock()
    store.set(f"{KEY_PREFIX}1", b'{"v":1,"host":"evil","clock":"wall","ranks":{"0":-5}}')
    a = Exchange(store, node=0, nodes=3, host="node-a", now=clock)
    with caplog.at_level(logging.WARNING, logger="ft_launcher"):
        for _ in range(3):
            assert a.poll({0: 0.1}) == []
            clock.t += 10
    assert "seconds" in a.rejected[1]
    assert sum("rejected" in r.message for r in caplog.records) == 1


def test_a_store_that_fails_is_logged_never_raised(caplog):
    class Broken:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    ex = Exchange(Broken(), node=0, nodes=2, host="h", now=Clock())
    with caplog.at_level(logging.WARNING, logger="ft_launcher"):
        assert ex.poll({0: 0.1}) == []
    assert "store unavailable" in caplog.text


def test_the_detector_on_node_b_names_its_rank_against_node_a(store):
    """The wiring the supervisor does each tick, with two detectors and a real store:
    node b's only rank is 2x node a's and node b reports it."""
    clock = Clock()
    nodes = {}
    for node, host in ((0, "node-a"), (1, "node-b")):
        # Slow from the first step: no horizon to wait out (baseline_steps=window).
        det = StragglerDetector(window=10, now=clock, host=host, baseline_steps=10)
        nodes[node] = (det, Exchange(store, node, 2, host, interval_s=1.0, now=clock))
    events = []
    for _ in range(40):
        clock.t += 0.5
        nodes[0][0].observe(0, "compute", 0.1)
        nodes[1][0].observe(1, "compute", 0.2)
        for det, ex in nodes.values():
            for pub in ex.poll(det.local_medians(), det.active_clock()):
                for rank, median in pub.medians.items():
                    det.observe_remote(rank, pub.host, median, pub.clock)
            events += det.evaluate()
    assert [(e.event, e.rank, e.host) for e in events] == [(DETECTED, 1, "node-b")]
    assert events[0].score == pytest.approx(2.0)


def test_no_exchange_for_one_node_or_a_static_rendezvous(store):
    class Dynamic:
        round_store = store

    class Static:
        round_store = None  # fixed addresses: no store the nodes share

    assert for_round(Dynamic(), 0, 1, "h") is None
    assert for_round(Static(), 0, 2, "h") is None
    assert isinstance(for_round(Dynamic(), 1, 2, "h"), Exchange)
    with pytest.raises(AttributeError):  # a backend that lacks the store fails loudly
        for_round(object(), 0, 2, "h")
