"""Snapshot replicas between real processes on loopback: each node process runs a replica
server; a rank's slot pushed from one is fetched by another and loads bit-identical with
every CRC checked; a sender SIGKILLed mid-transfer, a replica host SIGKILLed mid-fetch, a
frozen (SIGSTOPped) host and a corrupted replica each end in a clear reason, and nothing
unchecked is ever loaded. Every process started is ended by pid in the fixture's teardown."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch
from launch_helpers import freeze

from ft_agent.snapshot import SnapshotError, commit_file, load, slot_file

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "5e" * 16
MB = 20  # per rank in these tests; 200 MB is measured by scripts/bench/replica_cost.py

STATE_CODE = r'''
import torch

def make_state(seed, mb):
    g = torch.Generator().manual_seed(seed)
    n = mb * 2**20 // 4
    return {
        "model": {"w": torch.randn(n - 4096, generator=g), "half": torch.randn(2048, generator=g
                  ).half(), "ids": torch.randint(0, 2**40, (512,), generator=g)},
        "optimizer": {"step": seed, "betas": (0.9, 0.999), "none": None},
        "rng": torch.randint(0, 255, (64,), dtype=torch.uint8, generator=g),
    }
'''

NODE = STATE_CODE + r'''
import dataclasses, json, os, sys, time
import zmq
from ft_agent.snapshot import SnapshotStore
from ft_agent.snapshot_format import encode_commit
from ft_launcher.snapshots import replica
from ft_launcher.snapshots.replica_disk import SlotReader
from ft_launcher.snapshots.replica_wire import Message, encode

root, token, chunk, stall = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
srv = replica.ReplicaServer(os.path.join(root, "replicas"), "tcp://127.0.0.1:0", token,
                            stall_timeout=stall, chunk_bytes=chunk).start()
print(json.dumps({"endpoint": srv.endpoint, "pid": os.getpid()}), flush=True)

def push_partial(rank_dir, rank, endpoint, chunks):
    """Start a push, send ``chunks`` chunks (acknowledged), then hang: to be SIGKILLed."""
    reader = SlotReader(rank_dir)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    c = reader.commit
    sock.send_multipart(encode(Message("push", rank, iteration=c.iteration, slot=c.slot,
                                       size=reader.size), token))
    assert b'"ready"' in sock.recv_multipart()[0]
    for i in range(chunks):
        sock.send_multipart(encode(Message("data", rank, offset=i * 65536,
                                           payload=reader.read(i * 65536, 65536)), token))
        sock.recv_multipart()
    return {"sent": chunks}

for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd.pop("op")
    if op == "snapshot":
        with SnapshotStore(cmd["dir"]) as store:
            store.snapshot(make_state(cmd["seed"], cmd["mb"]), cmd["iteration"], wait=True)
            out = {"ok": store.wait().ok}
    elif op == "push":
        out = dataclasses.asdict(replica.push(cmd["dir"], cmd["rank"], cmd["endpoint"], token,
                                              timeout=cmd.get("timeout", 20)))
    elif op == "fetch":
        out = dataclasses.asdict(replica.fetch(cmd["endpoint"], cmd["rank"], cmd["dir"], token,
                                               cmd.get("iteration"),
                                               timeout=cmd.get("timeout", 20)))
    elif op == "push_partial":
        out = push_partial(cmd["dir"], cmd["rank"], cmd["endpoint"], cmd["chunks"])
    elif op == "stats":
        out = dict(srv.stats)
    else:
        srv.close()
        break
    print(json.dumps(out), flush=True)
    if op == "push_partial":
        time.sleep(3600)
'''

ns: dict = {}
exec(STATE_CODE, ns)
make_state = ns["make_state"]


def same(a, b) -> bool:
    """Bit-identical, recursively (tensors by their bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


class Node:
    """A process running a replica server; commands as JSON lines on stdin/stdout."""

    def __init__(self, root: Path, chunk: int = 4 * 2**20, stall: float = 20.0) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", NODE, str(root), TOKEN, str(chunk), str(stall)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.endpoint = self._read(120)["endpoint"]

    @property
    def replicas(self) -> Path:
        return self.root / "replicas"

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"node {self.proc.pid} said nothing in {timeout}s"
        line = self.proc.stdout.readline()
        assert line, f"node {self.proc.pid} exited ({self.proc.poll()})"
        return json.loads(line)

    def ask(self, timeout: float = 120, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.fixture
def nodes(tmp_path):
    started: list[Node] = []

    def start(name: str, **kw) -> Node:
        started.append(Node(tmp_path / name, **kw))
        return started[-1]

    yield start
    for node in started:
        node.stop()


def test_push_to_a_buddy_and_fetch_from_a_third_node(nodes, tmp_path):
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    src = str(a.root / "rank_3")
    assert a.ask(op="snapshot", dir=src, seed=3, mb=MB, iteration=30)["ok"]
    pushed = a.ask(op="push", dir=src, rank=3, endpoint=b.endpoint)
    assert pushed["ok"] and pushed["iteration"] == 30 and not pushed["skipped"], pushed
    assert pushed["bytes"] > MB * 2**20 * 0.99
    again = a.ask(op="push", dir=src, rank=3, endpoint=b.endpoint)
    assert again["ok"] and again["skipped"], again
    # the buddy's copy is in the store's own format: it loads where it lies, CRCs checked
    assert same(load(b.replicas / "rank_3").state, make_state(3, MB))

    dest = c.root / "rank_3"
    got = c.ask(op="fetch", endpoint=b.endpoint, rank=3, dir=str(dest))
    assert got["ok"] and got["iteration"] == 30, got
    snap = load(dest, 30)
    assert same(snap.state, make_state(3, MB)) and snap.rejected == []
    assert (dest.stat().st_mode & 0o777) == 0o700 and (b.replicas.stat().st_mode & 0o777) == 0o700
    missing = c.ask(op="fetch", endpoint=b.endpoint, rank=4, dir=str(c.root / "rank_4"))
    assert not missing["ok"] and missing["reason"].startswith("refused: none"), missing


def test_newer_iterations_replace_the_older_copy_and_a_given_one_is_fetched(nodes, tmp_path):
    a, b = nodes("a"), nodes("b")
    src = str(a.root / "rank_0")
    for it in (1, 2, 3):
        assert a.ask(op="snapshot", dir=src, seed=it, mb=2, iteration=it)["ok"]
        assert a.ask(op="push", dir=src, rank=0, endpoint=b.endpoint)["ok"]
    # two slots: the newest two iterations
    assert load(b.replicas / "rank_0").iteration == 3
    assert load(b.replicas / "rank_0", 2).iteration == 2
    dest = tmp_path / "restore"
    got = a.ask(op="fetch", endpoint=b.endpoint, rank=0, dir=str(dest), iteration=2)
    assert got["ok"] and got["iteration"] == 2
    assert same(load(dest).state, make_state(2, 2))
    gone = a.ask(op="fetch", endpoint=b.endpoint, rank=0, dir=str(dest), iteration=1)
    assert not gone["ok"] and "iteration 1" in gone["reason"], gone


@pytest.mark.slow
def test_sender_killed_mid_transfer_leaves_the_previous_replica_whole(nodes):
    # The stall timeout is what the checks of the half-written slot below must beat (the
    # buddy drops it then): 3 s leaves them room on a loaded machine.
    a, b = nodes("a"), nodes("b", stall=3.0)
    sender = nodes("sender")
    src = str(a.root / "rank_1")
    assert a.ask(op="snapshot", dir=src, seed=1, mb=MB, iteration=10)["ok"]
    assert a.ask(op="push", dir=src, rank=1, endpoint=b.endpoint)["ok"]
    assert a.ask(op="snapshot", dir=src, seed=2, mb=MB, iteration=11)["ok"]
    assert sender.ask(op="push_partial", dir=src, rank=1, endpoint=b.endpoint,
                      chunks=40)["sent"] == 40
    rank_dir = b.replicas / "rank_1"
    # the slot being written holds part of iteration 11 and no commit record
    assert (rank_dir / slot_file("b")).stat().st_size >= 40 * 65536
    assert not (rank_dir / commit_file("b")).exists()
    sender.signal(signal.SIGKILL)
    snap = load(rank_dir)
    assert snap.iteration == 10 and same(snap.state, make_state(1, MB))
    # the buddy drops the dead transfer after its stall timeout; then a push goes through
    deadline = time.monotonic() + 30
    while b.ask(op="stats").get("stalled", 0) < 1:
        assert time.monotonic() < deadline, "the stalled transfer was never dropped"
        time.sleep(0.2)
    assert load(rank_dir).iteration == 10
    pushed = a.ask(op="push", dir=src, rank=1, endpoint=b.endpoint)
    assert pushed["ok"] and pushed["iteration"] == 11, pushed
    assert same(load(rank_dir).state, make_state(2, MB))


@pytest.mark.slow
def test_replica_host_killed_mid_fetch_is_a_clear_failure(nodes, tmp_path):
    from ft_launcher.snapshots.replica import fetch
    a = nodes("a")
    b = nodes("b", chunk=16 * 1024)  # many small chunks: the fetch lasts long enough to cut
    src = str(a.root / "rank_2")
    assert a.ask(op="snapshot", dir=src, seed=5, mb=MB, iteration=50)["ok"]
    assert a.ask(op="push", dir=src, rank=2, endpoint=b.endpoint)["ok"]
    dest = tmp_path / "dest"
    out: list = []
    th = threading.Thread(target=lambda: out.append(fetch(b.endpoint, 2, dest, TOKEN,
                                                          timeout=2.0)))
    th.start()
    try:
        deadline = time.monotonic() + 60
        while not ((dest / slot_file("a")).exists() and
                   (dest / slot_file("a")).stat().st_size > 0):
            assert time.monotonic() < deadline and th.is_alive(), out
            time.sleep(0.0005)
        b.signal(signal.SIGKILL)
    finally:
        th.join(60)
    result = out[0]
    assert not result.ok and result.reason.startswith("timeout: no reply"), result
    assert result.seconds < 30
    with pytest.raises(SnapshotError) as e:
        load(dest)
    assert e.value.reason == "none"  # the partial slot was never committed


@pytest.mark.slow
def test_frozen_host_makes_fetch_and_push_fail_within_their_timeout(nodes, tmp_path):
    from ft_launcher.snapshots.replica import fetch, push
    a, b = nodes("a"), nodes("b")
    src = str(a.root / "rank_0")
    assert a.ask(op="snapshot", dir=src, seed=1, mb=1, iteration=1)["ok"]
    assert a.ask(op="push", dir=src, rank=0, endpoint=b.endpoint)["ok"]
    freeze(b.proc.pid)
    try:
        for call in (lambda: fetch(b.endpoint, 0, tmp_path / "d", TOKEN, timeout=1.0),
                     lambda: push(src, 0, b.endpoint, TOKEN, timeout=1.0)):
            start = time.monotonic()
            result = call()
            assert not result.ok and result.reason.startswith("timeout"), result
            assert 0.9 < time.monotonic() - start < 15
    finally:
        b.signal(signal.SIGCONT)
    assert not (tmp_path / "d" / commit_file("a")).exists()


def _corrupt_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the big tensor "w"
    path.write_bytes(bytes(data))


def test_a_corrupted_replica_is_never_loaded(nodes, tmp_path):
    a, b = nodes("a"), nodes("b")
    src = str(a.root / "rank_0")
    for it in (1, 2):
        assert a.ask(op="snapshot", dir=src, seed=it, mb=4, iteration=it)["ok"]
        assert a.ask(op="push", dir=src, rank=0, endpoint=b.endpoint)["ok"]
    rank_dir = b.replicas / "rank_0"
    newest = next(s for s in "ab" if json.loads((rank_dir / commit_file(s)).read_text())[
        "iteration"] == 2)
    _corrupt_tensor_byte(rank_dir / slot_file(newest))
    # the store's own load refuses it where it lies...
    snap = load(rank_dir)
    assert snap.iteration == 1 and snap.rejected and "checksum" in snap.rejected[0][1]
    # ...the server refuses to send it, and the fetch falls back to the older copy
    dest = tmp_path / "dest"
    asked = a.ask(op="fetch", endpoint=b.endpoint, rank=0, dir=str(dest), iteration=2)
    assert not asked["ok"] and asked["reason"].startswith("refused: checksum"), asked
    got = a.ask(op="fetch", endpoint=b.endpoint, rank=0, dir=str(dest))
    assert got["ok"] and got["iteration"] == 1, got
    snap = load(dest)
    assert snap.iteration == 1 and same(snap.state, make_state(1, 4))
    assert load(dest).rejected == []
    # the corrupt copy was uncommitted on the buddy, so the next push of it is taken
    assert not (rank_dir / commit_file(newest)).exists()
    again = a.ask(op="push", dir=src, rank=0, endpoint=b.endpoint)
    assert again["ok"] and not again["skipped"], again
    assert same(load(rank_dir).state, make_state(2, 4))


def test_fetched_copy_is_checked_again_by_load(nodes, tmp_path):
    a, b = nodes("a"), nodes("b")
    src = str(a.root / "rank_0")
    assert a.ask(op="snapshot", dir=src, seed=7, mb=2, iteration=7)["ok"]
    assert a.ask(op="push", dir=src, rank=0, endpoint=b.endpoint)["ok"]
    dest = tmp_path / "dest"
    assert a.ask(op="fetch", endpoint=b.endpoint, rank=0, dir=str(dest))["ok"]
    slot = slot_file("a")
    before = zlib.crc32((dest / slot).read_bytes())
    _corrupt_tensor_byte(dest / slot)
    assert zlib.crc32((dest / slot).read_bytes()) != before
    with pytest.raises(SnapshotError) as e:
        load(dest)
    assert e.value.reason == "none" and "checksum" in e.value.rejected[0][1]


@pytest.mark.slow
def test_ring_of_three_nodes_survives_the_loss_of_any_one(nodes, tmp_path):
    from ft_launcher.snapshots.buddy import buddies
    names = ["n0", "n1", "n2"]
    ring = {name: nodes(name) for name in names}
    chosen = buddies(names, 1)
    for rank, name in enumerate(names):
        node, buddy = ring[name], ring[chosen[name][0]]
        src = str(node.root / f"rank_{rank}")
        assert node.ask(op="snapshot", dir=src, seed=100 + rank, mb=2, iteration=rank)["ok"]
        assert node.ask(op="push", dir=src, rank=rank, endpoint=buddy.endpoint)["ok"]
    ring["n1"].signal(signal.SIGKILL)  # n1 and its local snapshot of rank 1 are gone
    holder = ring[chosen["n1"][0]]
    assert holder is ring["n2"]
    # a survivor (or a spare) taking rank 1 over restores it from the replica
    dest = ring["n0"].root / "restored_rank_1"
    got = ring["n0"].ask(op="fetch", endpoint=holder.endpoint, rank=1, dir=str(dest))
    assert got["ok"] and got["iteration"] == 1, got
    assert same(load(dest).state, make_state(101, 2))
    # what n1 held (rank 0's replica) is lost with it, but rank 0's node still has its own
    assert load(ring["n0"].root / "rank_0").iteration == 0
