"""The monitor's named methods (what the launcher may ask) and the callbacks a cycle gives
at ``start_cycle``, on a real Monitor fed frames through ``handle_frame`` (no peer)."""

from __future__ import annotations

import os
import time

import pytest

from ft_agent import protocol
from ft_launcher.config import FaultToleranceConfig
from ft_launcher.hang.liveness import HangVerdict
from ft_launcher.hang.monitor import Monitor, RankSlot


@pytest.fixture
def monitor(tmp_path):
    ft = FaultToleranceConfig(straggler_section="compute")
    m = Monitor.for_job(f"ipc://{tmp_path}/m.sock", ft, tmp_path / "state.json",
                        lambda name, **fields: None)
    yield m
    m.close()


def _start(monitor: Monitor, tmp_path, **callbacks) -> None:
    slots = [RankSlot(r, r, pid=os.getpid(), token=f"tok{r}") for r in (0, 1)]
    monitor.start_cycle(0, slots, {0: 10.0, 1: 10.0}, tmp_path, **callbacks)
    for r in (0, 1):
        monitor.handle_frame(f"r{r}".encode(), protocol.encode(
            protocol.HELLO, token=f"tok{r}", rank=r, local_rank=r, pid=os.getpid(), host="h",
            cycle=0), 10.5)


def _send(monitor: Monitor, rank: int, kind: str, now: float, **fields) -> None:
    monitor.handle_frame(f"r{rank}".encode(), protocol.encode(kind, **fields), now)


def test_what_the_ranks_reported_is_read_through_named_methods(monitor, tmp_path):
    _start(monitor, tmp_path)
    assert monitor.all_connected() and monitor.any_connected()
    assert not monitor.closed_a_section(0)
    _send(monitor, 0, protocol.SECTION_OPEN, 10.6, name="compute")
    _send(monitor, 0, protocol.SECTION_CLOSE, 10.7, name="compute")
    assert monitor.closed_a_section(0) and not monitor.closed_a_section(1)
    _send(monitor, 0, protocol.HEARTBEAT, 11.0)
    _send(monitor, 1, protocol.PROGRESS, 12.0, it=7, ckpt=True)
    assert monitor.progress() == {1: 7}
    assert monitor.checkpoints() == [7]
    assert monitor.last_progress() == {1: (7, pytest.approx(12.0))}
    assert monitor.last_activity() == {0: pytest.approx(11.0), 1: pytest.approx(12.0)}
    assert monitor.heartbeat_ages(13.0) == {0: pytest.approx(2.0), 1: pytest.approx(1.0)}
    assert monitor.local_rank(1) == 1
    verdict = HangVerdict(0, 0, "heartbeat", 1.0, 9.0)
    assert set(monitor.silent_ranks(verdict, 20.0)) == {0, 1}
    assert monitor.timeouts_in_force() and "heartbeat" in monitor.describe_timeouts()


def test_the_cycle_callbacks_are_given_at_start_and_replaced_by_the_next_cycle(monitor,
                                                                                tmp_path):
    closed, device, fences = [], [], []
    _start(monitor, tmp_path, on_section_closed=lambda *a: closed.append(a),
           on_device_time=lambda *a: device.append(a),
           on_fence=lambda rank, s: (fences.append((rank, s)) or (False, "round over")))
    _send(monitor, 0, protocol.SECTION_OPEN, 11.0, name="compute")
    _send(monitor, 0, protocol.SECTION_CLOSE, 12.5, name="compute", dev=0.75)
    _send(monitor, 1, protocol.FENCE, 13.0, req=1, stopped_s=4.0)
    assert [(r, name) for r, name, _ in closed] == [(0, "compute")]
    assert closed[0][2] == pytest.approx(1.5)
    assert device == [(0, "compute", 0.75)]
    assert fences == [(1, 4.0)]
    _start(monitor, tmp_path)  # a new cycle without callbacks: the old ones are gone
    _send(monitor, 0, protocol.SECTION_OPEN, 14.0, name="compute")
    _send(monitor, 0, protocol.SECTION_CLOSE, 15.0, name="compute", dev=0.5)
    _send(monitor, 1, protocol.FENCE, 15.0, req=2, stopped_s=4.0)
    assert len(closed) == 1 and len(device) == 1 and len(fences) == 1
    assert "handler_error" not in monitor.protocol_errors()


def test_each_frame_of_a_drain_is_read_at_its_own_time(monitor, tmp_path):
    """A heartbeat that arrives while a drain runs is handled at the time it is read, not at
    a time read before it arrived: capped there, its deadline would begin early (a verdict
    before the full timeout, seen once in the bench)."""
    import zmq  # noqa: PLC0415

    monitor.start_cycle(0, [RankSlot(0, 0, pid=os.getpid(), token="tok0")], {0: 10.0},
                        tmp_path)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    reads = []

    def clock() -> float:
        # The first read of the clock: the rank heartbeats (stamp 12.0) just after it.
        if not reads:
            sock.send(protocol.heartbeat_frame(12.0))
            time.sleep(0.2)
        reads.append(11.0 if not reads else 13.0)
        return reads[-1]

    try:
        sock.connect(f"ipc://{tmp_path}/m.sock")
        sock.send(protocol.encode(protocol.HELLO, token="tok0", rank=0, local_rank=0,
                                  pid=os.getpid(), host="h", cycle=0))
        read = 0
        for _ in range(2000):
            read += monitor.drain(clock)[0]
            if read == 2:
                break
            time.sleep(0.005)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert read == 2 and monitor.all_connected()
    assert monitor.last_activity() == {0: pytest.approx(12.0)}
