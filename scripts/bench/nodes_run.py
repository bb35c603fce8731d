"""One benchmark job as several launchers on loopback, read and driven like one ``Run``.

Every node is a launcher with the same options but its own directory (its own run
directory, its own events file); the first hosts the c10d store, the others start once it
listens, and a spare starts once the world has trained (every rank logged a step). The
records of every node's workers are merged in time order, so the goodput measures read
``first_steps``, ``pid_of`` and ``events`` as they do for one launcher.

The job has ended when every node that ran a worker and was not lost has exited (a spare
that was never needed is then stopped by the driver); its exit code is the first non-zero
one of those, else 0. A lost node's launcher cannot remove its snapshot area from shared
memory; the driver does, as the node's reboot would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loopback_nodes import free_port, listening, rdzv_options, signal_node
from runner import POLL_S, Run, base_env

from ft_launcher.snapshots.area import PREFIX, SHM

STORE_BOUND_S = 60.0  # the host's launcher start -> its store listening
HOST = "n0"  # the node whose launcher hosts the c10d store


@dataclass
class NodesRun(Run):
    """``nodes`` launchers and a spare; ``argv_for(workdir, rdzv)`` is one node's command."""

    argv_for: Callable[[Path, list[str]], list[str]] | None = None
    nodes: int = 2
    world: int = 2  # ranks in the job (every node's together)
    port: int = field(default_factory=free_port)
    members: dict[str, Run] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)

    def _start_node(self, name: str, is_host: bool) -> Run:
        assert self.argv_for is not None
        workdir = self.workdir / name
        nnodes = f"{self.nodes}:{self.nodes}"  # a fixed world; the spare waits
        argv = self.argv_for(workdir, rdzv_options(nnodes, self.port, self.name, is_host))
        node = Run(name=f"{self.name}/{name}", argv=argv, workdir=workdir,
                   env=base_env(workdir))
        self.members[name] = node
        node.start()
        return node

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.t_start = time.time()
        host = self._start_node(HOST, is_host=True)
        deadline = time.monotonic() + STORE_BOUND_S
        while not listening(self.port):
            host.refresh()
            if host.exit_code is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{host.name} did not open the store on {self.port} "
                                   f"(exit code {host.exit_code}); see {host.log_path}")
            time.sleep(POLL_S)
        for i in range(1, self.nodes):
            self._start_node(f"n{i}", is_host=False)

    def refresh(self) -> None:
        """Read every node's records; start the spare once the first world trains; say the
        job ended once every node that ran a worker and was not lost has exited."""
        for node in self.members.values():
            node.refresh()
        self.records = sorted((r for node in self.members.values() for r in node.records),
                              key=lambda r: r.get("t", 0.0))
        if "spare" not in self.members and len(self.first_steps()) >= self.world:
            self._start_node("spare", is_host=False)
        if self.exit_code is None:
            self._note_end()

    def _note_end(self) -> None:
        kept = [n for name, n in self.members.items() if name not in self.lost]
        ran = [n for n in kept if n.events("pid")]
        ended = ran if ran and all(n.exit_code is not None for n in ran) else \
            kept if all(n.exit_code is not None for n in kept) else None
        if ended:
            codes = [n.exit_code for n in ended]
            self.exit_code = next((c for c in codes if c), 0)
            self.t_exit = max(n.t_exit or 0.0 for n in ended)

    def node_of(self, pid: int) -> str | None:
        return next((name for name, n in self.members.items() if pid in n.worker_pids()),
                    None)

    def pid_off_host(self) -> int:
        """The newest worker of a rank whose node does not host the store."""
        for rank in range(self.world):
            pid = self.pid_of(rank)
            if self.node_of(pid) not in (None, HOST):
                return pid
        raise LookupError(f"{self.name}: no rank runs on a node other than the host")

    def signal_worker(self, pid: int, signum: int) -> float:
        name = self.node_of(pid)
        if name is None:
            return time.time()
        return self.members[name].signal_worker(pid, signum)

    def lose_node(self, pid: int) -> float:
        """SIGKILL the node running worker ``pid``: its launcher and every process under
        it (a node that dies). Returns the wall time just before the first signal."""
        name = self.node_of(pid)
        assert name is not None, f"{self.name}: no node runs pid {pid}"
        self.lost.add(name)
        return signal_node(self.members[name], signal.SIGKILL)

    def stop(self) -> None:
        for node in self.members.values():
            node.stop()
        for name in self.lost:
            remove_snapshot_area(self.members[name].workdir)

    def leftovers(self) -> list[int]:
        return [pid for node in self.members.values() for pid in node.leftovers()]


def remove_snapshot_area(node_dir: Path, shm: Path = SHM) -> list[Path]:
    """Remove the snapshot areas that ours' launcher in ``node_dir`` announced
    (``snapshots_ready``) and, SIGKILLed, could not remove; only a directory right under
    ``shm`` named as the launcher names this user's. Returns what was removed."""
    try:
        lines = (node_dir / "ft_run" / "events.jsonl").read_text().splitlines()
    except OSError:
        return []  # not ours, or it never started
    removed = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("event") != "snapshots_ready":
            continue
        path = Path(str(rec.get("path")))
        if path.parent == shm and path.name.startswith(f"{PREFIX}-{os.getuid()}-") \
                and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
