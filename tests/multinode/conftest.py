"""Several nodes on loopback: launchers as nodes, and a real 3-member etcd cluster.

``Nodes`` starts ft_launcher processes (one per "node", ``--nproc-per-node 1``) running
``node_worker.py``, and stops every one of them by pid at teardown. ``etcd_cluster``
starts three etcd members with ``scripts/etcd_cluster.sh`` on kernel-chosen loopback ports
and stops them by pid. Without the ``etcd`` binary the etcd tests are skipped, except as
root or with CI set (CI installs Debian's etcd-server): there they fail, saying so.

This folder is a package (``__init__.py``): a second top-level module named ``conftest``
would shadow ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from launch_helpers import TORCH_PRELOAD, wait_for

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "node_worker.py"
ETCD_SCRIPT = ROOT / "scripts" / "etcd_cluster.sh"
LAUNCHER = [sys.executable, "-m", "ft_launcher.cli"]


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel says are free now (held open together, then closed)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def in_thread(fn):
    """Run ``fn`` in a daemon thread; returns the thread and a box that gets its ``value``
    or the ``error`` it raised (handed to the test thread)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace``; a pid that is gone is fine."""
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(grace)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written right now
            continue
    return out


wait_until = wait_for  # the suite's one polling helper (launch_helpers)


@dataclass
class Nodes:
    """ft_launcher processes on loopback, one per node, all running node_worker.py."""

    base: Path
    common: list[str]
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    frozen: list[psutil.Process] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.base / "out"

    def start(self, name: str, *extra: str, env: dict[str, str] | None = None) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        # node_worker.py imports torch alone (a gloo group): the zygote needs nothing more.
        cmd = [*LAUNCHER, "--ft-run-dir", str(self.base / name), *TORCH_PRELOAD, *self.common,
               *extra, str(WORKER), str(self.out)]
        log = open(self.base / f"{name}.log", "w")  # the child keeps its own copy
        self.procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **self.env, **(env or {})})
        log.close()
        return self.procs[name].pid

    def events(self, name: str, event: str | None = None) -> list[dict]:
        evs = read_jsonl(self.base / name / "events.jsonl")
        return [e for e in evs if event is None or e["event"] == event]

    def summary(self, name: str) -> dict:
        return json.loads((self.base / name / "summary.json").read_text())

    def steps(self) -> list[dict]:
        return read_jsonl(self.out / "steps.jsonl")

    def log(self, name: str) -> str:
        path = self.base / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """Signal one launcher; returns the wall-clock time of the kill."""
        t = time.time()
        os.kill(self.procs[name].pid, sig)
        return t

    def stop_training(self) -> None:
        (self.out / "stop").touch()

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher {name} did not exit within {timeout} s:\n{self.log(name)}")

    def first_step(self, pred) -> dict | None:
        return next((s for s in self.steps() if pred(s)), None)

    def tree(self, name: str) -> tuple[psutil.Process, list[psutil.Process]]:
        """A launcher and every process below it (its workers and theirs)."""
        launcher = psutil.Process(self.procs[name].pid)
        return launcher, launcher.children(recursive=True)

    def freeze(self, name: str) -> list[psutil.Process]:
        """SIGSTOP a launcher and all its descendants (a frozen node); returns them, to
        thaw. The launcher first, so it sees nothing of its workers stopping."""
        launcher, below = self.tree(name)
        frozen = []
        for p in [launcher, *below]:
            try:
                p.suspend()
                frozen.append(p)
            except psutil.NoSuchProcess:
                pass
        self.frozen.extend(frozen)
        return frozen

    def thaw(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        self.thaw(self.frozen)  # a failed test may leave a node frozen
        for proc in self.procs.values():
            stop_pid(proc.pid)
            proc.wait(10)


@pytest.fixture
def nodes(run_dir: Path) -> Iterator[Nodes]:
    """Factory-free: tests set ``nodes.common`` then call ``nodes.start(name)``."""
    n = Nodes(base=run_dir, common=[])
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield n
    finally:
        n.close()


def c10d_common(port: int, nnodes: str, run_id: str, *extra: str) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--max-restarts", "5", "--workers-stop-timeout", "2", *extra]


# -- etcd ------------------------------------------------------------------------------


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_etcd() -> None:
    """Skip (not root, not CI) or fail (root or CI: CI installs it) without etcd/python-etcd."""
    missing = []
    if not any((Path(p) / "etcd").exists() for p in os.environ.get("PATH", "").split(":")):
        missing.append("the etcd server (Debian: apt-get install -y etcd-server)")
    try:
        import etcd  # noqa: F401
    except ModuleNotFoundError:
        missing.append("the python-etcd client (pip install 'ft-launcher[etcd]')")
    if not missing:
        return
    reason = "etcd tests need " + " and ".join(missing)
    if _in_ci() or os.geteuid() == 0:
        pytest.fail(f"{reason}; CI installs them, so their absence is an error here",
                    pytrace=False)
    pytest.skip(reason)


@dataclass
class EtcdCluster:
    dir: Path
    client_ports: list[int]
    pids: list[int]

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def alive(self, i: int) -> bool:
        try:
            return psutil.Process(self.pids[i]).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _get(self, i: int, path: str) -> tuple[int, str]:
        """(HTTP status, body) of a GET to member i; (0, error) when it does not answer."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback
        try:
            with opener.open(f"http://127.0.0.1:{self.client_ports[i]}{path}", timeout=5) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, str(exc)
        except OSError as exc:
            return 0, str(exc)

    def leader(self) -> int | None:
        """Index of the raft leader now: only the leader serves /v2/stats/leader."""
        found = [i for i in range(3) if self.alive(i) and self._get(i, "/v2/stats/leader")[0]
                 == 200]
        return found[0] if len(found) == 1 else None

    def describe(self) -> str:
        return "; ".join(f"m{i} pid {self.pids[i]} alive={self.alive(i)} "
                         f"stats={self._get(i, '/v2/stats/self')}" for i in range(3))

    def kill(self, i: int) -> float:
        t = time.time()
        os.kill(self.pids[i], signal.SIGKILL)
        return t


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    require_etcd()
    ports = free_ports(6)
    cdir = tmp_path / "etcd"
    env = {**os.environ, "ETCD_CLIENT_PORTS": ",".join(map(str, ports[:3])),
           "ETCD_PEER_PORTS": ",".join(map(str, ports[3:]))}
    res = subprocess.run(["bash", str(ETCD_SCRIPT), "start", str(cdir)], env=env,
                         capture_output=True, text=True, timeout=60)
    pids = [int(p.read_text()) for p in sorted(cdir.glob("m*.pid"))] if cdir.exists() else []
    try:
        assert res.returncode == 0, f"etcd_cluster.sh start failed:\n{res.stdout}{res.stderr}"
        yield EtcdCluster(cdir, ports[:3], pids)
    finally:
        subprocess.run(["bash", str(ETCD_SCRIPT), "stop", str(cdir)], capture_output=True,
                       timeout=60)
        for pid in pids:  # whatever the script could not stop
            stop_pid(pid, grace=2)
