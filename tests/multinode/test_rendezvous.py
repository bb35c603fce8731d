"""torch's rendezvous (``--rdzv-backend torch-c10d``, ``etcd-v2``) on its own: timings and
their parsing, torch's hooks taking effect, hot-spare events, and a lost c10d store (real
TCPStores and torch handlers, no launcher)."""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import pytest

from ft_launcher.config import ConfigError
from ft_launcher.nodes.rendezvous import (
    RendezvousClosed,
    RendezvousLost,
    RendezvousTimings,
    parse_endpoints,
)
from ft_launcher.nodes.torch_rendezvous import DynamicRendezvous, install_poll_interval

from .conftest import free_ports, in_thread, wait_until


def test_default_timings_detect_a_dead_node_fast():
    t = RendezvousTimings()
    assert t.dead_after == 2.0  # torch: 5 s x 3 = 15 s
    assert t.last_call_timeout == 1.0  # torch: 30 s
    assert t.poll_interval == 0.1  # torch: 1 s


def test_rdzv_conf_overrides_timings_and_passes_the_rest_through():
    t, rest = RendezvousTimings.from_conf({"keep_alive_interval": "0.25", "last_call_timeout":
                                           "3", "keep_alive_max_attempt": "6",
                                           "is_host": "false", "read_timeout": "7"})
    assert (t.keep_alive_interval, t.keep_alive_max_attempt, t.last_call_timeout) == \
        (0.25, 6, 3.0)
    assert t.dead_after == 1.5
    assert t.read_timeout == 7.0
    assert rest == {"is_host": "false"}


@pytest.mark.parametrize("conf, needle", [
    ({"join_timeout": "soon"}, "join_timeout"),
    ({"keep_alive_interval": "-1"}, "keep_alive_interval"),
    ({"close_timeout": "nan"}, "close_timeout"),
    ({"keep_alive_max_attempt": "2"}, "keep_alive_max_attempt: must be at least 3"),
    ({"keep_alive_max_attempt": "1.5"}, "keep_alive_max_attempt"),
])
def test_bad_rdzv_conf_names_the_key(conf, needle):
    with pytest.raises(ConfigError, match=needle):
        RendezvousTimings.from_conf(conf)


def test_endpoints_parse():
    assert parse_endpoints("a:1,b:2, c", 2379) == [("a", 1), ("b", 2), ("c", 2379)]
    assert parse_endpoints("[::1]:5", 9) == [("::1", 5)]
    for bad in ("a:0", "a:x", ":5", "a:1,,b:2"):
        with pytest.raises(ConfigError, match="--rdzv-endpoint"):
            parse_endpoints(bad, 2379)


def test_poll_interval_replaces_torchs_fixed_one_second():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    assert install_poll_interval(0.05)
    assert install_poll_interval(0.05)  # twice: wraps torch's original, not itself
    start = time.monotonic()
    dr._delay(seconds=1)  # what the join loop calls between polls
    dr._delay(seconds=(0, 0.3))  # the random skew before a round, capped at one poll
    assert time.monotonic() - start < 0.5
    install_poll_interval(RendezvousTimings().poll_interval)


def test_event_names_are_those_torch_would_compute_without_reading_source():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    install_poll_interval(RendezvousTimings().poll_interval)

    def record():  # stands for torch's _record(), which asks who called it
        return dr.get_method_name(), dr.get_method_name.ft_original()

    def _keep_alive():
        return record()

    ours, torchs = _keep_alive()
    assert ours == torchs == "_keep_alive"


def _rdzv(port: int, run_id: str, max_nodes: int = 1, events=None, **conf: str):
    return DynamicRendezvous(f"127.0.0.1:{port}", run_id, 1, max_nodes, dict(conf), None,
                             events=events)


