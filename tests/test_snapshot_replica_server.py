"""The replica server against hostile and lying peers (real sockets on loopback, the server
in a thread of this process so its counters can be read): wrong tokens, absurd sizes,
garbage and non-ZeroMQ bytes are dropped and it keeps serving; a sender whose bytes do not
match its commit record gets nothing committed; a stalled transfer is dropped (injected
clock); the background sender never blocks its caller; nothing leaks."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from ft_agent.snapshot import SnapshotError, SnapshotStore, commit_file, load, slot_file
from ft_launcher.snapshots.replica import ReplicaSender, ReplicaServer, fetch, held, push
from ft_launcher.snapshots.replica_disk import SlotReader
from ft_launcher.snapshots.replica_wire import Message, decode, encode

TOKEN = "c3" * 16


def snapshot(directory: Path, iteration: int, n: int = 300_000) -> dict:
    state = {"w": torch.arange(n, dtype=torch.float32) + iteration, "it": iteration}
    with SnapshotStore(directory) as store:
        store.snapshot(state, iteration, wait=True)
        assert store.wait().ok
    return state


@pytest.fixture
def server(tmp_path):
    clock = [1000.0]
    srv = ReplicaServer(tmp_path / "replicas", "tcp://127.0.0.1:0", TOKEN, stall_timeout=5.0,
                        clock=lambda: clock[0]).start()
    srv.fake_clock = clock
    yield srv
    srv.close()


@pytest.fixture
def raw():
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []

    def connect(endpoint: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append(s)
        return s

    yield connect
    for s in socks:
        s.close(0)
    ctx.term()


def reply(sock: zmq.Socket, timeout_ms: int = 5000) -> Message | None:
    if not sock.poll(timeout_ms):
        return None
    return decode(sock.recv_multipart(), TOKEN)


def serves(srv: ReplicaServer, tmp_path: Path, iteration: int) -> bool:
    src = tmp_path / f"src_{iteration}"
    state = snapshot(src, iteration)
    pushed = push(src, 0, srv.endpoint, TOKEN, timeout=10)
    got = fetch(srv.endpoint, 0, tmp_path / f"dest_{iteration}", TOKEN, timeout=10)
    return pushed.ok and got.ok and torch.equal(load(tmp_path / f"dest_{iteration}").state[
        "w"], state["w"])


def test_hostile_frames_are_dropped_and_the_server_keeps_serving(server, raw, tmp_path):
    s = raw(server.endpoint)
    head = {"v": 1, "op": "push", "token": TOKEN, "rank": 0, "iteration": 1, "slot": "a",
            "size": 4096}
    hostile = [
        [b"garbage"], [b"\x00" * 10, b"x", b"y"], [os.urandom(3000)],
        [json.dumps({**head, "token": "00" * 16}).encode()],
        [json.dumps({**head, "size": 10**18}).encode()],
        [json.dumps({**head, "rank": -1}).encode()],
        [json.dumps({**head, "rank": 2**40}).encode()],
        [json.dumps({**head, "slot": "../../etc"}).encode()],
        [b"{" * 5000],
        [json.dumps({**head, "op": "data", "offset": 0}).encode(), b"z" * 100],
    ]
    for frames in hostile:
        s.send_multipart(frames)
    assert reply(s, 500) is None  # no answer to any of it
    # a frame over the bound: the server's ZeroMQ drops the connection
    big = raw(server.endpoint)
    big.send_multipart([b"x" * (17 * 2**20)])
    # bytes that are not ZeroMQ at all
    host, port = server.endpoint.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as plain:
        plain.sendall(os.urandom(70_000))
    assert serves(server, tmp_path, 1)
    assert server.stats["hostile_token"] >= 1 and server.stats["hostile_bounds"] >= 3
    assert server.stats["hostile_format"] >= 3
    assert not list((server.root).glob("rank_1099511627776*"))
    # valid token, but no transfer under way
    s.send_multipart(encode(Message("data", 0, offset=0, payload=b"x"), TOKEN))
    answer = reply(s)
    assert answer.op == "error" and answer.reason.startswith("order"), answer
    assert serves(server, tmp_path, 2)


def test_bytes_that_do_not_match_their_commit_are_never_committed(server, raw, tmp_path):
    src = tmp_path / "src"
    first = snapshot(src, 1)
    assert push(src, 0, server.endpoint, TOKEN).ok
    snapshot(src, 2)
    reader = SlotReader(src)
    data, commit = reader.read(0, reader.size), bytearray(reader.commit_bytes)
    reader.close()
    rank_dir = server.root / "rank_0"

    def attempt(iteration: int, size: int, payload: bytes, commit_bytes: bytes) -> Message:
        s = raw(server.endpoint)
        s.send_multipart(encode(Message("push", 0, iteration=iteration, slot="a", size=size),
                                TOKEN))
        assert reply(s).op == "ready"
        for off in range(0, len(payload), 2**20):
            s.send_multipart(encode(Message("data", 0, offset=off,
                                            payload=payload[off:off + 2**20]), TOKEN))
            m = reply(s)
            if m.op == "error":
                return m
        s.send_multipart(encode(Message("commit", 0, payload=commit_bytes), TOKEN))
        return reply(s)

    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    lying = json.loads(commit)
    lying["iteration"] = 3
    outcomes = [
        attempt(2, len(data), bytes(flipped), bytes(commit)),        # a flipped bit
        attempt(3, len(data), data, bytes(commit)),                  # sent as another iteration
        attempt(2, len(data) + 10, data, bytes(commit)),             # a size it does not have
        attempt(2, len(data), data, json.dumps(lying).encode()),     # a commit that lies
        attempt(2, len(data), data, b"not json"),
    ]
    for m in outcomes:
        assert m is not None and m.op == "error", m
    assert [m.reason.split(":")[0] for m in outcomes] == [
        "checksum", "mismatch", "truncated", "mismatch", "format"]
    snap = load(rank_dir)
    assert snap.iteration == 1 and torch.equal(snap.state["w"], first["w"])
    assert held(server.endpoint, 0, TOKEN).iterations == (1,)
    assert push(src, 0, server.endpoint, TOKEN).ok  # and the honest one still goes through
    assert load(rank_dir).iteration == 2


def test_a_stalled_push_is_dropped_after_the_stall_timeout(server, raw, tmp_path):
    src = tmp_path / "src"
    snapshot(src, 1)
    assert push(src, 0, server.endpoint, TOKEN).ok
    snapshot(src, 2)
    reader = SlotReader(src)
    s = raw(server.endpoint)
    s.send_multipart(encode(Message("push", 0, iteration=2, slot="a", size=reader.size), TOKEN))
    assert reply(s).op == "ready"
    s.send_multipart(encode(Message("data", 0, offset=0, payload=reader.read(0, 4096)), TOKEN))
    assert reply(s).op == "ack"
    reader.close()
    busy = push(src, 0, server.endpoint, TOKEN, timeout=5)
    assert not busy.ok and busy.reason.startswith("refused: busy"), busy
    server.fake_clock[0] += 4.0
    assert reply(s, 300) is None  # not yet: 4 s of 5 without progress
    server.fake_clock[0] += 2.0
    dropped = reply(s)
    assert dropped.op == "error" and dropped.reason.startswith("stalled"), dropped
    assert server.stats["stalled"] == 1
    assert load(server.root / "rank_0").iteration == 1
    assert push(src, 0, server.endpoint, TOKEN).ok
    assert load(server.root / "rank_0").iteration == 2


def test_root_and_rank_directories_must_be_private(tmp_path):
    open_root = tmp_path / "open"
    open_root.mkdir(mode=0o755)
    open_root.chmod(0o755)
    with pytest.raises(SnapshotError) as e:
        ReplicaServer(open_root, "tcp://127.0.0.1:0", TOKEN)
    assert e.value.reason == "mode"
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(SnapshotError) as e:
        ReplicaServer(tmp_path / "link", "tcp://127.0.0.1:0", TOKEN)
    assert e.value.reason == "symlink"
    with pytest.raises(ValueError):
        ReplicaServer(tmp_path / "r", "tcp://127.0.0.1:0", "")


def test_fetch_into_a_directory_that_is_not_ours_is_a_local_failure(server, tmp_path):
    src = tmp_path / "src"
    snapshot(src, 1)
    assert push(src, 0, server.endpoint, TOKEN).ok
    dest = tmp_path / "dest"
    dest.mkdir(mode=0o755)
    dest.chmod(0o755)
    result = fetch(server.endpoint, 0, dest, TOKEN, timeout=5)
    assert not result.ok and result.reason.startswith("mode"), result
    assert not (dest / commit_file("a")).exists() and not (dest / slot_file("a")).exists()


def _unused_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_sender_never_blocks_and_reports_failures_as_values(tmp_path):
    src = tmp_path / "src"
    snapshot(src, 1)
    nowhere = _unused_endpoint()
    seen = []

    def on_result(result):
        seen.append(result)
        raise RuntimeError("a careless callback")

    sender = ReplicaSender(TOKEN, timeout=1.0, max_pending=2, on_result=on_result)
    try:
        start = time.monotonic()
        assert sender.submit(src, 0, nowhere)
        assert sender.submit(src, 1, nowhere)
        assert sender.submit(src, 1, nowhere)  # replaces rank 1's waiting request
        accepted = sender.submit(src, 2, nowhere)
        assert time.monotonic() - start < 0.5
        assert sender.wait_idle(30)
        results = sender.results()
        assert len(results) == 2 + accepted and sender.results() == []
        assert all(not r.ok and r.reason.startswith("timeout") for r in results), results
        assert len(seen) == len(results)
        assert not sender.submit(tmp_path / "missing", 3, nowhere) or sender.wait_idle(30)
        local = [r for r in sender.results() if r.rank == 3]
        assert all(r.reason.startswith("local") for r in local), local
    finally:
        sender.close()
    assert not sender.submit(src, 0, nowhere)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_no_threads_or_descriptors_are_left_behind(tmp_path):
    src = tmp_path / "src"
    snapshot(src, 1)
    threads, fds = set(threading.enumerate()), _fds()
    srv = ReplicaServer(tmp_path / "replicas", "tcp://127.0.0.1:0", TOKEN).start()
    with ReplicaSender(TOKEN, timeout=5) as sender:
        assert sender.submit(src, 0, srv.endpoint) and sender.wait_idle(30)
        assert sender.results()[0].ok
    assert fetch(srv.endpoint, 0, tmp_path / "dest", TOKEN).ok
    assert held(srv.endpoint, 0, TOKEN).iterations == (1,)
    srv.close()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - threads or _fds() - fds:
        assert time.monotonic() < deadline, (set(threading.enumerate()) - threads,
                                             _fds() - fds)
        time.sleep(0.05)
