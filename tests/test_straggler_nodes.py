"""Stragglers across nodes: two real launchers (one rank each) share a c10d rendezvous on
loopback; node b's rank is slowed (``rank_slow``), and node b's own launcher names it by
comparing with node a's rank, whose medians it reads from the rendezvous store
(ft_launcher/stragglers/straggler_exchange.py). Slow tier: two launchers and their gloo ranks.

The victim is reported above 2.0, as in the single-node cases (test_straggler_e2e.py), and
with the same light job: each section ~1 ms of CPU and a 50 ms sleep, which a busy machine
hardly stretches (a rank alone on its node is compared with the other node's median,
seconds old, and must stay above it for ~10 s: with 20 ms of pure-CPU work beside 8 busy
ranks, a 3x rank dipped below 2x often enough to be named only once they finished, 51 s
after its onset). It is slowed 5x: far above the threshold whatever the load. This proves
the wiring; the rules are unit-tested.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch_helpers import ROOT, SCRIPTS, TORCH_PRELOAD, events, named

pytestmark = pytest.mark.timeout(180)

TRAIN = str(SCRIPTS / "straggler_train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """By pid: SIGTERM, then SIGKILL after a grace."""
    if proc.poll() is not None:
        return
    try:
        psutil.Process(proc.pid).send_signal(signal.SIGCONT)
    except psutil.NoSuchProcess:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_a_slow_rank_on_node_b_is_named_by_its_launcher_against_node_a(tmp_path: Path):
    port = free_port()
    out = tmp_path / "steps"
    runs = {name: tmp_path / f"run-{name}" for name in "ab"}
    common = [*TORCH_PRELOAD, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"straggler-{port}",
              "--workers-stop-timeout", "5", "--ft-rank-heartbeat-timeout", "60",
              "--ft-straggler-threshold", "2.0", "--ft-straggler-window", "10",
              "--ft-simulated-fault", "rank_slow:factor=5,rank=1,base_delay=4"]
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, host in (("a", "true"), ("b", "false")):
            log = open(tmp_path / f"{name}.log", "w")
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "ft_launcher.cli", "--ft-run-dir", str(runs[name]),
                 *common, "--rdzv-conf", f"is_host={host}", TRAIN, str(out), "--work",
                 "20000", "--sleep", "0.05", "--seconds", "120"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
            log.close()  # started together: both make the first round's last call
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and all(p.poll() is None for p in procs.values()):
            if named(events(runs["b"]), "straggler_detected"):
                break
            time.sleep(0.2)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stop").touch()
        for name in "ab":
            procs[name].wait(60)
    finally:
        for proc in procs.values():
            stop(proc)
        logs = {n: (tmp_path / f"{n}.log").read_text()[-2000:] for n in "ab"
                if (tmp_path / f"{n}.log").exists()}
    found = named(events(runs["b"]), "straggler_detected")
    assert found, ("node b never reported its rank", logs, [e for e in events(runs["b"])
                   if e["event"] not in ("rank_connected", "interval_stats")])
    first = found[0]
    assert (first["rank"], first["section"], first["window"]) == (1, "compute", 10), logs
    assert first["score"] > 2.0 and first["reference_s"] > 0
    assert named(events(runs["a"]), "straggler_detected") == [], "node a's rank is healthy"
    injected = named(events(runs["b"]), "fault_injected")
    assert [e["rank"] for e in injected] == [1] and first["ts"] > injected[0]["at"]
    assert procs["a"].returncode == 0 and procs["b"].returncode == 0, logs
