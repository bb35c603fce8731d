"""Snapshots across nodes: the pure agreement on fake data, the store exchange on torch's
real in-process store, and two or three launchers' snapshot services (threads, real files,
real replica servers on loopback) agreeing, replicating and fetching."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_agent import snapshot as store
from ft_launcher.snapshots.replication import buddy_nodes
from ft_launcher.snapshots.service import JobSnapshots, SnapshotOptions, WorldRound
from ft_launcher.snapshots.world import (
    Holdings,
    StoreExchange,
    agree,
    decode,
    encode,
    holders,
    key,
    verdicts_reason,
)

# -- pure ----------------------------------------------------------------------------------


def test_holdings_round_trip_and_key_names_the_round():
    h = Holdings(2, "tcp://127.0.0.1:5555", {0: (3, 4), 7: (4,)})
    assert decode(encode(h)) == h and decode(encode(h).encode()) == h
    assert key(5, "holds", 2) == "ft/snapshots/round5/holds/2" != key(6, "holds", 2)


@pytest.mark.parametrize("text", [
    "", "nul", "[]", '{"node": -1, "endpoint": null, "ranks": {}}',
    '{"node": true, "endpoint": null, "ranks": {}}',
    '{"node": 0, "endpoint": "http://x", "ranks": {}}',
    '{"node": 0, "endpoint": null, "ranks": {"x": [1]}}',
    '{"node": 0, "endpoint": null, "ranks": {"1": [1.5]}}',
    '{"node": 0, "endpoint": null, "ranks": {"1": "12"}}',
    '{"node": 0, "endpoint": null, "ranks": {"1": [' + ",".join(["1"] * 99) + "]}}",
    b"\xff\xfe",
])
def test_decode_refuses_malformed(text):
    assert decode(text) is None


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                         max_size=3)))
def test_decode_never_raises(obj):
    decode(json.dumps(obj))


def test_agree_uses_the_union_of_every_node():
    published = {0: Holdings(0, "tcp://a:1", {0: (4, 5), 1: (4,)}),  # rank 1: a replica
                 1: Holdings(1, "tcp://b:1", {1: (4, 5), 2: (3, 4)})}
    a = agree([0, 1, 2], published)
    assert a.iteration == 4 and a.union == {0: [4, 5], 1: [4, 5], 2: [3, 4]}
    assert agree([0, 1], published).iteration == 5
    none = agree([0, 1, 2, 3], published)
    assert none.iteration is None and none.reason == "rank(s) 3 have no snapshot"


def test_holders_prefer_other_nodes_and_skip_nodes_without_a_server():
    published = {0: Holdings(0, "tcp://a:1", {1: (4,)}), 1: Holdings(1, None, {1: (4,)}),
                 2: Holdings(2, "tcp://c:1", {1: (4, 5)})}
    assert holders(1, 4, published, me=0) == ["tcp://c:1", "tcp://a:1"]
    assert holders(1, 3, published, me=0) == []


def test_verdicts_and_buddy_ring():
    assert verdicts_reason({0: "ok", 1: "ok"}) is None
    assert verdicts_reason({0: "ok", 1: "rank 1: fetch failed"}) == "node 1: rank 1: fetch failed"
    assert buddy_nodes(0, 3, 1) == (1,) and buddy_nodes(2, 3, 2) == (0, 1)
    assert buddy_nodes(0, 1, 1) == ()


# -- the exchange on torch's real store ----------------------------------------------------


def test_exchange_gathers_every_node_and_bounds_the_wait_for_a_silent_one():
    s = dist.HashStore()
    exchanges = [StoreExchange(s, 3, n, 3, timeout_s=0.3) for n in range(3)]
    exchanges[0].publish("holds", "a")
    exchanges[2].publish("holds", "c")
    started = time.monotonic()
    got, missing = exchanges[0].gather("holds")
    assert got == {0: b"a", 2: b"c"} and missing == [1]
    assert time.monotonic() - started < 10  # bounded (0.3 s asked; a busy machine is slow)
    # Another round's keys are never read.
    assert StoreExchange(s, 4, 0, 3, timeout_s=0.1).gather("holds") == ({}, [0, 1, 2])


# -- launchers' services agreeing through a store (threads, real files and servers) --------


def node(tmp_path: Path, name: str, replicas: int = 1, nproc: int = 1
         ) -> tuple[JobSnapshots, list[tuple[str, dict]]]:
    evs: list[tuple[str, dict]] = []
    (tmp_path / "shm").mkdir(exist_ok=True)
    job = JobSnapshots(SnapshotOptions("1", 2**22, replicas), "run", tmp_path / name,
                       tmp_path / f"ipc-{name}", lambda n, **f: evs.append((n, f)), nproc,
                       shm=tmp_path / "shm")
    job.exchange_timeout_s = 20.0
    return job, evs


def write(job: JobSnapshots, rank: int, iterations: list[int]) -> None:
    with store.SnapshotStore(job.area.rank_dir(rank)) as s:
        for it in iterations:
            s.snapshot({"w": torch.full((64,), float(it)), "it": it}, it, wait=True)


def client(s):
    """Each launcher's own client of the store (one client's wait blocks its socket)."""
    if isinstance(s, dist.TCPStore):
        return dist.TCPStore("127.0.0.1", s.port, is_master=False)
    return s


def cycle(jobs: list[tuple[JobSnapshots, list[int]]], s, round_no: int) -> list[dict]:
    """Every node's begin_cycle at once (each blocks on the others' publications)."""
    out: list[dict] = [{} for _ in jobs]
    clients = [client(s) for _ in jobs]

    def one(i: int) -> None:
        job, ranks = jobs[i]
        out[i] = job.begin_cycle(ranks, len(jobs), WorldRound(
            clients[i], clients[i], round_no, i, len(jobs), "127.0.0.1"))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def push_all(job: JobSnapshots, evs: list, count: int) -> None:
    deadline = time.monotonic() + 60
    while sum(n == "snapshot_replicated" for n, _ in evs) < count:
        assert time.monotonic() < deadline, evs
        job.replication.next_tick = 0.0
        job.tick()
        time.sleep(0.05)


def test_two_nodes_agree_replicate_and_a_spare_restores_from_the_replica(tmp_path):
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (a, ea), (b, eb) = node(tmp_path, "a"), node(tmp_path, "b")
    c = None
    try:
        env = cycle([(a, [0]), (b, [1])], s, 1)
        assert env[0][0]["FT_SNAPSHOT_ITERATION"] == env[1][1]["FT_SNAPSHOT_ITERATION"] == "none"
        assert a.replication.token == b.replication.token  # first writer's token
        write(a, 0, [1, 2])
        write(b, 1, [1, 2, 3])
        push_all(a, ea, 1)
        push_all(b, eb, 1)
        # The same world again: each node has its own ranks; 2 is the newest common one.
        env = cycle([(a, [0]), (b, [1])], s, 2)
        assert env[0][0]["FT_SNAPSHOT_ITERATION"] == env[1][1]["FT_SNAPSHOT_ITERATION"] == "2"
        # Rank 1's iteration 3 is a future the world rolled back from, on a's replica too.
        assert 3 not in store.available_iterations(a.area.path / "replicas" / "rank_1")
        write(a, 0, [3])
        write(b, 1, [3])
        ea.clear()
        eb.clear()
        push_all(a, ea, 1)
        push_all(b, eb, 1)
        # b is lost; a fresh node c takes group rank 1 and fetches rank 1 from a's replica.
        b.close()
        c, ec = node(tmp_path, "c")
        env = cycle([(a, [0]), (c, [1])], s, 3)
        assert env[0][0]["FT_SNAPSHOT_ITERATION"] == env[1][1]["FT_SNAPSHOT_ITERATION"] == "3"
        fetched = dict(ec)["snapshot_replica_fetched"]
        assert fetched["rank"] == 1 and fetched["iteration"] == 3
        assert store.load(c.area.rank_dir(1), 3).iteration == 3
        c.on_report(1, json.dumps({"kind": "restored", "iteration": 3, "source": "local",
                                   "bytes": 8, "seconds": 0.01}))
        assert ec[-1][1]["source"] == "replica"
    finally:
        for job in (a, b, c):
            if job is not None:
                job.close()


def test_a_silent_node_means_no_restore_with_a_clear_event(tmp_path):
    s = dist.HashStore()
    a, ea = node(tmp_path, "a", replicas=0)
    a.exchange_timeout_s = 0.3
    try:
        a.begin_cycle([0], 2, WorldRound(s, s, 1, 0, 2, "127.0.0.1"))
        write(a, 0, [1])
        ea.clear()
        env = a.begin_cycle([0], 2, WorldRound(s, s, 2, 0, 2, "127.0.0.1"))
        assert env[0]["FT_SNAPSHOT_ITERATION"] == "none"
        timeout = dict(ea)["snapshot_world_timeout"]
        assert timeout["missing"] == [1] and timeout["phase"] == "holds"
        assert "published no snapshot holdings" in dict(ea)["snapshot_picked"]["reason"]
    finally:
        a.close()


def test_without_replicas_a_re_formed_world_restores_nothing(tmp_path):
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (a, _), (b, _) = node(tmp_path, "a", 0), node(tmp_path, "b", 0)
    try:
        cycle([(a, [0]), (b, [1])], s, 1)
        write(a, 0, [1])
        write(b, 1, [1])
        # The nodes swap group ranks: neither holds its new rank, nobody can serve it.
        env = cycle([(b, [0]), (a, [1])], s, 2)
        assert env[0][0]["FT_SNAPSHOT_ITERATION"] == env[1][1]["FT_SNAPSHOT_ITERATION"] == "none"
    finally:
        a.close()
        b.close()


def test_a_copy_failing_its_full_check_on_one_node_means_no_node_restores(tmp_path):
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    (a, ea), (b, eb) = node(tmp_path, "a", 0), node(tmp_path, "b", 0)
    try:
        cycle([(a, [0]), (b, [1])], s, 1)
        write(a, 0, [1])
        write(b, 1, [1])
        slot = store.committed_slots(b.area.rank_dir(1))[0][0].slot
        path = b.area.rank_dir(1) / store.slot_file(slot)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # a tensor byte: the cheap checks pass, the CRC32 does not
        path.write_bytes(bytes(data))
        env = cycle([(a, [0]), (b, [1])], s, 2)
        assert env[0][0]["FT_SNAPSHOT_ITERATION"] == env[1][1]["FT_SNAPSHOT_ITERATION"] == "none"
        reason = dict(ea)["snapshot_picked"]["reason"]
        assert reason.startswith("not every node can restore: node 1:"), reason
        assert dict(eb)["snapshot_rejected"]["rank"] == 1
    finally:
        a.close()
        b.close()
