"""Real stores for the tests: free loopback ports, stopping a pid, and a real 3-member etcd
cluster started with ``scripts/etcd_cluster.sh``.

``etcd_cluster`` (for ``--rdzv-backend etcd-v2``: needs python-etcd) and ``etcd3_cluster``
(for the v3 adapter, ``ft_launcher.nodes.kv_etcd``: needs etcd3gw) start three members on
kernel-chosen loopback ports and stop every one by pid at teardown. Without the ``etcd``
binary or the client the etcd tests are skipped, except as root or with CI set (CI installs
Debian's etcd-server and the test extras): there they fail, saying so.

Used by ``tests/multinode/conftest.py`` (which re-exports them) and by tests at the top
level (``from store_fixtures import etcd3_cluster``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from launch_helpers import freeze, wait_for

ROOT = Path(__file__).resolve().parents[1]
ETCD_SCRIPT = ROOT / "scripts" / "etcd_cluster.sh"
# What each etcd client the tests use is, and how to install it.
ETCD_CLIENTS = {"etcd": "the python-etcd client (pip install 'ft-launcher[etcd-v2]')",
                "etcd3gw": "the etcd3gw client (pip install 'ft-launcher[etcd]')"}


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


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require_etcd(client: str = "etcd") -> None:
    """Skip (not root, not CI) or fail (root or CI: CI installs them) without the etcd server
    or ``client``, the module name of the Python client the test needs."""
    missing = []
    if not any((Path(p) / "etcd").exists() for p in os.environ.get("PATH", "").split(":")):
        missing.append("the etcd server (Debian: apt-get install -y etcd-server)")
    try:
        __import__(client)
    except ModuleNotFoundError:
        missing.append(ETCD_CLIENTS[client])
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

    def status(self, i: int) -> dict | str:
        """Member i's v3 status (``/v3/maintenance/status``), or why there is none."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.client_ports[i]}/v3/maintenance/status", data=b"{}",
            method="POST")
        try:
            with opener.open(req, timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"

    def leader(self) -> int | None:
        """Index of the raft leader now: the one live member whose own status says it is."""
        found = []
        for i in range(len(self.pids)):
            st = self.status(i) if self.alive(i) else None
            if isinstance(st, dict) and st.get("leader") and \
                    st["leader"] == st.get("header", {}).get("member_id"):
                found.append(i)
        return found[0] if len(found) == 1 else None

    def wait_leader(self, timeout: float = 30.0) -> int:
        """The leader's index once there is one (after an election, among the survivors)."""
        found = wait_for(lambda: (i := self.leader()) is not None and (i,), timeout,
                         f"an etcd leader ({self.describe()})")
        return found[0]

    def describe(self) -> str:
        return "; ".join(f"m{i} pid {self.pids[i]} alive={self.alive(i)} "
                         f"status={self.status(i) if self.alive(i) else '-'}"
                         for i in range(len(self.pids)))

    def kill(self, i: int) -> float:
        t = time.time()
        os.kill(self.pids[i], signal.SIGKILL)
        return t

    def kill_all(self) -> None:
        """SIGKILL every member: the whole cluster gone at once."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(self.alive(i) for i in range(len(self.pids))), 10,
                 "every etcd member to die")

    def freeze_all(self) -> None:
        """SIGSTOP every member (a frozen cluster: connections accepted by the kernel, no
        answer); teardown continues them before it stops them."""
        for pid in self.pids:
            freeze(pid)


@contextlib.contextmanager
def running_etcd(cdir: Path) -> Iterator[EtcdCluster]:
    """A 3-member cluster under ``cdir``, stopped by pid when the block ends."""
    ports = free_ports(6)
    env = {**os.environ, "ETCD_CLIENT_PORTS": ",".join(map(str, ports[:3])),
           "ETCD_PEER_PORTS": ",".join(map(str, ports[3:]))}
    res = subprocess.run(["bash", str(ETCD_SCRIPT), "start", str(cdir)], env=env,
                         capture_output=True, text=True, timeout=60)
    pids = [int(p.read_text()) for p in sorted(cdir.glob("m*.pid"))] if cdir.exists() else []
    try:
        assert res.returncode == 0, f"etcd_cluster.sh start failed:\n{res.stdout}{res.stderr}"
        yield EtcdCluster(cdir, ports[:3], pids)
    finally:
        for pid in pids:  # a frozen member answers no signal but SIGCONT and SIGKILL
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        subprocess.run(["bash", str(ETCD_SCRIPT), "stop", str(cdir)], capture_output=True,
                       timeout=60)
        for pid in pids:  # whatever the script could not stop
            stop_pid(pid, grace=2)


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A 3-member cluster for ``--rdzv-backend etcd-v2`` (torch's backend: python-etcd)."""
    require_etcd("etcd")
    with running_etcd(tmp_path / "etcd") as cluster:
        yield cluster


@pytest.fixture
def etcd3_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A 3-member cluster for the etcd v3 adapter (etcd3gw), its own for each test."""
    require_etcd("etcd3gw")
    with running_etcd(tmp_path / "etcd") as cluster:
        yield cluster
