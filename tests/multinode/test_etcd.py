"""``--rdzv-backend etcd-v2`` against a real 3-member etcd cluster on loopback: no node is
special, so losing any training node, the first included, or one etcd member mid-run
leaves the training going."""

from __future__ import annotations

import time

import pytest

from .conftest import Nodes, wait_until
from .test_nodes import _world_steps

pytestmark = pytest.mark.slow


def _etcd_common(endpoints: str, nnodes: str, run_id: str) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
            "--rdzv-endpoint", endpoints, "--rdzv-id", f"{run_id}-{time.time_ns()}",
            "--max-restarts", "5", "--workers-stop-timeout", "2"]


@pytest.mark.timeout(240)
def test_losing_the_first_node_leaves_the_others_training(etcd_cluster, nodes: Nodes):
    nodes.common = _etcd_common(etcd_cluster.endpoints, "1:2", "first")
    nodes.start("a")
    wait_until(lambda: nodes.events("a", "launcher_started"), 60, "node a to start")
    nodes.start("b")
    wait_until(lambda: _world_steps(nodes, 2, {"a", "b"}), 120, "a world of 2 to train")

    first_rank = [s for s in nodes.steps() if s["world"] == 2 and s["rank"] == 0][-1]["node"]
    killed = nodes.kill(first_rank)  # the node of rank 0: with c10d it might host the store
    survivor = "b" if first_rank == "a" else "a"
    first = wait_until(lambda: _world_steps(nodes, 1, {survivor}, after=killed), 120,
                       f"node {survivor} to go on alone")
    print(f"\netcd-v2: node of rank 0 SIGKILLed -> first step of the world of 1: "
          f"{first - killed:.2f} s")
    nodes.stop_training()
    assert nodes.wait(survivor, 60) == 0, nodes.log(survivor)
    assert nodes.summary(survivor)["exit_code"] == 0


@pytest.mark.timeout(240)
def test_losing_an_etcd_member_mid_run_leaves_the_training_going(etcd_cluster, nodes: Nodes):
    nodes.common = _etcd_common(etcd_cluster.endpoints, "2:2", "member")
    nodes.start("a")
    nodes.start("b")
    wait_until(lambda: _world_steps(nodes, 2, {"a", "b"}), 120, "a world of 2 to train")

    deadline = time.monotonic() + 30
    while (leader := etcd_cluster.leader()) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"no etcd leader found: {etcd_cluster.describe()}")
        time.sleep(0.5)
    killed = etcd_cluster.kill(leader)  # the worst member to lose: a new election follows
    time.sleep(4.0)  # past an election (about 1 s) and a keep-alive expiry (2 s)
    assert all(p.poll() is None for p in nodes.procs.values()), "a launcher exited"
    wait_until(lambda: len([s for s in nodes.steps() if s["t"] > killed + 4.0]) >= 10, 60,
               "steps after the member's loss")
    later = [s for s in nodes.steps() if s["t"] > killed + 4.0]
    assert {s["world"] for s in later} == {2}
    restarts = [e for n in "ab" for e in nodes.events(n, "rendezvous_done") if e["ts"] > killed]
    print(f"\netcd leader SIGKILLed: training went on; re-rendezvous after it: {len(restarts)}")
    nodes.stop_training()
    assert nodes.wait("a", 60) == 0, nodes.log("a")
    assert nodes.wait("b", 60) == 0, nodes.log("b")
    assert not etcd_cluster.alive(leader)
