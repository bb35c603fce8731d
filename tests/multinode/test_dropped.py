"""A node dropped from its round while it was stopped: the rule (pure, on a made-up state and
clock) and the reading of a real c10d rendezvous (two handlers in this process, no launcher).

The whole scenario (a frozen node's launcher and workers, a spare) is test_frozen.py.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from ft_launcher.nodes.rendezvous import RendezvousClosed
from ft_launcher.nodes.torch_rendezvous import DynamicRendezvous, out_of_round

from .conftest import free_ports, in_thread

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def _state(round_no: int = 3, members=("a", "b"), closed: bool = False, ages=None):
    ages = ages or {}
    return SimpleNamespace(
        round=round_no, closed=closed, participants={m: i for i, m in enumerate(members)},
        last_heartbeats={m: NOW - timedelta(seconds=ages.get(m, 0.3)) for m in members})


def test_a_node_is_in_its_round_until_the_others_drop_it_or_move_on():
    assert out_of_round(_state(), "b", 3, 2.0, now=NOW) is None
    assert out_of_round(_state(), "b", None, 2.0, now=NOW) is None  # never joined a round
    assert "dropped from round 3" in out_of_round(_state(members=("a",)), "b", 3, 2.0, now=NOW)
    assert "round 3 is over" in out_of_round(_state(round_no=4), "b", 3, 2.0, now=NOW)
    assert "closed" in out_of_round(_state(closed=True), "b", 3, 2.0, now=NOW)


def test_after_a_stall_a_keep_alive_close_to_the_expiry_counts_as_out():
    old = _state(ages={"b": 1.6})  # dropped at 2.0 s: within one 0.5 s interval of it
    assert out_of_round(old, "b", 3, 2.0, now=NOW) is None  # the plain poll: still in
    assert "1.6 s old" in out_of_round(old, "b", 3, 2.0, margin_s=0.5, now=NOW)
    assert out_of_round(_state(ages={"b": 1.4}), "b", 3, 2.0, margin_s=0.5, now=NOW) is None


def test_a_naive_keep_alive_time_is_read_as_utc():
    # torch 2.4 records keep-alives with datetime.utcnow() (naive), later releases aware ones
    old = _state(ages={"b": 1.6})
    old.last_heartbeats = {m: t.replace(tzinfo=None) for m, t in old.last_heartbeats.items()}
    assert "1.6 s old" in out_of_round(old, "b", 3, 2.0, margin_s=0.5, now=NOW)


@pytest.mark.timeout(120)
def test_a_node_that_stops_keeping_alive_is_seen_lost_and_finds_itself_out():
    port = free_ports(1)[0]
    a = DynamicRendezvous(f"127.0.0.1:{port}", "dropped", 2, 2, {}, None)  # hosts the store
    b = DynamicRendezvous(f"127.0.0.1:{port}", "dropped", 2, 2, {}, None)
    try:
        ta, box_a = in_thread(a.next_round)
        tb, box_b = in_thread(b.next_round)
        ta.join(60)
        tb.join(60)
        assert "value" in box_a and "value" in box_b, (box_a, box_b)
        assert a.poll_round() == b.poll_round()  # nobody waiting, lost or dropped
        assert a.standing(0.0).current and b.standing(0.0).current

        b.handler._stop_heartbeats()  # b's launcher is frozen: its keep-alive thread too
        stopped = time.monotonic()
        deadline = stopped + 30
        view = a.poll_round()
        while not view.lost and time.monotonic() < deadline:
            time.sleep(0.05)
            view = a.poll_round()
        seen_s = time.monotonic() - stopped
        print(f"\nb stopped keeping alive -> a saw it lost after {seen_s:.2f} s")
        assert view.lost == (str(b._node),) and view.dropped is None
        # Not before its keep-alive lapsed: 2 s after the last one, sent < ~1 s before the stop.
        assert seen_s >= 0.9

        standing = b.standing(seen_s)
        assert not standing.current and standing.known, standing
        assert "dropped from round" in standing.reason, standing.reason
        assert b.poll_round().dropped is not None

        b.mark_dropped()  # the job ends before b is needed again: it ends like a spare
        a.shutdown(close=True)
        with pytest.raises(RendezvousClosed, match="dropped") as err:
            b.next_round()
        assert err.value.was_spare
    finally:
        b.shutdown()
        a.shutdown()
