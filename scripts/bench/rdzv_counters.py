"""What ``rdzv_scale.py`` reads from the machine, and the store a job meets at.

- Wire bytes: the kernel's ``bytes_sent`` + ``bytes_received`` (tcp_info, read with
  ``ss -ti``) of every established server-side socket of a store's port: what the store
  received and sent, both directions, payload only.
- CPU: utime + stime of a process (``/proc/PID/stat``), and of each thread of the store
  host's process (``/proc/PID/task/TID/stat``).
- The backing store of a job (``backing``): a port for a c10d store that node 0 will host,
  or a 3-member etcd cluster on loopback (``scripts/etcd_cluster.sh``), stopped by pid.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ETCD_SCRIPT = REPO / "scripts" / "etcd_cluster.sh"
CLK_TCK = os.sysconf("SC_CLK_TCK")
_BYTES = re.compile(r"bytes_(sent|received):(\d+)")


def wire_bytes(port: int) -> int:
    """Bytes the sockets of the store listening on ``port`` sent and received so far."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(m.group(2)) for m in _BYTES.finditer(out))


def cpu_ticks(path: str) -> int:
    """utime + stime of a process or thread (``/proc/.../stat``), in clock ticks; 0 when
    it is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return 0
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def process_ticks(pid: int) -> int:
    return cpu_ticks(f"/proc/{pid}/stat")


def thread_ticks(pid: int) -> dict[str, int]:
    """Each thread's CPU ticks, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        out[task.name] = cpu_ticks(f"/proc/{pid}/task/{task.name}/stat")
    return out


def pct(ticks: int, seconds: float) -> float:
    """Clock ticks over ``seconds`` as % of one core."""
    return round(100.0 * ticks / CLK_TCK / seconds, 2)


def machine_busy_pct(seconds: float) -> float:
    """How busy the whole machine was over the next ``seconds``: 100 % minus its idle and
    I/O-wait share of every CPU (``/proc/stat``)."""
    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]

    total0, idle0 = read()
    time.sleep(seconds)
    total1, idle1 = read()
    return round(100.0 * (1 - (idle1 - idle0) / max(1, total1 - total0)), 1)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (held open together, then closed)."""
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


@dataclass
class Backing:
    """Where a job's nodes meet: the endpoint they are given, the store ports whose bytes
    count (``store``: the round store; with etcd also each member's client port) and the
    processes whose CPU counts beside the store host's (etcd's members)."""

    endpoint: str
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def backing(backend: str, workdir: Path) -> Iterator[Backing]:
    """The store for one job of ``backend``; etcd members are stopped when it ends."""
    if backend != "etcd":
        port = free_ports(1)[0]
        yield Backing(f"127.0.0.1:{port}", {"store": port})
        return
    with etcd_cluster(workdir / "etcd") as (ports, pids):
        yield Backing(",".join(f"127.0.0.1:{p}" for p in ports),
                      {f"etcd m{i}": p for i, p in enumerate(ports)},
                      {f"etcd m{i}": p for i, p in enumerate(pids)})


@contextlib.contextmanager
def etcd_cluster(cdir: Path) -> Iterator[tuple[list[int], list[int]]]:
    """Three etcd members on loopback: (client ports, pids); each stopped by its pid."""
    ports = free_ports(6)
    env = {**os.environ, "ETCD_CLIENT_PORTS": ",".join(map(str, ports[:3])),
           "ETCD_PEER_PORTS": ",".join(map(str, ports[3:]))}
    res = subprocess.run(["bash", str(ETCD_SCRIPT), "start", str(cdir)], env=env,
                         capture_output=True, text=True, timeout=120)
    pids = [int(p.read_text()) for p in sorted(cdir.glob("m*.pid"))] if cdir.exists() else []
    try:
        if res.returncode != 0:
            raise RuntimeError(f"etcd_cluster.sh start failed: {res.stdout}{res.stderr}")
        yield ports[:3], pids
    finally:
        subprocess.run(["bash", str(ETCD_SCRIPT), "stop", str(cdir)], capture_output=True,
                       timeout=60)
        for pid in pids:  # whatever the script could not stop (it checks the name first)
            if _is_etcd(pid):
                os.kill(pid, signal.SIGKILL)


def _is_etcd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "etcd"
    except OSError:
        return False
