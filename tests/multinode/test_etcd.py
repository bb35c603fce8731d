"""``--rdzv-backend etcd`` (v3; and torch's ``etcd-v2`` once, for comparison) against a real
3-member etcd cluster on loopback: no node is special, so losing any training node, the
first included (it coordinates), or one etcd member mid-run leaves the training going; the
whole cluster gone ends every launcher with the requeue decision, nothing left running."""

from __future__ import annotations

import time

import pytest

from .conftest import Nodes, wait_until
from .test_nodes import _world_steps

pytestmark = pytest.mark.slow


def _etcd_common(endpoints: str, nnodes: str, run_id: str,
                 backend: str = "etcd") -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", backend,
            "--rdzv-endpoint", endpoints, "--rdzv-id", f"{run_id}-{time.time_ns()}",
            "--max-restarts", "5", "--workers-stop-timeout", "2"]


@pytest.fixture(params=["etcd", "etcd-v2"])
def backend_and_cluster(request):
    """The backend, and a cluster with the client it needs."""
    fixture = "etcd3_cluster" if request.param == "etcd" else "etcd_cluster"
    return request.param, request.getfixturevalue(fixture)


@pytest.mark.timeout(240)
def test_losing_the_first_node_leaves_the_others_training(backend_and_cluster, nodes: Nodes):
    backend, etcd_cluster = backend_and_cluster
    nodes.common = _etcd_common(etcd_cluster.endpoints, "1:2", "first", backend)
    nodes.start("a")
    wait_until(lambda: nodes.events("a", "launcher_started"), 60, "node a to start")
    nodes.start("b")
    wait_until(lambda: _world_steps(nodes, 2, {"a", "b"}), 120, "a world of 2 to train")

    first_rank = [s for s in nodes.steps() if s["world"] == 2 and s["rank"] == 0][-1]["node"]
    killed = nodes.kill(first_rank)  # the node of rank 0: with c10d it might host the store
    survivor = "b" if first_rank == "a" else "a"
    first = wait_until(lambda: _world_steps(nodes, 1, {survivor}, after=killed), 120,
                       f"node {survivor} to go on alone")
    print(f"\n{backend}: node of rank 0 SIGKILLed -> first step of the world of 1: "
          f"{first - killed:.2f} s")
    nodes.stop_training()
    assert nodes.wait(survivor, 60) == 0, nodes.log(survivor)
    assert nodes.summary(survivor)["exit_code"] == 0


@pytest.mark.timeout(240)
def test_losing_an_etcd_member_mid_run_leaves_the_training_going(etcd3_cluster, nodes: Nodes):
    etcd_cluster = etcd3_cluster
    nodes.common = _etcd_common(etcd_cluster.endpoints, "2:2", "member")
    nodes.start("a")
    nodes.start("b")
    wait_until(lambda: _world_steps(nodes, 2, {"a", "b"}), 120, "a world of 2 to train")

    leader = etcd_cluster.wait_leader()
    killed = etcd_cluster.kill(leader)  # the worst member to lose: a new election follows
    time.sleep(4.0)  # past an election (about 1 s) and a keep-alive expiry (2 s)
    assert all(p.poll() is None for p in nodes.procs.values()), "a launcher exited"
    wait_until(lambda: len([s for s in nodes.steps() if s["t"] > killed + 4.0]) >= 10, 60,
               "steps after the member's loss")
    later = [s for s in nodes.steps() if s["t"] > killed + 4.0]
    assert {s["world"] for s in later} == {2}
    restarts = [e for n in "ab" for e in nodes.events(n, "rendezvous_done") if e["ts"] > killed]
    assert restarts == [], restarts  # etcd serves only the coordinator's lease: no restart
    nodes.stop_training()
    assert nodes.wait("a", 60) == 0, nodes.log("a")
    assert nodes.wait("b", 60) == 0, nodes.log("b")
    assert not etcd_cluster.alive(leader)


@pytest.mark.timeout(240)
def test_the_whole_etcd_cluster_gone_ends_every_launcher_with_a_requeue(etcd3_cluster,
                                                                        nodes: Nodes):
    nodes.common = _etcd_common(etcd3_cluster.endpoints, "2:2", "gone")
    nodes.start("a")
    nodes.start("b")
    wait_until(lambda: _world_steps(nodes, 2, {"a", "b"}), 120, "a world of 2 to train")
    killed = time.time()
    etcd3_cluster.kill_all()
    codes = {n: nodes.wait(n, 60) for n in "ab"}
    assert codes == {"a": 1, "b": 1}, (nodes.log("a"), nodes.log("b"))
    for n in "ab":
        summary = nodes.summary(n)
        assert summary["outcome"] == "rendezvous_lost", summary
        assert summary["next_action"]["requeue"] and summary["next_action"]["exclude_nodes"] == []
        ended = nodes.events(n, "launcher_exited")[-1]["ts"]
        # The coordinator gives etcd the keep-alive expiry (2 s), then tells every node; the
        # workers' teardown follows (a generous bound for a busy machine).
        assert ended - killed < 20, ended - killed
