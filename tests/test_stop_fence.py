"""The stop fence (ft_agent.stop_fence): the rule on a fake clock, the question over a real
monitor socket, and the SIGCONT handler in a real process that is really stopped.

The frozen-node scenario itself (several launchers, a spare) is tests/multinode/test_frozen.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from launch_helpers import freeze

from ft_agent import protocol
from ft_agent.stop_fence import (
    STALE_EXIT_CODE,
    STOP_FENCE_ENV,
    StopDetector,
    StopFence,
    threshold_from_env,
)
from ft_launcher.nodes.rendezvous import RendezvousTimings

ROOT = Path(__file__).resolve().parent.parent


# -- the rule, on a fake clock ---------------------------------------------------------------


def test_a_stop_shorter_than_the_threshold_is_not_questioned():
    d = StopDetector(threshold_s=1.0, last_tick=100.0)
    for i in range(1, 200):  # the rank_slow throttle: stopped ~40 ms of every 50 ms
        now = 100.0 + i * 0.05
        if i % 5 == 0:
            d.tick(now)
        assert d.resumed(now) is None
    assert d.resumed(100.0 + 200 * 0.05 + 0.9) is None  # 0.9 s: still below 1 s


def test_a_long_stop_is_seen_whether_the_handler_or_the_ticker_runs_first():
    d = StopDetector(threshold_s=1.0, last_tick=10.0)
    assert d.resumed(13.0) == pytest.approx(3.0)  # the handler first: gap since the tick
    assert d.resumed(13.1) is None  # consumed: the next SIGCONT is an ordinary one

    d = StopDetector(threshold_s=1.0, last_tick=10.0)
    d.tick(13.0)  # after SIGCONT the ticker ran first and moved last_tick on...
    assert d.resumed(13.01) == pytest.approx(3.0)  # ...but kept the gap it saw
    assert d.resumed(13.02) is None


def test_the_longest_pending_gap_wins_and_ticks_stay_in_bounds():
    d = StopDetector(threshold_s=2.0, last_tick=0.0)
    d.tick(5.0)
    d.tick(5.2)
    d.tick(8.0)  # 2.8 s: shorter than the 5 s before
    assert d.resumed(8.1) == pytest.approx(5.0)
    assert StopDetector(0.01, 0.0).tick_s == 0.05
    assert StopDetector(100.0, 0.0).tick_s == 0.25
    assert StopDetector(0.4, 0.0).tick_s == pytest.approx(0.1)


def test_threshold_from_env_takes_positive_seconds_only():
    assert threshold_from_env({}) is None
    assert threshold_from_env({STOP_FENCE_ENV: "1.5"}) == 1.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        assert threshold_from_env({STOP_FENCE_ENV: bad}) is None, bad


def test_the_threshold_the_launcher_sets_is_below_the_keep_alive_expiry():
    t = RendezvousTimings()  # 0.5 s x 4: dropped after 2 s without a keep-alive
    assert t.stop_fence_s == 1.0  # the last keep-alive may be 2 intervals old at the stop
    assert RendezvousTimings(keep_alive_interval=1, keep_alive_max_attempt=3).stop_fence_s == 1


def test_the_handler_asks_and_exits_on_stale_or_no_answer_and_goes_on_when_current():
    clock = [0.0]
    asked: list[float] = []
    exits: list[int] = []
    answers = iter([(True, ""), (False, "dropped from round 4"), (None, "no answer")])

    def ask(stopped_s: float):
        asked.append(stopped_s)
        return next(answers)

    fence = StopFence(1.0, ask, clock=lambda: clock[0], exit=exits.append)
    for stop_s in (0.2, 3.0, 3.0, 3.0):
        clock[0] += stop_s
        fence._on_sigcont(signal.SIGCONT, None)
    assert asked == pytest.approx([3.0, 3.0, 3.0])  # the 0.2 s stop was not questioned
    assert exits == [STALE_EXIT_CODE, STALE_EXIT_CODE]  # stale, then no answer


def _blocked(tid: int) -> set[int]:
    """The signals a thread of this process blocks, from /proc."""
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError("no SigBlk line")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_the_ticker_thread_never_takes_the_sigcont():
    """A SIGCONT taken by the ticker (whose tick is due the moment a long stop ends) lets
    the main thread run on until the ticker gets a CPU: in a process whose main thread
    blocks SIGCONT (so another thread takes it), the main thread wrote before its handler
    ran in 4 of 30 trials on a loaded 2-core machine. The ticker blocks it."""
    fence = StopFence(1.0, lambda s: (True, ""))
    assert fence.install()
    try:
        deadline = time.monotonic() + 5
        while fence._thread is not None and fence._thread.native_id is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.05)  # the thread has set its mask before its first tick
        assert signal.SIGCONT in _blocked(fence._thread.native_id)
        assert signal.SIGCONT not in _blocked(threading.main_thread().native_id)
    finally:
        fence.close()


# -- the question, over a real monitor socket ------------------------------------------------


def test_the_client_asks_its_monitor_and_gets_its_answer(tmp_path, monkeypatch):
    from ft_agent.client import RankMonitorClient
    from ft_launcher.config import FaultToleranceConfig
    from ft_launcher.hang.monitor import Monitor, RankSlot
    from ft_launcher.hang.timeouts import TimeoutBook

    endpoint = f"ipc://{tmp_path}/m.sock"
    events: list[tuple[str, dict]] = []
    monitor = Monitor(endpoint, TimeoutBook(FaultToleranceConfig()), tmp_path / "state.json",
                      lambda name, **fields: events.append((name, fields)))
    asked: list[tuple[int, float]] = []

    def answer(rank: int, stopped_s: float) -> tuple[bool, str]:
        asked.append((rank, stopped_s))
        return (False, "round 2 is over") if stopped_s > 2 else (True, "")

    # The answer is the cycle's callback, given when the cycle starts.
    monitor.start_cycle(0, [RankSlot(0, 0, pid=os.getpid(), token="tok")],
                        {0: time.monotonic()}, tmp_path, on_fence=answer)

    done = threading.Event()

    def pump() -> None:  # the launcher's loop, reduced to draining its socket
        while not done.is_set():
            monitor.drain(time.monotonic)
            time.sleep(0.005)

    for key, value in {"FT_ENDPOINT": endpoint, "FT_TOKEN": "tok", "RANK": "0",
                       "LOCAL_RANK": "0", "FT_CYCLE": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(STOP_FENCE_ENV, raising=False)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    client = RankMonitorClient()
    try:
        client.init_workload_monitoring()
        assert client._ask_fence(1.5) == (True, "")
        assert client._ask_fence(3.25) == (False, "round 2 is over")
        assert asked == [(0, 1.5), (0, 3.25)]
    finally:
        client.shutdown_workload_monitoring()
        done.set()
        thread.join(5)
        monitor.close()
    assert "handler_error" not in monitor.protocol_errors()


def test_fence_frames_are_validated():
    msg = protocol.decode(protocol.encode(protocol.FENCE, req=3, stopped_s=2.5, extra="x"))
    assert msg == {"v": protocol.VERSION, "k": "fence", "req": 3, "stopped_s": 2.5}
    for bad in ({"req": 1}, {"req": 1, "stopped_s": -1}, {"req": 1, "stopped_s": "2"},
                {"req": -1, "stopped_s": 1}):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(protocol.encode(protocol.FENCE, **bad))


# -- the handler in a real process, really stopped -------------------------------------------

CHILD = textwrap.dedent("""
    import os, sys, time
    from ft_agent.stop_fence import StopFence
    out, threshold, answer = sys.argv[1], float(sys.argv[2]), sys.argv[3]

    def ask(stopped_s):
        with open(out + ".asked", "a") as f:
            f.write(f"{stopped_s}\\n")
        return answer == "current", "test says " + answer

    fence = StopFence(threshold, ask)
    assert fence.install()
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for i in range(100000):  # a write every 10 ms, stamped with the wall clock
        os.write(fd, f"{time.time()}\\n".encode())
        time.sleep(0.01)
