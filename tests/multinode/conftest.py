"""Several nodes on loopback: launchers as nodes, and a real 3-member etcd cluster.

``Nodes`` starts ft_launcher processes (one per "node", ``--nproc-per-node 1``) running
``node_worker.py``, and stops every one of them by pid at teardown. ``etcd_cluster``
starts three etcd members with ``scripts/etcd_cluster.sh`` on kernel-chosen loopback ports
and stops them by pid; it, ``free_ports`` and ``stop_pid`` live in ``tests/store_fixtures.py``
(tests outside this folder use them too) and are re-exported here. Without the ``etcd``
binary the etcd tests are skipped, except as root or with CI set (CI installs Debian's
etcd-server): there they fail, saying so.

This folder is a package (``__init__.py``): a second top-level module named ``conftest``
would shadow ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from launch_helpers import TORCH_PRELOAD, wait_for
from store_fixtures import (  # noqa: F401 - re-exported: this folder's tests import them here
    EtcdCluster,
    etcd3_cluster,
    etcd_cluster,
    free_ports,
    require_etcd,
    stop_pid,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "node_worker.py"
LAUNCHER = [sys.executable, "-m", "ft_launcher.cli"]


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
