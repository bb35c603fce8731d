"""The snapshot soak on two launchers on loopback, with a spare: node faults as well as
rank faults (``snapshot_soak.py --nodes 2``).

The c10d store and the coordinator live in their own process
(``scripts/slurm/rdzv_store.py``, every launcher
``is_host=false``), so any launcher can be lost without ending the job. Two launchers form
the world (``--nnodes 2:2``, one rank each) and a third waits as a hot spare; every rank
snapshots after each step and each launcher pushes its rank's copy to the other node
(``--ft-snapshot-replicas 1``). Node faults:

- ``freeze``: SIGSTOP of a world launcher and every process under it (the launcher first).
  Once the spare has been admitted and the world trains again, the node is thawed (its
  processes first, the launcher half a second later): it finds itself dropped and waits as
  the new spare.
- ``node_kill``: SIGKILL of a world launcher alone (its guardian ends its rank). Once the
  world trains again, a launcher is started again in the same run directory, as a node
  that rebooted: it removes the snapshot area its predecessor left in /dev/shm and waits as
  the new spare.

Every process is ended by pid at the end, also after a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from soak_faults import JobState, node_role

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "scripts" / "slurm" / "rdzv_store.py"
LAUNCHER = [sys.executable, "-m", "ft_launcher.cli"]
RECOVERY_LIMIT_S = 120.0  # a frozen node is thawed, a killed one restarted, after this at most


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EventTail:
    """The complete records appended to an events.jsonl since the last read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.records = path, 0, []

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.records
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("event"), str):
                self.records.append(rec)
        return self.records


