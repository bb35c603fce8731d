"""The rendezvous's rules on an injected clock, no store: liveness by keep-alive counters,
when a round closes and in what order, the coordinator's decisions, a node's standing, and
the records read from a store (untrusted: nothing but RecordError on bad input)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_launcher.nodes.records import (
    LOST,
    REJOIN,
    LostNode,
    Membership,
    NodeInfo,
    Notice,
    RecordError,
    Verdict,
)
from ft_launcher.nodes.rounds import (
    Close,
    CloseRule,
    CoordinatorCore,
    KeepAliveBook,
    Open,
    Seen,
    close_round,
    counter_value,
    order_members,
    out_reason,
)
from ft_launcher.nodes.verdicts import settle_s


def node(name: str) -> NodeInfo:
    return NodeInfo(name, "127.0.0.1", f"host-{name}")


# -- liveness ---------------------------------------------------------------------------


def test_a_node_lapses_when_its_counter_stops_changing_for_the_expiry():
    book = KeepAliveBook(dead_after=2.0, interval=0.5)
    for i, t in enumerate([0.0, 0.5, 1.0]):
        book.observe({"a": i, "b": i}, t)
    for t in (1.5, 2.0, 2.5, 3.0, 3.5):  # a goes on, b stopped at 1.0
        book.observe({"a": int(t * 2), "b": 2}, t)
    assert book.lapsed(["a", "b"], 3.0) == []  # b: exactly 2.0 s unchanged
    assert book.lapsed(["a", "b"], 3.5) == ["b"]
    assert book.last_seen("b", 3.5) == 2.5


def test_a_node_first_seen_is_presumed_alive_whatever_its_counter():
    book = KeepAliveBook(dead_after=2.0, interval=0.5)
    book.observe({"a": None}, 10.0)  # joined; its counter not read yet
    for t in (10.5, 11.0, 11.5, 12.0):
        book.observe({"a": None}, t)
    assert book.lapsed(["a"], 12.0) == []
    book.observe({"a": None}, 12.5)
    assert book.lapsed(["a"], 12.5) == ["a"]


def test_a_watcher_that_did_not_look_for_a_while_drops_nobody_for_it():
    book = KeepAliveBook(dead_after=2.0, interval=0.5)
    book.observe({"a": 1}, 0.0)
    book.observe({"a": 1}, 10.0)  # the coordinator itself was stopped 10 s
    assert book.lapsed(["a"], 10.0) == []
    for t in (10.5, 11.0, 11.5, 12.0):
        book.observe({"a": 1}, t)
    assert book.lapsed(["a"], 12.0) == []  # a whole expiry from the watcher's return
    book.observe({"a": 1}, 12.5)
    assert book.lapsed(["a"], 12.5) == ["a"]


def test_forget_keeps_only_the_nodes_named():
    book = KeepAliveBook(dead_after=2.0, interval=0.5)
    book.observe({"a": 1, "b": 1}, 0.0)
    book.forget(["a"])
    assert set(book.changed_at) == {"a"}


@pytest.mark.parametrize("data, value", [(b"7", 7), (None, None), (b"x", None),
                                         (b"9" * 30, None)])
def test_a_counter_read_from_the_store_is_checked(data, value):
    assert counter_value(data) == value


# -- closing a round --------------------------------------------------------------------


def test_a_round_closes_at_once_when_full():
    rule = CloseRule(2, 3, 1.0)
    joined = [node("a"), node("b"), node("c"), node("d")]
    m = close_round(rule, 0, joined, [], set(), None, 0.0)
    assert [n.node for n in m.nodes] == ["a", "b", "c"] and [n.node for n in m.spares] == ["d"]


def test_below_the_maximum_a_round_closes_after_the_last_call():
    rule = CloseRule(2, 3, 1.0)
    joined = [node("a"), node("b")]
    assert close_round(rule, 0, joined[:1], [], set(), None, 5.0) is None  # below the minimum
    assert close_round(rule, 0, joined, [], set(), 0.0, 0.9) is None
    assert close_round(rule, 0, joined, [], set(), 0.0, 1.0) is not None


def test_a_round_closes_as_soon_as_every_expected_node_is_back():
    rule = CloseRule(2, 3, 1.0)
    joined = [node("b"), node("a")]
    m = close_round(rule, 4, joined, ["a", "b", "c"], {"a", "b"}, 0.0, 0.01)
    assert m is not None and [n.node for n in m.nodes] == ["a", "b"]
    assert close_round(rule, 4, joined[:1] + [node("x")], ["a", "b"], {"a", "b"}, 0.0,
                       0.01) is None


def test_the_previous_rounds_nodes_keep_their_order_and_their_places():
    joined = [node("new"), node("c"), node("a")]
    assert [n.node for n in order_members(joined, ["a", "b", "c"])] == ["a", "c", "new"]
    m = close_round(CloseRule(2, 2, 1.0), 1, joined, ["a", "b", "c"], set(), None, 0.0)
    assert [n.node for n in m.nodes] == ["a", "c"] and [n.node for n in m.spares] == ["new"]


# -- the coordinator --------------------------------------------------------------------


def core(min_nodes: int = 2, max_nodes: int = 2) -> CoordinatorCore:
    return CoordinatorCore(CloseRule(min_nodes, max_nodes, 1.0), KeepAliveBook(2.0, 0.5), "co")


def test_the_coordinator_closes_a_full_round_then_drops_a_node_that_stops_keeping_alive():
    c = core()
    assert c.step(Seen(joins=(node("a"),)), 0.0) == []
    [close] = c.step(Seen(joins=(node("b"),), counters={"a": 1}), 0.1)
    assert isinstance(close, Close) and close.membership.rank_of("b") == 1
    assert c.watched() == ["a", "b"]
    t = 0.1
    for i in range(8):  # a keeps alive, b stopped
        t += 0.5
        actions = c.step(Seen(counters={"a": 2 + i, "b": 1}), t)
        if actions:
            break
    [opened] = actions
    assert isinstance(opened, Open) and opened.notice.why == LOST
    assert [n.node for n in opened.notice.lost] == ["b"] and opened.notice.round == 1
    assert opened.notice.lost[0].last_seen_s > 2.0
    assert c.step(Seen(counters={"a": 20, "b": 1}), t + 0.5) == []  # opened once


def test_someone_opening_the_next_round_starts_its_collection():
    c = core()
    c.step(Seen(joins=(node("a"), node("b"))), 0.0)
    assert c.step(Seen(next_open=Notice(1, REJOIN, "b")), 1.0) == []
    assert (c.round, c.collecting, c.expected) == (1, True, {"a", "b"})
    [close] = c.step(Seen(joins=(node("b"), node("a"))), 1.1)
    assert [n.node for n in close.membership.nodes] == ["a", "b"]  # the old order


def test_a_round_still_collected_when_the_next_one_opens_is_abandoned():
    c = core(min_nodes=3, max_nodes=3)
    c.step(Seen(joins=(node("a"),)), 0.0)
    [abandon] = c.step(Seen(next_open=Notice(1, REJOIN, "a")), 1.0)
    assert abandon.membership == Membership(0, abandoned=True)
    assert c.round == 1 and c.joined == []


def test_a_lost_node_is_not_waited_for_in_the_next_round():
    c = core(min_nodes=1, max_nodes=3)
    c.step(Seen(joins=(node("a"), node("b"), node("c"))), 0.0)
    c.step(Seen(next_open=Notice(1, LOST, "co", (LostNode("c", "h", 2.5),))), 1.0)
    assert c.expected == {"a", "b"}
    [close] = c.step(Seen(joins=(node("a"), node("b"))), 1.05)
    assert len(close.membership.nodes) == 2


def test_a_joiner_that_stops_keeping_alive_before_the_close_is_left_out():
    c = CoordinatorCore(CloseRule(2, 4, 5.0), KeepAliveBook(2.0, 0.5), "co")
    c.step(Seen(joins=(node("a"), node("b"), node("c"))), 0.0)
    actions, t = [], 0.0
    while not actions:
        t += 0.5  # a never keeps alive; b and c do
        actions = c.step(Seen(counters={"a": 0, "b": int(t * 2), "c": int(t * 2)}), t)
    [close] = actions
    assert t == 5.0  # the last call: the maximum was never reached
    assert [n.node for n in close.membership.nodes] == ["b", "c"]


# -- a node's standing -------------------------------------------------------------------


def test_a_node_dropped_by_the_coordinator_is_out_and_says_why():
    notice = Notice(4, LOST, "co", (LostNode("me", "h", 2.4),))
    why = out_reason(notice, "me", 3, 0.0, 2.0, 0.5)
    assert "dropped from round 3" in why and "2.4 s" in why


def test_a_next_round_opened_by_others_means_this_round_is_over():
    why = out_reason(Notice(4, REJOIN, "x"), "me", 3, 0.0, 2.0, 0.5)
    assert "round 3 is over" in why


def test_a_node_whose_keep_alive_paused_near_the_expiry_counts_itself_out():
    assert out_reason(None, "me", 3, 1.4, 2.0, 0.5) is None
    assert "paused 1.6 s" in out_reason(None, "me", 3, 1.6, 2.0, 0.5)


# -- the hang verdict --------------------------------------------------------------------


def test_weaker_evidence_waits_longer_for_a_stronger_verdict():
    assert settle_s(3) == 0.0  # stopped: decides at once
    assert 0 < settle_s(2) < settle_s(1) <= settle_s(0)


# -- records (untrusted) ----------------------------------------------------------------


def test_records_round_trip():
    m = Membership(3, (node("a"), node("b")), (node("c"),))
    assert Membership.decode(m.encode()) == m
    n = Notice(4, LOST, "co", (LostNode("b", "h", 2.5),),
               verdict={"rank": 1, "node": "a", "host": "h", "group_rank": 0,
                        "blame": "stopped", "timeout_kind": "heartbeat", "silence_s": 4.2})
    assert Notice.decode(n.encode()) == n
    v = Verdict(3, "a", "h", 1, "not_in_collective", "section:step", 9.5)
    assert Verdict.decode(v.encode()) == v and v.strength == 2


@pytest.mark.parametrize("data", [
    b"", b"[]", b"{", b'{"round": -1, "nodes": []}', b'{"round": 1, "nodes": [{"node": ""}]}',
    b'{"round": 1, "nodes": [{"node": "a b", "addr": "x", "host": "h"}]}',
    json.dumps({"round": 1, "nodes": [{"node": "a", "addr": "x", "host": "h"}] * 2}).encode(),
    b"x" * (5 << 20),
])
def test_a_malformed_membership_raises_record_error_only(data):
    with pytest.raises(RecordError):
        Membership.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["round", "nodes", "spares", "why", "by",
                                                       "lost", "verdict", "node", "addr",
                                                       "host", "rank", "blame", "last_seen_s",
                                                       "timeout_kind", "silence_s",
                                                       "group_rank"]), inner, max_size=8),
                    max_leaves=30))
def test_decoders_never_raise_anything_but_record_error(value):
    data = json.dumps(value, allow_nan=True).encode()
    for decode in (Membership.decode, Notice.decode, Verdict.decode, NodeInfo.decode):
        try:
            decode(data)
        except RecordError:
            pass
