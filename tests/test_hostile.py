"""The supervisor must never be the fault (issue 11): hostile frames on the real socket of
a running launcher, a worker's children after the launcher is SIGKILLed, the fd limit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
from launch_helpers import (
    NO_PRELOADS,
    ROOT,
    SCRIPTS,
    events,
    finish,
    launcher_cmd,
    named,
    summary,
    wait_for,
)

from ft_agent import protocol

IO_CASES = str(SCRIPTS / "io_cases.py")


def _start(run_dir: Path, *args: str, env: dict[str, str] | None = None,
           prefix: list[str] | None = None) -> subprocess.Popen:
    """A launcher of io_cases.py, which imports no torch: the zygote preloads nothing."""
    return subprocess.Popen([*(prefix or []), *launcher_cmd(run_dir, *NO_PRELOADS, *args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, **(env or {})})


def _peer(run_dir: Path, rank: int = 0) -> dict:
    path = run_dir / f"peer_rank_{rank}.json"
    wait_for(path.exists, 60, "the worker to connect")
    return json.loads(path.read_text())


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


# -- hostile frames on the live socket -------------------------------------------------------


@pytest.mark.timeout(120)
def test_hostile_frames_on_the_live_socket_are_counted_and_the_job_finishes(run_dir: Path):
    """64 KiB of nested brackets, a 5000-digit integer, a 10 MB frame, non-UTF-8 bytes, NaN,
    sent by a stranger without a token; a diagnosis carrying event/ts/rank/cycle/name
    sent by the real rank: the job finishes normally and every bad frame is counted."""
    proc = _start(run_dir, "--nproc-per-node", "1", "--ft-rank-heartbeat-timeout", "3",
                  IO_CASES, "heartbeats_under_attack", "4")
    try:
        peer = _peer(run_dir)
        ctx = zmq.Context.instance()
        sock = _dealer(ctx, peer["endpoint"])
        hostile = [
            b"[" * protocol.MAX_FRAME_BYTES,
            b'{"v":1,"k":"hello","token":"x","rank":' + b"9" * 5000 + b"}",
            b'{"v":1,"k":"hb","t":NaN}',
            b"\xff\xfe" * 100,
            b'{"v":1,"k":"hb","pad":"' + b"a" * (10 * 2**20) + b'"}',
            b'{"v":1,"k":"sec_open","name":"\\u001b[2J"}',
        ]
        for frame in hostile:
            sock.send(frame)
        sock.send_multipart([b"two", b"frames"])
        time.sleep(0.5)
        sock.close()
    finally:
        out = finish(proc, 90)
    assert proc.returncode == 0, out[-3000:]
    assert "launcher error" not in out and "Traceback" not in out, out[-3000:]
    evs = events(run_dir)
    assert not named(evs, "hang_detected") and not named(evs, "restart"), evs
    errors = summary(run_dir)["protocol_errors"]
    assert sum(errors.values()) >= len(hostile) + 1, errors
    # The forged diagnosis arrived, but only with the fields a diagnosis has.
    diag = named(evs, "diagnosis")
    assert len(diag) == 1 and diag[0]["state"] == "FORGED", diag
    assert diag[0]["rank"] == 0 and diag[0]["cycle"] == 0 and diag[0]["ts"] != 1.0
    assert not {"name", "timeout_kind"} & set(diag[0]), diag[0]


@pytest.mark.timeout(120)
def test_second_hello_as_a_live_rank_is_refused(run_dir: Path):
    """Item 11: a stranger with the right token says hello as the live rank 0, naming an
    unrelated process as its pid. The real rank 0 must stay rank 0 (not judged hung), the
    impostor is refused and counted, and the unrelated process gets no signal.

    Fails until the monitor binds a rank's identity to the worker it spawned."""
    bystander = subprocess.Popen(["sleep", "120"])
    proc = _start(run_dir, "--nproc-per-node", "1", "--ft-rank-heartbeat-timeout", "2",
                  IO_CASES, "heartbeats_under_attack", "6")
    try:
        peer = _peer(run_dir)
        ctx = zmq.Context.instance()
        sock = _dealer(ctx, peer["endpoint"])
        sock.send(protocol.encode(protocol.HELLO, token=peer["token"], rank=0, local_rank=0,
                                  pid=bystander.pid, host=socket.gethostname(), cycle=0))
        reply = protocol.decode(sock.recv()) if sock.poll(5000) else None
        sock.close()
        out = finish(proc, 90)
        assert bystander.poll() is None, "the bystander named in the hello was signalled"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        bystander.kill()
        bystander.wait()
    assert reply is not None and reply["ok"] is False, reply
    assert proc.returncode == 0, out[-3000:]
    evs = events(run_dir)
    assert not named(evs, "hang_detected"), named(evs, "hang_detected")
    assert len(named(evs, "rank_connected")) == 1, named(evs, "rank_connected")
    assert summary(run_dir)["protocol_errors"].get("rejected_hello", 0) >= 1


# -- a worker's children when the launcher is SIGKILLed --------------------------------------