def ranks_of(launcher: psutil.Process, train: Path) -> list[psutil.Process]:
    """The launcher's processes that run ``train`` (a warm worker's command line is the
    cold one's; a stopped one is a fault already injected)."""
    found = []
    for p in launcher.children(recursive=True):
        try:
            if str(train) in " ".join(p.cmdline()) and p.status() not in (
                    psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
                found.append(p)
        except psutil.Error:
            continue
    return found


@dataclass
class Node:
    """One launcher (a node); a node restarted after a SIGKILL keeps its name and run dir."""

    name: str
    run_dir: Path
    proc: subprocess.Popen
    events: EventTail
    started: float = field(default_factory=time.time)
    killed: bool = False  # SIGKILLed by the soak: its exit code is not checked
    frozen: list[psutil.Process] = field(default_factory=list)

    def role(self) -> str:
        if self.proc.poll() is not None:
            return "gone"
        return node_role(e["event"] for e in self.events.read()
                         if e.get("ts", 0) >= self.started - 1)


@dataclass
class Recovery:
    """A node fault's aftermath: thaw or restart ``node`` once the world trains again."""

    node: Node
    kind: str
    since: float


class NodeCluster:
    """The store, the launchers, and the node faults; ``args`` as snapshot_soak's."""

    def __init__(self, base: Path, train: list[str], args: Any) -> None:
        self.base, self.train, self.args = base, train, args
        self.run_id = f"soak{os.getpid()}x{time.monotonic_ns() % 10**6}"
        self.port = free_port()
        self.nodes: list[Node] = []  # every launcher started, restarted ones too
        self.store: subprocess.Popen | None = None
        self.recovery: Recovery | None = None

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> None:
        ready = self.base / "store.ready"
        self.base.mkdir(parents=True, exist_ok=True)
        self.store = subprocess.Popen([sys.executable, str(STORE), str(self.port), str(ready),
                                       "2:2", self.run_id], start_new_session=True)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.store.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rendezvous store did not start on {self.port}")
            time.sleep(0.1)
        self.launch("n0")
        self.launch("n1")
        self._wait(lambda: [n.role() for n in self.live()] == ["world", "world"], 180,
                   "n0 and n1 to form the world")
        self.launch("n2")

    def launch(self, name: str) -> Node:
        run_dir = self.base / name
        flags = ["--ft-run-dir", str(run_dir), "--nnodes", "2:2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                 "--rdzv-id", self.run_id, "--rdzv-conf", "is_host=false",
                 "--max-restarts", "1000", "--workers-stop-timeout", "5",
                 "--ft-rank-heartbeat-timeout", str(self.args.heartbeat_timeout),
                 "--ft-initial-rank-heartbeat-timeout", "120",
                 "--ft-snapshot-every", "1", "--ft-snapshot-replicas", "1"]
        log = open(self.base / f"{name}.out", "a")  # noqa: SIM115 - the child's
        proc = subprocess.Popen([*LAUNCHER, *flags, *self.train], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        log.close()
        node = Node(name, run_dir, proc, EventTail(run_dir / "events.jsonl"))
        self.nodes.append(node)
        return node

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def running(self) -> bool:
        return bool(self.live())

    def close(self) -> None:
        """Every launcher still there, then the store: SIGCONT, SIGTERM, SIGKILL by pid."""
        for node in self.nodes:
            _thaw(node.frozen)
        for node in self.live():
            _end(node.proc, 30)
        if self.store is not None:
            _end(self.store, 10)

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.2)

    # -- what the job looks like now -----------------------------------------------------

    def ranks(self, node: Node, train: Path) -> list[psutil.Process]:
        try:
            return ranks_of(psutil.Process(node.proc.pid), train)
        except psutil.Error:
            return []

    def world(self) -> list[Node]:
        return [n for n in self.live() if not n.frozen and n.role() == "world"]

    def state(self, train: Path) -> JobState:
        world = self.world()
        spares = [n for n in self.live() if not n.frozen and n.role() == "spare"]
        return JobState(ranks_running=sum(len(self.ranks(n, train)) for n in world),
                        world_size=2, world_nodes=len(world), spares=len(spares),
                        recovering=self.recovery is not None)

    # -- node faults ---------------------------------------------------------------------

    def inject_node(self, kind: str, victim: Node) -> dict[str, Any]:
        t = time.time()
        if kind == "freeze":
            victim.frozen = _freeze(victim.proc.pid)
        else:
            victim.killed = True
            victim.proc.send_signal(signal.SIGKILL)
        self.recovery = Recovery(victim, kind, time.monotonic())
        return {"t": t, "kind": kind, "node": victim.name, "pid": victim.proc.pid}

    def recover(self, train: Path) -> dict[str, Any] | None:
        """Thaw the frozen node, or start the killed one again, once the world trains
        again without it (or after RECOVERY_LIMIT_S); what was done, or None."""
        rec = self.recovery
        if rec is None:
            return None
        whole = self.state(train)
        healed = whole.ranks_running == 2 and whole.world_nodes == 2
        if not healed and time.monotonic() - rec.since < RECOVERY_LIMIT_S:
            return None
        self.recovery = None
        if rec.kind == "freeze":
            _thaw(rec.node.frozen[1:])  # its workers first, as on a real node's resume
            time.sleep(0.5)
            _thaw(rec.node.frozen[:1])
            rec.node.frozen = []
        else:
            rec.node.proc.wait(30)
            self.launch(rec.node.name)
        return {"t": time.time(), "node": rec.node.name, "healed": healed,
                "action": "thawed" if rec.kind == "freeze" else "restarted"}

    # -- the end -------------------------------------------------------------------------

    def exit_codes(self) -> list[dict[str, Any]]:
        return [{"node": n.name, "pid": n.proc.pid, "exit_code": n.proc.poll(),
                 "killed_by_soak": n.killed} for n in self.nodes]

    def records(self, name: str) -> list[dict[str, Any]]:
        node = next(n for n in reversed(self.nodes) if n.name == name)
        return node.events.read()

    def shm_left(self) -> list[str]:
        return [str(p) for p in Path("/dev/shm").glob(
            f"ft_snapshots-{os.geteuid()}-{self.run_id}-*")]


def _freeze(pid: int) -> list[psutil.Process]:
    """SIGSTOP a launcher, then every process under it; returns them, launcher first."""
    procs: list[psutil.Process] = []
    try:
        top = psutil.Process(pid)
        top.suspend()
        procs.append(top)
        below = top.children(recursive=True)
    except psutil.Error:
        return procs
    for p in below:
        try:
            p.suspend()
            procs.append(p)
        except psutil.Error:
            continue
    return procs


def _thaw(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.resume()
        except psutil.Error:
            pass


def _end(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    except ProcessLookupError:
        pass
