"""Several nodes over c10d on loopback: launchers as nodes (``--nproc-per-node 1``, gloo).

Losing a node's workers restarts every node at once; losing a node leaves a smaller world
(``--nnodes MIN:MAX``) or admits a hot spare; losing the store's host ends every other
launcher promptly with a requeue. Times are printed (``-s``) and bounded generously: this
machine is shared, and the precise timing rules are unit-tested in test_rendezvous.py.
"""

from __future__ import annotations

import socket
import time

import pytest

from ft_launcher.observe.ledger import ledger_of

from .conftest import Nodes, c10d_common, free_ports, wait_until

pytestmark = pytest.mark.slow


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start_host_first(nodes: Nodes, port: int, names: list[str]) -> None:
    """The first node hosts the c10d store: the others start once it listens."""
    nodes.start(names[0])
    wait_until(lambda: _listening(port), 60, f"{names[0]} to host the store")
    for name in names[1:]:
        nodes.start(name)


def _world_steps(nodes: Nodes, world: int, node_names: set[str], after: float = 0.0):
    """The first step of a world of ``world`` ranks made of exactly ``node_names``."""
    by_cycle: dict[tuple[str, int], dict] = {}
    for s in nodes.steps():
        if s["t"] >= after and s["world"] == world:
            by_cycle.setdefault((s["node"], s["cycle"]), s)
    if {n for n, _ in by_cycle} >= node_names:
        return min(s["t"] for (n, _), s in by_cycle.items() if n in node_names)
    return None


@pytest.mark.timeout(240)
def test_worker_failure_restarts_every_node_fast_and_a_lost_node_shrinks_the_world(nodes):
    port = free_ports(1)[0]
    nodes.common = c10d_common(port, "1:2", "shrink")
    nodes.env = {"FAIL_RANK": "1", "FAIL_STEP": "3"}
    # Started together (so both make the first round within its 1 s last call); node a
    # hosts the store, as torch's is_host says.
    nodes.start("a", "--rdzv-conf", "is_host=true")
    nodes.start("b", "--rdzv-conf", "is_host=false")

    # 1. Rank 1's worker exits 5: both nodes stop and restart their workers at once.
    failed = wait_until(lambda: [e for n in "ab" for e in nodes.events(n, "worker_exited")
                                 if e.get("exit_code") == 5], 120, "rank 1 to fail")[0]

    def restarted() -> list[float] | None:
        after = [[e["ts"] for e in nodes.events(n, "workers_started") if e["ts"] > failed["ts"]]
                 for n in "ab"]
        return [min(ts) for ts in after] if all(after) else None

    restart_s = max(wait_until(restarted, 60, "both nodes to restart their workers")) - \
        failed["ts"]
    print(f"\nworker failure -> every node restarted its workers: {restart_s:.2f} s")
    assert restart_s < 5.0, restart_s  # measured about 1 s; torch's timings: 2 s to 30 s
    wait_until(lambda: _world_steps(nodes, 2, {"a", "b"}, after=failed["ts"]), 120,
               "the restarted world of 2 to train")

    # 2. Node b's launcher is SIGKILLed: node a goes on alone (WORLD_SIZE 1).
    killed = nodes.kill("b")
    first = wait_until(lambda: _world_steps(nodes, 1, {"a"}, after=killed), 120,
                       "node a to train in a world of 1")
    print(f"node b SIGKILLed -> first step of the world of 1: {first - killed:.2f} s")
    assert first - killed < 30.0  # torch's timings: 45 s (15 s keep-alive + 30 s last call)
    nodes.stop_training()
    assert nodes.wait("a", 60) == 0, nodes.log("a")
    rounds = nodes.events("a", "rendezvous_done")
    assert rounds[-1]["world_size"] == 1
    # the round after the kill names the node that left, and the ledger charges what
    # node a lost (its rank failing or waiting in a collective) to that node
    assert [len(r["left"]) for r in rounds] == [0] * (len(rounds) - 1) + [1], rounds
    cycles = ledger_of(nodes.events("a")).summary()["attempts"][0]["cycles"]
    assert cycles[-2]["cause"] == "another node", cycles[-2]


@pytest.mark.timeout(300)
def test_a_hot_spare_replaces_a_lost_node_then_a_lost_store_host_ends_the_job_promptly(nodes):
    port = free_ports(1)[0]
    nodes.common = c10d_common(port, "2:2", "spare")
    _start_host_first(nodes, port, ["a", "b"])
    wait_until(lambda: _world_steps(nodes, 2, {"a", "b"}), 120, "a world of 2 to train")

    # 1. A third launcher arrives when the round is full: it waits, spawning nothing. (A
    # busy machine may have restarted the pair before: only what follows c counts.)
    arrived = time.time()
    nodes.start("c")
    waiting = wait_until(lambda: nodes.events("c", "spare_waiting"), 60, "c to wait as spare")
    assert waiting[0]["max_nodes"] == 2 and waiting[0]["participants"] == 2
    time.sleep(0.5)
    assert not nodes.events("c", "workers_started")
    assert not any(e["ts"] > arrived for n in "ab" for e in nodes.events(n, "workers_started")), \
        "a spare must not make the running nodes restart"

    # 2. Node b (not the store's host) is SIGKILLed: the spare takes its place.
    killed = nodes.kill("b")
    admitted = wait_until(lambda: nodes.events("c", "spare_admitted"), 60, "c admitted")[0]
    first = wait_until(lambda: _world_steps(nodes, 2, {"a", "c"}, after=killed), 120,
                       "the world of a and c to train")
    print(f"\nnode b SIGKILLed -> spare admitted {admitted['ts'] - killed:.2f} s, "
          f"first step of the new full world {first - killed:.2f} s")
    assert first - killed < 20.0  # target 5 s on an idle machine; torch's timings: 16.6 s
    assert admitted["group_world_size"] == 2
    # Warm restart, the default: the survivor's new workers come from its standbys, and the
    # spare's from its own zygote (ready while it waited).
    for node in "ac":
        started = nodes.events(node, "workers_started")
        assert started[-1]["warm"] == [True] * len(started[-1]["ranks"]), (node, started)

    # 3. Node a, the c10d store's host, is SIGKILLed: c cannot go on, and says why at once.
    killed = nodes.kill("a")
    code = nodes.wait("c", 30)
    exited_s = time.time() - killed
    print(f"store host SIGKILLed -> the other launcher exited after {exited_s:.2f} s")
    summary = nodes.summary("c")
    assert code == 1 and summary["exit_code"] == 1
    assert "rendezvous lost" in summary["reason"], summary["reason"]
    assert f"127.0.0.1:{port}" in summary["reason"]
    assert summary["next_action"]["requeue"] is True
    assert summary["host"] not in summary["next_action"]["exclude_nodes"]  # not its fault
    assert exited_s < 15.0  # keep-alive expiry 2 s + stopping the workers, on a busy machine