""")


def _child(tmp_path: Path, threshold: float, answer: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"writes_{answer}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), str(threshold), answer],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    return proc, out


def _stop(proc: subprocess.Popen) -> None:
    try:
        psutil.Process(proc.pid).send_signal(signal.SIGCONT)
        proc.kill()
    except psutil.NoSuchProcess:
        pass
    proc.wait(10)


def test_a_stopped_process_that_is_stale_exits_before_it_writes_again(tmp_path):
    proc, out = _child(tmp_path, threshold=1.0, answer="stale")
    try:
        freeze(proc.pid)
        stopped_at = time.time()
        time.sleep(2.0)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(30) == STALE_EXIT_CODE
        after = [float(x) for x in out.read_text().split()
                 if float(x) > stopped_at + 0.05]  # a write in flight at the stop may land
        assert not after, f"{len(after)} writes after the stop"
        assert "test says stale" in proc.stderr.read()
    finally:
        _stop(proc)


def test_short_stops_and_a_current_answer_leave_the_process_running(tmp_path):
    proc, out = _child(tmp_path, threshold=1.0, answer="current")
    try:
        for _ in range(20):  # a throttle's duty cycle: 20 ms stopped, 30 ms running
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.02)
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.03)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.5)  # long, but its launcher says the round is current
        os.kill(proc.pid, signal.SIGCONT)
        lines = out.read_text().count("\n")
        asked = Path(f"{out}.asked")
        deadline = time.monotonic() + 30
        while not asked.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()
        assert out.read_text().count("\n") > lines  # it went on writing
        # The long stop was questioned (a loaded machine may starve the ticker into one
        # more question, which the launcher answers the same way).
        assert max(float(x) for x in asked.read_text().split()) >= 1.4
    finally:
        _stop(proc)
