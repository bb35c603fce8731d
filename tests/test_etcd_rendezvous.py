"""The launcher's own rendezvous over a real 3-member etcd v3 cluster (``--rdzv-backend
etcd``), nodes in this process and in subprocesses, no workers: a round forms with etcd
serving only the coordinator's lease; the leader member SIGKILLed changes nothing; the
coordinator's launcher SIGKILLed: the others elect the next one and re-form; the whole
cluster gone: every node ends with RendezvousLost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import store_fixtures
from launch_helpers import wait_for

from ft_launcher.nodes.etcd_place import EtcdPlace
from ft_launcher.nodes.member import RoundRendezvous, node_id
from ft_launcher.nodes.records import TAKEOVER
from ft_launcher.nodes.rendezvous import RendezvousLost, RendezvousTimings

pytestmark = pytest.mark.slow
etcd3_cluster = store_fixtures.etcd3_cluster  # the fixture: a cluster of its own per test

TIMINGS = RendezvousTimings(keep_alive_interval=0.25, keep_alive_max_attempt=4,
                            last_call_timeout=0.5, poll_interval=0.05, join_timeout=60.0)


def make_node(endpoints: str, i: int, min_nodes: int, max_nodes: int,
              run_id: str = "job") -> RoundRendezvous:
    me = node_id(f"e{i}")
    place = EtcdPlace(endpoints, run_id, TIMINGS, min_nodes, max_nodes, {}, me, "127.0.0.1")
    return RoundRendezvous(place, run_id, min_nodes, max_nodes, TIMINGS, None, "127.0.0.1",
                           f"e{i}", me=me)


def join_all(nodes: list[RoundRendezvous]) -> list:
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
        t.join(60)
    return [out.get(i) for i in range(len(nodes))]


def close_all(nodes: list[RoundRendezvous]) -> None:
    for n in nodes:
        n.place.close()


def test_a_round_forms_and_etcd_serves_only_the_coordinators_lease(etcd3_cluster):
    nodes = [make_node(etcd3_cluster.endpoints, i, 3, 3) for i in range(3)]
    try:
        infos = join_all(nodes)
        assert sorted(i.group_rank for i in infos) == [0, 1, 2], infos
        coordinators = [n for n in nodes if n.place.coordinator is not None]
        assert len(coordinators) == 1
        before = sum(n.place.etcd.requests for n in nodes)
        time.sleep(3.0)
        per_s = (sum(n.place.etcd.requests for n in nodes) - before) / 3.0
        # One lease keep-alive per interval (4/s here), whatever the number of nodes.
        assert per_s <= 1.5 / TIMINGS.keep_alive_interval, per_s
        assert all(n.poll_round().why == "" for n in nodes)
    finally:
        close_all(nodes)


def test_the_leader_member_killed_mid_job_changes_nothing(etcd3_cluster):
    nodes = [make_node(etcd3_cluster.endpoints, i, 2, 2) for i in range(2)]
    try:
        join_all(nodes)
        etcd3_cluster.kill(etcd3_cluster.wait_leader())
        deadline = time.monotonic() + 4 * TIMINGS.dead_after + 3
        while time.monotonic() < deadline:  # through the election and well past the TTL
            assert all(n.poll_round().why == "" for n in nodes)
            time.sleep(0.05)
        holder = next(n for n in nodes if n.place.coordinator is not None)
        assert holder.place.etcd.refresh()  # its lease lived through the election
    finally:
        close_all(nodes)


def test_the_coordinators_launcher_killed_the_others_elect_the_next_and_go_on(
        etcd3_cluster):
    coordinator = subprocess.Popen([sys.executable, "-c", NODE_SCRIPT,
                                    etcd3_cluster.endpoints], stdout=subprocess.PIPE, text=True)
    nodes: list[RoundRendezvous] = []
    try:
        assert coordinator.stdout.readline().strip() == "coordinating"
        nodes = [make_node(etcd3_cluster.endpoints, i, 2, 3) for i in (1, 2)]
        assert all(n.place.coordinator is None for n in nodes)
        infos = join_all(nodes)
        assert [i.group_world_size for i in infos] == [3, 3], infos
        os.kill(coordinator.pid, signal.SIGKILL)
        wait_for(lambda: all(n.poll_round().why == TAKEOVER for n in nodes), 30,
                 "the others to see the coordinator gone")
        again = join_all(nodes)
        assert [i.group_world_size for i in again] == [2, 2], again
        assert again[0].round > infos[0].round
        assert sum(n.place.coordinator is not None for n in nodes) == 1
    finally:
        coordinator.kill()
        coordinator.wait(10)
        close_all(nodes)


def test_the_whole_cluster_gone_ends_every_node_with_rendezvous_lost(etcd3_cluster):
    nodes = [make_node(etcd3_cluster.endpoints, i, 2, 2) for i in range(2)]
    try:
        join_all(nodes)
        etcd3_cluster.kill_all()
        start = time.monotonic()
        lost: dict[int, float] = {}

        def poll() -> bool:
            for i, n in enumerate(nodes):
                if i in lost:
                    continue
                try:
                    n.poll_round()
                except RendezvousLost:
                    lost[i] = time.monotonic() - start
            return len(lost) == len(nodes)

        wait_for(poll, 30, "every node to find the store lost")
        # The coordinator gives etcd the keep-alive expiry, then tells every node at once.
        assert max(lost.values()) < TIMINGS.dead_after + 5, lost
    finally:
        close_all(nodes)


NODE_SCRIPT = f"""
import sys, time
sys.path.insert(0, {os.getcwd()!r})
from ft_launcher.nodes.etcd_place import EtcdPlace
from ft_launcher.nodes.member import RoundRendezvous, node_id
from ft_launcher.nodes.rendezvous import RendezvousTimings
t = RendezvousTimings(keep_alive_interval=0.25, keep_alive_max_attempt=4,
                      last_call_timeout=0.5, poll_interval=0.05, join_timeout=60.0)
me = node_id("e0")
place = EtcdPlace(sys.argv[1], "job", t, 2, 3, {{}}, me, "127.0.0.1")
print("coordinating" if place.coordinator is not None else "not", flush=True)
r = RoundRendezvous(place, "job", 2, 3, t, None, "127.0.0.1", "e0", me=me)
r.next_round()
time.sleep(600)
"""