def test_handler_runs_with_the_chosen_timings():
    port = free_ports(1)[0]
    r = _rdzv(port, "timings", keep_alive_interval="0.3")
    try:
        s = r.handler.settings
        assert s.keep_alive_interval == timedelta(seconds=0.3)
        assert s.keep_alive_max_attempt == 4
        assert s.timeout.last_call == timedelta(seconds=1)
        assert r.handler._state_holder._cache_duration == 0.1
        rnd = r.next_round()
        assert (rnd.group_rank, rnd.group_world_size, rnd.master_addr) == (0, 1, "127.0.0.1")
        assert r.num_nodes_waiting() == 0
    finally:
        r.shutdown()


def test_local_addr_is_what_this_node_advertises_as_the_workers_master():
    """torchrun's --local-addr: the address in the node's descriptor and, as group rank 0,
    the workers' MASTER_ADDR (by default: the address routed towards the endpoint)."""
    port = free_ports(1)[0]
    r = DynamicRendezvous(f"127.0.0.1:{port}", "local-addr", 1, 1, {}, None,
                          local_addr="127.0.0.3")
    try:
        assert r._node.addr == "127.0.0.3"
        assert r.next_round().master_addr == "127.0.0.3"
    finally:
        r.shutdown()


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def __call__(self, name: str, **fields) -> None:
        self.events.append((name, fields))

    def names(self) -> list[str]:
        return [n for n, _ in self.events]


def test_a_node_that_finds_the_round_full_waits_as_a_spare_and_is_admitted():
    port = free_ports(1)[0]
    a = _rdzv(port, "spare")
    rec = _Recorder()
    b = _rdzv(port, "spare", events=rec)
    try:
        assert a.next_round().group_world_size == 1
        thread, box = in_thread(b.next_round)
        deadline = time.monotonic() + 10
        while "spare_waiting" not in rec.names() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rec.names() == ["spare_waiting"], box
        assert b.waiting_as_spare
        assert a.num_nodes_waiting() == 0  # a spare does not make the others restart
        time.sleep(0.3)
        a.shutdown(close=False)  # node A is lost: leaves the round without closing it
        thread.join(10)
        assert "value" in box, box
        assert box["value"].group_world_size == 1
        assert rec.names() == ["spare_waiting", "spare_admitted"]
        admitted = rec.events[1][1]
        assert admitted["waited_s"] >= 0.3 and admitted["group_rank"] == 0
        assert box["value"].spare_wait_s == admitted["waited_s"]
        assert not b.waiting_as_spare
    finally:
        b.shutdown()
        a.shutdown()


def test_a_spare_that_was_never_needed_learns_that_the_job_is_over():
    port = free_ports(1)[0]
    a = _rdzv(port, "over")
    rec = _Recorder()
    b = _rdzv(port, "over", events=rec)
    try:
        a.next_round()
        thread, box = in_thread(b.next_round)
        deadline = time.monotonic() + 10
        while "spare_waiting" not in rec.names() and time.monotonic() < deadline:
            time.sleep(0.02)
        a.shutdown(close=True)  # the job finished: the rendezvous is closed
        thread.join(10)
        assert isinstance(box.get("error"), RendezvousClosed), box
        assert box["error"].was_spare
    finally:
        b.shutdown()


def test_a_lost_c10d_store_raises_rendezvous_lost_promptly():
    from torch.distributed import TCPStore

    port = free_ports(1)[0]
    # The store's host, in this process: dropping the last reference stops its server.
    host = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                    timeout=timedelta(seconds=30))
    r = _rdzv(port, "lost", is_host="false")
    try:
        assert r.next_round().group_world_size == 1
        assert r.num_nodes_waiting() == 0
        del host
        gc.collect()
        start = time.monotonic()
        with pytest.raises(RendezvousLost) as info:
            for _ in range(100):
                r.num_nodes_waiting()
                time.sleep(0.05)
        assert time.monotonic() - start < r.timings.dead_after
        message = str(info.value)
        assert f"c10d store at 127.0.0.1:{port} is unreachable" in message
        assert "See inner exception" not in message  # the socket's own error is named
        with pytest.raises(RendezvousLost):
            r.next_round()
    finally:
        r.shutdown()


class _Interrupt(Exception):
    """Stands for the supervisor's exception raised by its signal handler."""


