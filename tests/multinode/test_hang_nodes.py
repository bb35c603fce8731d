"""A hang on one node is answered on every node: two launchers of two ranks each on
loopback, one rank SIGSTOPped. Every rank of the world goes silent at once (the others wait
for the stopped one in their all-reduce); the node that holds the stopped rank names it
(``stopped``), the other node answers its verdict (``peer_verdict``): it dumps its own
ranks' stacks and kills none of them. Both launchers then train on and end 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Nodes, c10d_common, free_ports, wait_until

FT_REPORT = str(Path(sys.executable).parent / "ft_report")


def _stacks(nodes: Nodes, name: str) -> set[int]:
    d = nodes.base / name / "stacks"
    return {int(p.stem.rsplit("_", 1)[1]) for p in d.glob("cycle_0_rank_*.txt")} \
        if d.exists() else set()


@pytest.mark.slow
@pytest.mark.parametrize("victim_node", ["a", "b"])
def test_a_stopped_rank_alone_is_named_and_every_ranks_stacks_are_written(
        nodes: Nodes, victim_node: str):
    (port,) = free_ports(1)
    nodes.common = [*c10d_common(port, "2", f"hang-{victim_node}"), "--nproc-per-node", "2",
                    "--ft-rank-heartbeat-timeout", "4", "--monitor-interval", "0.1"]
    nodes.env = {"STEP_S": "0.05"}
    for name in ("a", "b"):
        nodes.start(name)
    wait_until(lambda: len({(s["node"], s["rank"]) for s in nodes.steps()
                            if s["cycle"] == 0 and s["step"] >= 5}) == 4, 120,
               "every rank of both nodes to train")
    step = nodes.first_step(lambda s: s["node"] == victim_node and s["cycle"] == 0
                            and s["step"] >= 5 and s["rank"] % 2 == 1)
    victim = step["rank"]
    os.kill(step["pid"], signal.SIGSTOP)
    other = "b" if victim_node == "a" else "a"
    wait_until(lambda: nodes.events(other, "peer_verdict"), 60,
               f"{other} to answer {victim_node}'s verdict")
    hang = nodes.events(victim_node, "hang_detected")
    assert [(h["rank"], h["blame"]) for h in hang] == [(victim, "stopped")], hang
    peer = nodes.events(other, "peer_verdict")
    assert [(p["rank"], p["blame"]) for p in peer] == [(victim, "stopped")], peer
    assert nodes.events(other, "hang_detected") == []  # it named nobody of its own
    assert nodes.events(other, "rank_killed") == []
    killed = nodes.events(victim_node, "rank_killed")
    assert [k["rank"] for k in killed] == [victim] and killed[0]["peers_answered"] == 1
    # Each node dumped its own two ranks: the stacks of the whole world of cycle 0.
    assert _stacks(nodes, victim_node) | _stacks(nodes, other) == {0, 1, 2, 3}
    wait_until(lambda: len({s["rank"] for s in nodes.steps()
                            if s["cycle"] >= 1 and s["step"] >= 3}) == 4, 120,
               "the world to train again")
    nodes.stop_training()
    assert nodes.wait("a", 60) == 0 and nodes.wait("b", 60) == 0
    faults = {n: nodes.summary(n)["faults"] for n in ("a", "b")}
    assert [(f["kind"], f["rank"]) for f in faults[victim_node]] == [("hang", victim)]
    assert [(f["kind"], f["rank"]) for f in faults[other]] == [("peer_hang", victim)]
    assert faults[other][0]["node"] == peer[0]["node"]  # the culprit's node, not its own
    # Each node's report names the rank, its node and the evidence.
    for name, says in ((victim_node, f"hang rank {victim} on "),
                       (other, f"hang rank {victim} on node {peer[0]['node']}")):
        out = subprocess.run([FT_REPORT, str(nodes.base / name)], capture_output=True,
                             text=True, timeout=60).stdout
        assert says in out and "stopped" in out, out