@pytest.mark.timeout(90)
def test_children_of_workers_die_with_a_sigkilled_launcher(run_dir: Path):
    """PDEATHSIG reaches the worker only; the guardian kills the rest of its group."""
    proc = _start(run_dir, "--nproc-per-node", "2", IO_CASES, "child_sleeps")
    try:
        pid_files = [run_dir / f"child_rank_{r}.pid" for r in (0, 1)]
        wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files), 60,
                 "the workers' children")
        children = [psutil.Process(int(p.read_text())) for p in pid_files]
        assert all(c.is_running() for c in children)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)

        def all_dead() -> bool:
            return not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE
                           for c in children)

        wait_for(all_dead, 5, "the workers' children to die after the launcher")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_worker_that_exited_16_before_the_teardown_keeps_its_code(tmp_path: Path):
    """Rank 0 exits 16 just before the group is stopped (not yet reaped): it keeps its 16
    and is not counted as signalled; rank 1, still running, is stopped by SIGTERM."""
    from ft_launcher.process.workers import WorkerGroup, WorkerSpec

    env = {**os.environ, "FT_RUN_DIR": str(tmp_path), "RANK": "0"}
    specs = [WorkerSpec(0, 0, [sys.executable, IO_CASES, "exit_code", "16"], env,
                        tmp_path / "r0.log", False),
             WorkerSpec(1, 1, [sys.executable, "-c", "import time; time.sleep(60)"], env,
                        tmp_path / "r1.log", False)]
    group = WorkerGroup()
    group.start(specs)
    try:
        first = psutil.Process(group.workers[0].pid)
        wait_for(lambda: first.status() == psutil.STATUS_ZOMBIE, 30, "rank 0 to exit")
        group.stop(grace=10)
    finally:
        group.kill_all()
    r0, r1 = group.workers
    assert (r0.describe_exit(), r0.signalled) == ({"exit_code": 16, "signal": None}, False)
    assert (r1.describe_exit(), r1.signalled) == ({"exit_code": None, "signal": "SIGTERM"},
                                                  True)


# -- the open-file limit ---------------------------------------------------------------------


def _connect_many(path: str, n: int) -> list[socket.socket]:
    conns = []
    for _ in range(n):
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        conns.append(c)
    return conns


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_1100_connections_against_a_1024_soft_limit(run_dir: Path):
    """Started with a soft limit of 1,024 (hard 4,096), the launcher raises its soft limit,
    survives 1,100 connections, finishes with a summary; its worker gets the old limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"needs a hard open-file limit of 4096 (have {hard})")
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    proc = _start(run_dir, "--nproc-per-node", "1", IO_CASES, "heartbeats_under_attack", "6",
                  prefix=["prlimit", "--nofile=1024:4096", "--"])
    conns: list[socket.socket] = []
    try:
        peer = _peer(run_dir)
        launcher = psutil.Process(proc.pid)
        assert launcher.rlimit(psutil.RLIMIT_NOFILE) == (4096, 4096)
        worker = psutil.Process(peer["pid"])
        assert worker.rlimit(psutil.RLIMIT_NOFILE) == (1024, 4096)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
        conns = _connect_many(peer["endpoint"][len("ipc://"):], 1100)
        time.sleep(1.0)
        assert proc.poll() is None, "the launcher died"
    finally:
        for c in conns:
            c.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        out = finish(proc, 90)
    assert proc.returncode == 0, out[-3000:]
    assert summary(run_dir)["exit_code"] == 0


class PeakRss:
    """A process's own peak RSS (``VmHWM``), sampled until it exits: a thread of the test,
    so neither the process's children (RUSAGE_CHILDREN would count the zygote, torch
    imported, and the workers forked from it) nor the measuring touch the number."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s, self.kb = pid, every_s, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return  # reaped
            line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
            if line is None:
                return  # a zombie: its memory is gone, its peak was read before
            self.kb = max(self.kb, int(line.split()[1]))
            time.sleep(self.every_s)

    def mb(self) -> float:
        self.thread.join(timeout=10)
        return self.kb / 1024


def test_carriage_return_flood_does_not_grow_the_launcher(run_dir: Path):
    """64 MB of '\\r' without a newline, then escape sequences: the launcher's own peak
    memory stays bounded (it grew to 229 MB before), the log keeps every byte, the console
    shows the escapes as text. With the defaults: the rank is a warm one (its output comes
    through the standby's pipe); the zygote and the standbys, which hold torch, are
    bounded apart, by what their ready events measured."""
    proc = _start(run_dir, "--nproc-per-node", "1", IO_CASES, "carriage_returns", "64")
    peak = PeakRss(proc.pid)
    out = finish(proc, 90)
    assert proc.returncode == 0, out[-2000:]
    log = run_dir / "logs" / "cycle_0" / "rank_0.log"
    tail = b"\x1b[2J\x1b]0;title\x07after the flood\n"
    assert log.stat().st_size == 64 * (1 << 20) + len(tail)
    with open(log, "rb") as f:
        f.seek(-len(tail), os.SEEK_END)
        assert f.read() == tail
    assert "\x1b" not in out and "[rank0]: \\x1b[2J\\x1b]0;title\\x07after the flood" in out
    peak_mb = peak.mb()
    evs = events(run_dir)
    zygote = named(evs, "zygote_ready")[0]
    standbys = named(evs, "standby_ready")
    print(f"launcher's peak RSS: {peak_mb:.0f} MB; zygote RSS {zygote['rss_mb']} MB, "
          f"PSS {zygote['pss_mb']} MB; standbys' PSS {[s['pss_mb'] for s in standbys]} MB")
    assert named(evs, "workers_started")[0]["warm"] == [True]
    assert 0 < peak_mb < 120, f"the launcher's peak RSS {peak_mb:.0f} MB"
    # The zygote holds torch (about 300 MB on CPU); a fork's PSS is its share of the
    # zygote's pages plus what it dirtied (45-75 MB measured), where a standby that imported
    # torch itself would count it all.
    assert zygote["rss_mb"] < 1024, zygote
    assert standbys and all(s["forked"] and s["pss_mb"] < 160 for s in standbys), standbys


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("Linux process semantics (PDEATHSIG, /proc)")
