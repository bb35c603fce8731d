"""Snapshots across nodes with real launchers on loopback (c10d, gloo, one rank per node):
each rank snapshots after every step, each launcher pushes its rank's newest copy to its
buddy, and when a node is lost a hot spare's rank restores from the replica the surviving
node hosts. Bounds are generous (a shared machine); the rules are unit-tested in
tests/test_snapshots_world.py.
"""

from __future__ import annotations

import socket

import pytest

from .conftest import Nodes, c10d_common, free_ports, wait_until

pytestmark = pytest.mark.slow

SNAPSHOTS = ("--ft-snapshot-every", "1", "--ft-snapshot-replicas", "1")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _replicated(nodes: Nodes, name: str, rank: int) -> list[dict]:
    return [e for e in nodes.events(name, "snapshot_replicated") if e["rank"] == rank]


@pytest.mark.timeout(300)
def test_a_lost_nodes_rank_restores_on_the_spare_from_its_replica(nodes):
    port = free_ports(1)[0]
    nodes.common = c10d_common(port, "2:2", "snapnodes", *SNAPSHOTS)
    nodes.env = {"SNAPSHOT": "1", "STEP_S": "0.4"}
    nodes.start("a")
    wait_until(lambda: _listening(port), 60, "a to host the store")
    nodes.start("b")
    wait_until(lambda: len(_replicated(nodes, "b", 1)) >= 3, 120,
               "b to push rank 1's snapshots to a")
    nodes.start("c")
    wait_until(lambda: nodes.events("c", "spare_waiting"), 60, "c to wait as a spare")

    killed = nodes.kill("b")
    last = max(s["step"] for s in nodes.steps() if s["t"] <= killed and s["world"] == 2)
    restored = wait_until(lambda: [e for e in nodes.events("c", "snapshot_restored")
                                   if e["rank"] == 1], 120, "c's rank 1 to restore")[0]
    picked = [e for e in nodes.events("c", "snapshot_picked") if e["iteration"] is not None]
    fetched = nodes.events("c", "snapshot_replica_fetched")
    print(f"\nlast step before the kill {last}, restored iteration {restored['iteration']}, "
          f"fetched {fetched[0]['bytes']} bytes in {fetched[0]['seconds']} s")
    assert restored["source"] == "replica" and fetched[0]["rank"] == 1
    assert picked and picked[-1]["iteration"] == restored["iteration"]
    # The snapshot of iteration i holds steps 0..i-1: at most one step is done again.
    assert restored["iteration"] >= last, (restored, last)
    a_restored = [e for e in nodes.events("a", "snapshot_restored") if e["rank"] == 0]
    assert a_restored and a_restored[-1]["iteration"] == restored["iteration"]
    assert a_restored[-1]["source"] == "local"

    # Every step of every world counted each earlier step exactly once.
    wait_until(lambda: [s for s in nodes.steps() if s["node"] == "c" and
                        s["step"] >= restored["iteration"] + 2], 60, "a and c to train on")
    for s in nodes.steps():
        assert s["total"] == s["step"] * (s["step"] + 1) // 2, s
    nodes.stop_training()
    assert nodes.wait("a", 60) == 0, nodes.log("a")
    assert nodes.wait("c", 60) == 0, nodes.log("c")
