"""The launcher's own rendezvous (``--rdzv-backend c10d``) with several nodes in one process
against a real TCPStore (no launcher, no workers): rounds form and re-form, a node that
stops keeping alive is dropped and knows it, a hot spare waits and is admitted, the job's
end reaches a spare, a lost store ends every node, and a hang verdict is the round's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from launch_helpers import wait_for

from ft_launcher.nodes.kv import C10dKV
from ft_launcher.nodes.member import RoundRendezvous, node_id
from ft_launcher.nodes.place import C10dPlace, serve_store
from ft_launcher.nodes.records import HANG, LOST, REJOIN, WAITING, Keys
from ft_launcher.nodes.rendezvous import (
    RendezvousClosed,
    RendezvousLost,
    RendezvousTimings,
    free_port,
)

# A node is dropped after 1.5 s without a keep-alive: every node here is a thread of this
# process, and a busy machine holds one back for tenths of a second.
FAST = RendezvousTimings(keep_alive_interval=0.25, keep_alive_max_attempt=6,
                         last_call_timeout=0.3, poll_interval=0.05, join_timeout=30.0)


class Job:
    """Nodes of one job in this process; the first one made hosts the store."""

    def __init__(self, min_nodes: int, max_nodes: int, timings: RendezvousTimings = FAST,
                 port: int | None = None, conf: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.conf = conf or {}
        self.min, self.max, self.timings = min_nodes, max_nodes, timings
        self.nodes: list[RoundRendezvous] = []
        self.events: list[tuple[int, str, dict]] = []

    def node(self) -> RoundRendezvous:
        i = len(self.nodes)
        me = node_id(f"n{i}")
        place = C10dPlace(f"127.0.0.1:{self.port}", "job", self.timings, self.min, self.max,
                          dict(self.conf), me)
        rdzv = RoundRendezvous(place, "job", self.min, self.max, self.timings, None,
                               "127.0.0.1", f"n{i}",
                               lambda name, **f: self.events.append((i, name, f)), me=me)
        self.nodes.append(rdzv)
        return rdzv

    def join(self, nodes: list[RoundRendezvous]) -> list:
        """next_round() of each node in its own thread; their RoundInfos."""
        out: dict[int, object] = {}

        def run(i: int, r: RoundRendezvous) -> None:
            try:
                out[i] = r.next_round()
            except Exception as exc:  # noqa: BLE001 - handed to the test
                out[i] = exc

        threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return [out.get(i) for i in range(len(nodes))]

    def close(self) -> None:
        for r in reversed(self.nodes):
            r.pulse.stop()
            r.place.close()


@pytest.fixture
def job_factory() -> Iterator:
    jobs: list[Job] = []

    def make(*args, **kwargs) -> Job:
        jobs.append(Job(*args, **kwargs))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


def test_a_round_forms_and_every_node_meets_the_same_master(job_factory):
    job = job_factory(3, 3)
    nodes = [job.node() for _ in range(3)]
    infos = job.join(nodes)
    assert sorted(i.group_rank for i in infos) == [0, 1, 2]
    assert {(i.master_addr, i.master_port, i.round, i.group_world_size) for i in infos} == \
        {(infos[0].master_addr, infos[0].master_port, 0, 3)}
    assert all(n.poll_round().why == "" for n in nodes)


def test_a_node_that_restarts_brings_the_others_to_a_new_round_in_the_same_order(job_factory):
    job = job_factory(3, 3)
    nodes = [job.node() for _ in range(3)]
    first = job.join(nodes)
    t = threading.Thread(target=nodes[1].next_round)  # its workers failed
    t.start()
    wait_for(lambda: all(n.poll_round().why == REJOIN for n in (nodes[0], nodes[2])), 10,
             "the others to learn of the new round")
    infos = job.join([nodes[0], nodes[2]])
    t.join(10)
    assert [i.group_rank for i in infos] == [first[0].group_rank, first[2].group_rank]
    assert {i.round for i in infos} == {1} and infos[0].left == ()


def test_a_node_that_stops_keeping_alive_is_dropped_and_finds_itself_out(job_factory):
    job = job_factory(2, 3)
    nodes = [job.node() for _ in range(3)]
    job.join(nodes)
    frozen = nodes[2]
    frozen.pulse.stop()  # as if its launcher were stopped
    start = time.monotonic()
    views = []
    wait_for(lambda: views.append(nodes[0].poll_round()) or views[-1].lost, 30,
             "node 0 to see a node lost")
    assert views[-1].lost == (frozen.node_name,), views[-1]
    took = time.monotonic() - start
    # Its last keep-alive came up to one interval before the stop. The upper bound only
    # proves the wiring (the timing rule is tests/test_rounds.py's): once, beside the rest
    # of the fast tier on 2 cores, this took 12 s, not yet explained.
    assert FAST.dead_after - FAST.keep_alive_interval <= took < FAST.dead_after + 25
    view = wait_for(lambda: (v := nodes[1].poll_round()).why and v, 30, "node 1 to see it")
    assert view.why == LOST and view.dropped is None
    standing = frozen.standing(stalled_s=0.0)
    assert not standing.current and "dropped from round 0" in standing.reason
    infos = job.join(nodes[:2])
    assert [i.group_world_size for i in infos] == [2, 2] and infos[0].left == \
        (frozen.node_name,)


def test_a_hot_spare_waits_then_takes_the_place_of_a_node_that_left(job_factory):
    job = job_factory(2, 2)
    nodes = [job.node() for _ in range(3)]
    box = {}
    spare = threading.Thread(target=lambda: box.setdefault("info", nodes[2].next_round()))
    infos = job.join(nodes[:2])
    spare.start()
    wait_for(lambda: any(e[1] == "spare_waiting" for e in job.events), 10, "a spare")
    assert nodes[0].poll_round().why == ""  # a spare makes nobody restart
    nodes[1].shutdown(close=False)  # this node leaves alone (e.g. requeued without it)
    wait_for(lambda: nodes[0].poll_round().lost == (nodes[1].node_name,), 10, "the leave")
    again = job.join(nodes[:1])
    spare.join(10)
    assert again[0].group_world_size == 2 and box["info"].group_world_size == 2
    assert infos[0].round < again[0].round == box["info"].round
    admitted = [e for e in job.events if e[1] == "spare_admitted"]
    assert admitted and admitted[0][2]["waited_s"] > 0


def test_a_spare_never_needed_learns_that_the_job_is_over(job_factory):
    job = job_factory(1, 1)
    nodes = [job.node() for _ in range(2)]
    job.join(nodes[:1])
    box = {}

    def wait_as_spare():
        try:
            nodes[1].next_round()
        except RendezvousClosed as exc:
            box["closed"] = exc

    t = threading.Thread(target=wait_as_spare)
    t.start()
    wait_for(lambda: any(e[1] == "spare_waiting" for e in job.events), 10, "a spare")
    nodes[0].exit_barrier(wait=True, timeout=5)
    nodes[0].shutdown(close=True)
    t.join(10)
    assert box["closed"].was_spare


def test_a_node_that_arrives_while_the_round_has_room_brings_everyone_to_a_new_round(
        job_factory):
    job = job_factory(1, 3)
    nodes = [job.node() for _ in range(3)]
    job.join(nodes[:2])
    late = threading.Thread(target=nodes[2].next_round)
    late.start()
    wait_for(lambda: nodes[0].poll_round().why == WAITING, 10, "the waiting node")
    infos = job.join(nodes[:2])
    late.join(10)
    assert [i.group_world_size for i in infos] == [3, 3]


def test_a_stall_near_the_keep_alive_expiry_counts_the_node_out(job_factory):
    job = job_factory(1, 1)
    [node] = [job.node()]
    job.join([node])
    assert node.standing(stalled_s=0.05).current
    standing = node.standing(stalled_s=FAST.dead_after - FAST.keep_alive_interval / 2)
    assert not standing.current and "paused" in standing.reason


def test_a_malformed_record_in_the_store_breaks_no_node(job_factory):
    job = job_factory(2, 2)
    nodes = [job.node() for _ in range(2)]
    job.join(nodes)
    raw = C10dKV(nodes[0].place.client())
    raw.set(Keys.open(1), b"\xff{not json")  # someone else's junk as the next round's notice
    wait_for(lambda: all(n.poll_round().why == REJOIN for n in nodes), 10, "a generic restart")
    raw.set(Keys.members(1), b'{"round": 1, "nodes": [{"node": "x y"}]}')
    raw.set(Keys.members(2), b'{"round": 2, "nodes": [], "spares": []}')
    raw.set(Keys.members(2), b"[]")
    infos = job.join(nodes)
    assert all(i.round >= 2 for i in infos) and len({i.round for i in infos}) == 1


def test_the_strongest_evidence_names_the_culprit_and_the_others_answer(job_factory):
    job = job_factory(2, 2)
    nodes = [job.node() for _ in range(2)]
    infos = job.join(nodes)
    a, b = (nodes[0].verdict_channel(infos[0]), nodes[1].verdict_channel(infos[1]))
    box = {}
    weak = threading.Thread(target=lambda: box.setdefault(
        "b", b.decide(b.claim(3, "oldest_activity", "heartbeat", 5.0))))
    weak.start()  # b's deadline expired first, with weaker evidence: it waits
    time.sleep(0.3)
    strong = a.decide(a.claim(1, "stopped", "heartbeat", 5.2))
    weak.join(10)
    assert strong.rank == 1 and box["b"] == strong
    a.announce(strong)
    wait_for(lambda: nodes[1].poll_round().why == HANG, 10, "the verdict to reach b")
    assert nodes[1].poll_round().verdict["rank"] == 1
    b.answer()
    assert a.await_answers(timeout_s=5) == 1


def test_a_store_hosted_outside_the_launchers_coordinates_the_rounds(job_factory):
    port = free_port()
    server, coordinator = serve_store(port, "job", 2, 2, FAST)  # as rdzv_store.py does
    try:
        job = job_factory(2, 2, port=port, conf={"is_host": "false"})
        nodes = [job.node() for _ in range(3)]
        assert all(n.place.server is None and n.place.coordinator is None for n in nodes)
        box = {}
        infos = job.join(nodes[:2])
        spare = threading.Thread(target=lambda: box.setdefault("info", nodes[2].next_round()))
        spare.start()
        wait_for(lambda: any(e[1] == "spare_waiting" for e in job.events), 10, "a spare")
        nodes[0].shutdown(close=False)  # a launcher leaves: the store stays
        again = job.join(nodes[1:2])
        spare.join(10)
        assert [i.group_world_size for i in infos + again] == [2, 2, 2]
        assert box["info"].round == again[0].round > infos[0].round
    finally:
        coordinator.stop()
        del server


def test_a_lost_store_ends_every_node_promptly(tmp_path, job_factory):
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "hosting"
        job = job_factory(2, 2, port=port)
        [node] = [job.node()]
        assert node.place.server is None  # the other process hosts it
        infos = job.join([node])
        assert infos[0].group_world_size == 2
        os.kill(host.pid, signal.SIGKILL)
        start = time.monotonic()

        def lost() -> bool:
            try:
                node.poll_round()
            except RendezvousLost:
                return True
            return False

        wait_for(lost, 10, "the store's loss")
        assert time.monotonic() - start < FAST.dead_after + 5
    finally:
        host.kill()
        host.wait(10)


HOST_SCRIPT = f"""
import sys, time
sys.path.insert(0, {str(os.getcwd())!r})
from ft_launcher.nodes.member import RoundRendezvous, node_id
from ft_launcher.nodes.place import C10dPlace, serve_store
from ft_launcher.nodes.rendezvous import RendezvousTimings
t = RendezvousTimings(keep_alive_interval=0.1, keep_alive_max_attempt=4,
                      last_call_timeout=0.3, poll_interval=0.05)
me = node_id("host")
place = C10dPlace(f"127.0.0.1:{{sys.argv[1]}}", "job", t, 2, 2, {{}}, me)
r = RoundRendezvous(place, "job", 2, 2, t, None, "127.0.0.1", "host", me=me)
print("hosting", flush=True)
r.next_round()
time.sleep(600)
"""
