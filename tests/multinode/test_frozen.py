"""A frozen node: SIGSTOP of one node's launcher and every one of its workers, as a network
partition or a hung kernel looks from the other nodes.

Two nodes train over c10d (``--nnodes 2:2``) with a hot spare waiting; the frozen node does
not host the store, and its rank writes the checkpoints. It is frozen at the worst moment: its
rank has finished a step's all-reduce and is about to write that step's line and a checkpoint
(node_worker's PAUSE_*). The survivors drop it and go on with the spare; then it is thawed,
its worker FIRST (on SIGCONT a node's workers may run before their launcher). The thawed
worker must write nothing, its launcher must record ``node_dropped`` and wait as a spare, and
the training must end as a fault-free one would: the last step, each step counted once, and a
checkpoint written only by ranks of the current round.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from ft_launcher.observe.ledger import ledger_of

from .conftest import Nodes, c10d_common, free_ports, read_jsonl, wait_until

pytestmark = pytest.mark.slow

TOTAL_STEPS = 80
CKPT_EVERY = 10
PAUSE_STEP = 29  # the checkpoint of step 30 is the next write of the paused rank


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _trained(nodes: Nodes, node: str, world: int, min_step: int = 0) -> bool:
    return any(s["node"] == node and s["world"] == world and s["step"] >= min_step
               for s in nodes.steps())


@pytest.mark.timeout(300)
def test_a_frozen_node_is_dropped_and_once_thawed_writes_nothing_and_waits_as_spare(nodes):
    port = free_ports(1)[0]
    nodes.common = c10d_common(port, "2:2", "frozen")
    # b's rank writes the checkpoints and pauses (a hosts the store: it is never frozen).
    nodes.env = {"CKPT_EVERY": str(CKPT_EVERY), "CKPT_RANK": "1", "CKPT_NODE": "b",
                 "TOTAL_STEPS": str(TOTAL_STEPS), "PAUSE_NODE": "b",
                 "PAUSE_STEP": str(PAUSE_STEP), "STEP_S": "0.03",
                 # The paused rank holds its peer in an all-reduce until the spare is ready
                 # (slow on a loaded machine): gloo must not time out first.
                 "GLOO_TIMEOUT_S": "180"}
    out = nodes.out
    nodes.start("a")  # hosts the store
    wait_until(lambda: _listening(port), 60, "a to host the store")
    nodes.start("b")
    wait_until(lambda: _trained(nodes, "a", 2) and _trained(nodes, "b", 2), 120,
               "a world of a and b to train")
    nodes.start("c")
    wait_until(lambda: nodes.events("c", "spare_waiting"), 120, "c to wait as a spare")

    # 1. Node b's rank stops between step 29's all-reduce and its writes: freeze node b.
    paused = wait_until(lambda: (out / "paused.json").exists() and
                        json.loads((out / "paused.json").read_text()), 120, "b's rank to pause")
    assert paused["node"] == "b", f"the paused rank is not b's: {paused}"
    b_round = nodes.events("b", "rendezvous_done")[-1]["round"]
    frozen = nodes.freeze("b")
    stopped_at = time.time()
    launcher, workers = frozen[0], frozen[1:]
    assert paused["pid"] in {p.pid for p in workers}
    (out / "frozen").touch()  # the paused rank would write as soon as it runs again

    # 2. The survivors notice (b's keep-alive lapses), re-form with the spare, and train on.
    admitted = wait_until(lambda: nodes.events("c", "spare_admitted"), 60, "c admitted")[0]
    wait_until(lambda: _trained(nodes, "c", 2, min_step=PAUSE_STEP + 2), 120,
               "the world of a and c to train past the freeze")
    lost = [e for e in nodes.events("a", "peers_waiting") if e["ts"] > stopped_at]
    assert lost, "a never saw b go"
    first = min(s["t"] for s in nodes.steps() if s["node"] == "c")
    print(f"\nb frozen -> a saw it lost {lost[0]['ts'] - stopped_at:.2f} s (lost={lost[0]['lost']}"
          f" waiting={lost[0]['waiting']}), c admitted {admitted['ts'] - stopped_at:.2f} s, "
          f"first step of the new world {first - stopped_at:.2f} s")

    # 3. Thaw b: its workers first, its launcher half a second later.
    nodes.thaw(workers)
    time.sleep(0.5)
    nodes.thaw([launcher])
    thawed_at = time.time()
    dropped = wait_until(lambda: nodes.events("b", "node_dropped"), 60, "b to see it was dropped")
    print(f"b thawed -> node_dropped after {dropped[0]['ts'] - thawed_at:.2f} s: {dropped[0]}")
    assert dropped[0]["round"] == b_round and dropped[0]["reason"]
    assert dropped[0]["frozen_s"] >= (thawed_at - stopped_at) * 0.8
    wait_until(lambda: [e for e in nodes.events("b", "spare_waiting") if e["cycle"] > 0], 60,
               "b to wait as a spare")

    # 4. The job ends as a fault-free run would; the spare b was not needed again.
    assert nodes.wait("a", 120) == 0, nodes.log("a")
    assert nodes.wait("c", 60) == 0, nodes.log("c")
    assert nodes.wait("b", 60) == 0, nodes.log("b")
    summary = nodes.summary("b")
    assert "spare not needed" in summary["reason"], summary["reason"]
    assert summary["next_action"]["requeue"] is False
    # The ledgers: a's cycle that b's freeze ended is charged to another node, b's own
    # cycle to its being dropped.
    a_cycles = ledger_of(nodes.events("a")).summary()["attempts"][0]["cycles"]
    assert "another node" in [c["cause"] for c in a_cycles], a_cycles
    b_cycles = ledger_of(nodes.events("b")).summary()["attempts"][0]["cycles"]
    assert b_cycles[0]["cause"] == "dropped from its round", b_cycles[0]

    stale_pid = paused["pid"]
    exited = [e for e in nodes.events("b", "worker_exited") if e["pid"] == stale_pid]
    assert exited and (exited[0]["signal"] == "SIGKILL" or exited[0]["exit_code"] == 75), exited
    fences = nodes.events("b", "stop_fence")
    print(f"stale worker {stale_pid}: {exited[0]['signal'] or exited[0]['exit_code']}; "
          f"fence answers {[(f['current'], f['stopped_s']) for f in fences]}")
    assert all(not f["current"] for f in fences)

    steps = nodes.steps()
    ckpts = read_jsonl(out / "ckpt_log.jsonl")
    assert not [s for s in steps if s["pid"] == stale_pid and s["t"] >= stopped_at], \
        "the thawed rank wrote a step"
    assert not [c for c in ckpts if c["pid"] == stale_pid and c["t"] >= stopped_at], \
        "the thawed rank wrote a checkpoint"
    # Each step counted once, in every world: the state after step s is 0 + 1 + ... + s.
    bad = [s for s in steps if s["total"] != s["step"] * (s["step"] + 1) // 2]
    assert not bad, bad[:3]
    final = json.loads((out / "ckpt.json").read_text())
    assert final["step"] == TOTAL_STEPS
    assert final["total"] == TOTAL_STEPS * (TOTAL_STEPS - 1) // 2
    c_round = nodes.events("c", "rendezvous_done")[-1]["round"]
    # The last world's steps: one line per step and rank, none missing, none twice.
    last = [s for s in steps if s["round"] == c_round]
    # Written by the last world's rank 1 (CKPT_RANK once b is gone), whichever of a and c
    # the rendezvous made rank 1 (c, mostly; a, once, under the whole suite beside busy loops).
    writer = {s["node"] for s in last if s["rank"] == 1}
    assert len(writer) == 1 and (final["node"], final["round"]) == (*writer, c_round), \
        (final, writer)
    for node in ("a", "c"):
        got = sorted(s["step"] for s in last if s["node"] == node)
        assert got == list(range(got[0], TOTAL_STEPS)), (node, got[:5], got[-5:])
        assert got[0] <= PAUSE_STEP + 1  # resumed from a checkpoint written before the freeze