def test_an_interrupt_while_waiting_as_a_spare_gets_through():
    port = free_ports(1)[0]
    a = _rdzv(port, "interrupt")
    seen = []

    def events(name, **fields):
        seen.append(name)
        if name == "spare_waiting":
            raise _Interrupt  # e.g. SIGTERM arrived while the event was being written

    def broken(name, **fields):
        raise OSError("disk full")  # a failure to record is not a reason to stop waiting

    b = _rdzv(port, "interrupt", events=events)
    try:
        a.next_round()
        with pytest.raises(_Interrupt):
            b.next_round()
        assert seen == ["spare_waiting"]
        b.events = broken
        thread, box = in_thread(b.next_round)
        time.sleep(1.0)
        assert thread.is_alive() and b.waiting_as_spare  # still waiting, error logged
        a.shutdown(close=False)
        thread.join(10)
        assert box["value"].group_world_size == 1
    finally:
        b.shutdown()
        a.shutdown()


def test_rendezvous_mistakes_name_the_option():
    from ft_launcher.nodes.rendezvous import RendezvousError

    with pytest.raises(ConfigError, match="--rdzv-endpoint: required with --rdzv-backend etcd"):
        DynamicRendezvous("", "x", 1, 2, {}, None, backend="etcd-v2")
    with pytest.raises(ConfigError, match="--rdzv-endpoint: bad port"):
        DynamicRendezvous("127.0.0.1:99999", "x", 1, 2, {}, None, backend="etcd-v2")
    with pytest.raises(ConfigError, match="--rdzv-conf protocol"):
        DynamicRendezvous("127.0.0.1:2379", "x", 1, 2, {"protocol": "ftp"}, None,
                          backend="etcd-v2")
    nobody = free_ports(1)[0]
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{nobody}: cannot reach the etcd-v2"):
        DynamicRendezvous(f"127.0.0.1:{nobody}", "x", 1, 2, {}, None, backend="etcd-v2")


def test_a_node_left_on_the_wait_list_of_a_full_round_is_a_spare_not_a_reason_to_restart():
    """a and b form a round and c waits as a spare. a re-joins (its rank hung): while b is
    still in the round it is short, so torch puts a, and c with it, on the wait list. Then
    b re-joins and two of the three take the places of the next round. The one left out
    stays on torch's wait list; counted as waiting, it made the round's nodes restart, and
    the same race left one out again: a restart storm seen in the snapshot soak."""
    port = free_ports(1)[0]
    recs = {n: _Recorder() for n in "abc"}
    nodes = {n: _rdzv(port, "storm", max_nodes=2, events=recs[n]) for n in "abc"}
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    try:
        ta, box_a = in_thread(a.next_round)
        tb, box_b = in_thread(b.next_round)
        ta.join(20)
        tb.join(20)
        assert "value" in box_a and "value" in box_b, (box_a, box_b)
        tc, box_c = in_thread(c.next_round)
        wait_until(lambda: "spare_waiting" in recs["c"].names(), 10, "c waiting as a spare")
        assert c.waiting_as_spare
        ta, box_a = in_thread(a.next_round)  # a restarts first: b is still in the round
        wait_until(lambda: a._node in a._read_state().wait_list, 10, "a on the wait list")
        time.sleep(0.3)  # c sees the short round and moves to the wait list
        tb, box_b = in_thread(b.next_round)
        boxes = {"a": box_a, "b": box_b, "c": box_c}
        wait_until(lambda: sum("value" in box for box in boxes.values()) >= 2, 20,
                   "two of the three in the next round")
        joined = sorted(n for n, box in boxes.items() if "value" in box)
        left = ({"a", "b", "c"} - set(joined)).pop()
        assert len(joined) == 2, boxes
        time.sleep(0.5)  # several state reads of the one left out
        state = a._read_state()
        print(f"\nnext round: {joined}; {left} on the wait list: "
              f"{nodes[left]._node in state.wait_list}")
        for n in joined:
            assert nodes[n].poll_round().waiting == 0, (n, state.wait_list)
        assert nodes[left].waiting_as_spare
        assert "spare_waiting" in recs[left].names()
    finally:
        for r in (a, b, c):
            r.shutdown()
