"""Several launchers as nodes on loopback (c10d, one rank each), for the node-loss benches.

A ``Cluster`` starts one launcher per node (ours or torchrun, the same options), each in
its own session, all running one worker (``node_step_worker.py`` unless told: a gloo
barrier per step; ``node_light_worker.py`` imports no torch); it reads the workers' step lines,
says when a given world has formed, kills or freezes a whole node (the launcher and every
process under it), and stops every process it started by pid (``runner.Run``: SIGCONT,
SIGTERM, then SIGKILL of the launcher and every descendant it saw), also after failures.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import JsonlTail, Run, base_env  # noqa: E402

log = logging.getLogger("bench.nodes")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "node_step_worker.py"
LIGHT_WORKER = Path(__file__).resolve().parent / "node_light_worker.py"
LAUNCHERS = ("ours", "torchrun")
POLL_S = 0.05
TRACK_EVERY_S = 0.25  # how often the machine's process table is walked for new descendants


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def rdzv_options(nnodes: str, port: int, run_id: str, is_host: bool,
                 backend: str = "c10d") -> list[str]:
    """One node's torchrun-style rendezvous options on loopback. Each node says whether it
    hosts the store (``is_host``), as both c10d backends read it from ``--rdzv-conf``: on
    one machine every node matches the endpoint's host name, so it must be told. ``backend``:
    ``c10d`` is ours under ft_launcher and torch's under torchrun; ``torch-c10d`` is torch's
    under ft_launcher."""
    return ["--nnodes", nnodes, "--rdzv-backend", backend,
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={'true' if is_host else 'false'}"]


def node_tree(run: Run) -> list[psutil.Process]:
    """A node's launcher and every process under it now."""
    assert run.proc is not None
    try:
        top = psutil.Process(run.proc.pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_node(run: Run, sig: int) -> float:
    """Send ``sig`` to a node's launcher and every process under it now, tracking them all
    so the run's teardown ends them even with the launcher gone. Returns the wall time just
    before the first signal."""
    procs = node_tree(run)
    for p in procs:
        run._tracked.setdefault(p.pid, p)
    t = time.time()
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
    return t


def descendants(roots: list[int]) -> dict[int, list[psutil.Process]]:
    """Every process under each root pid now, from one walk of the process table (a walk
    per root costs as much as this one: 64 roots walked four times a second took a core)."""
    children: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter(["ppid"]):
        children.setdefault(p.info["ppid"], []).append(p)
    out = {}
    for root in roots:
        found, todo = [], list(children.get(root, []))
        while todo:
            p = todo.pop()
            found.append(p)
            todo.extend(children.get(p.pid, []))
        out[root] = found
    return out


def launcher_argv(kind: str, *, run_dir: Path, out: Path, port: int, nnodes: str,
                  run_id: str, is_host: bool, ours_extra: tuple[str, ...] = (),
                  backend: str = "c10d", worker: Path = WORKER) -> list[str]:
    """The same torchrun-style options for both launchers; ours adds its run directory and
    ``ours_extra``."""
    common = [*rdzv_options(nnodes, port, run_id, is_host, backend), "--nproc-per-node", "1",
              "--max-restarts", "5"]
    if kind == "ours":
        head = [sys.executable, "-m", "ft_launcher.cli", "--ft-run-dir", str(run_dir),
                *ours_extra]
    elif kind == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run"]
    else:
        raise ValueError(f"unknown launcher {kind!r}: one of {', '.join(LAUNCHERS)}")
    return [*head, *common, str(worker), str(out)]


@dataclass
class Cluster:
    """Nodes of one job: launchers of one kind on loopback, one shared store port."""

    kind: str
    base: Path
    nnodes: str
    run_id: str
    ours_extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    backend: str = "c10d"
    worker: Path = WORKER
    poll_s: float = POLL_S  # how often ``wait`` reads the files (records carry the times)
    port: int = field(default_factory=free_port)
    runs: dict[str, Run] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    # (node, pid) -> the first step line of that worker: a worker's world never changes
    first: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    _tail: JsonlTail | None = None
    _last_track: float = 0.0

    @property
    def out(self) -> Path:
        return self.base / "out"

    def start(self, name: str, is_host: bool = False) -> Run:
        self.out.mkdir(parents=True, exist_ok=True)
        if self._tail is None:
            self._tail = JsonlTail(self.out / "steps.jsonl")
        workdir = self.base / name
        argv = launcher_argv(self.kind, run_dir=workdir / "ft", out=self.out, port=self.port,
                             nnodes=self.nnodes, run_id=self.run_id, is_host=is_host,
                             ours_extra=self.ours_extra, backend=self.backend,
                             worker=self.worker)
        env = {**base_env(workdir), **self.env, "NODE_NAME": name,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        run = Run(name, argv, workdir, env, track_every_s=math.inf)  # see track()
        self.runs[name] = run
        run.start()
        return run

    def start_host_first(self, names: list[str], timeout: float) -> None:
        """The first node hosts the store; the others start once it listens."""
        host = self.start(names[0], is_host=True)
        exited = lambda: host.proc is not None and host.proc.poll() is not None  # noqa: E731
        if not self.wait(lambda: listening(self.port) or exited(), timeout) or exited():
            code = host.proc.poll() if host.proc is not None else None
            tail = host.log_path.read_text(errors="replace")[-600:] \
                if host.log_path.exists() else ""
            raise TimeoutError(f"{names[0]} did not open the store on {self.port} within "
                               f"{timeout:.0f} s (exit code {code}); its log ends: {tail!r}")
        for name in names[1:]:
            self.start(name)

    # -- reading -----------------------------------------------------------------------

    def refresh(self) -> None:
        for run in self.runs.values():
            run.refresh()
        if time.monotonic() - self._last_track >= TRACK_EVERY_S:
            self.track()
        if self._tail is None:
            return
        for rec in self._tail.read():
            if not isinstance(rec, dict) or not {"t", "node", "pid", "world"} <= rec.keys():
                continue
            self.steps.append(rec)
            self.first.setdefault((rec["node"], rec["pid"]), rec)

    def track(self) -> None:
        """Every process under each live launcher, remembered by its run (to be ended by
        pid at ``stop``), from one walk of the process table for all nodes."""
        self._last_track = time.monotonic()
        live = {r.proc.pid: r for r in self.runs.values()
                if r.proc is not None and r.exit_code is None}
        for pid, procs in descendants(list(live)).items():
            live[pid].track(procs)

    def wait(self, cond: Callable[[], Any], timeout: float) -> Any:
        """Refresh until ``cond()`` is truthy (its value) or ``timeout`` passes (None)."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            value = cond()
            if value or time.monotonic() >= deadline:
                return value or None
            time.sleep(self.poll_s)

    def world_formed(self, world: int, nodes: set[str], after: float = 0.0) -> float | None:
        """When every node of ``nodes`` has logged a step in a world of ``world`` ranks
        from a worker started after ``after``: the latest of their first such steps."""
        best: dict[str, float] = {}
        for (node, _), rec in self.first.items():
            if node in nodes and rec["world"] == world and rec.get("wstart", 0) > after:
                best[node] = min(best.get(node, rec["t"]), rec["t"])
        return max(best.values()) if set(best) == nodes else None

    def steps_since(self, node: str, t: float) -> int:
        return sum(1 for s in self.steps if s["node"] == node and s["t"] >= t)

    def exited(self, name: str) -> int | None:
        run = self.runs[name]
        run.refresh()
        return run.exit_code

    def connected_to_store(self, name: str) -> bool:
        """The node's launcher holds a TCP connection to the store (it has joined)."""
        proc = self.runs[name].proc
        try:
            conns = psutil.Process(proc.pid).net_connections(kind="tcp") if proc else []
        except psutil.Error:
            return False
        return any(c.raddr and c.raddr.port == self.port for c in conns)

    def node_processes(self, name: str) -> list[psutil.Process]:
        """The node's launcher and every process under it now."""
        return node_tree(self.runs[name])

    # -- faults ------------------------------------------------------------------------

    def lose_node(self, name: str, how: str) -> float:
        """``kill``: SIGKILL the launcher and everything under it (a node that dies);
        ``freeze``: SIGSTOP them all (a node that stops answering). Returns the wall time
        just before the first signal."""
        sig = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}[how]
        return signal_node(self.runs[name], sig)

    # -- teardown ----------------------------------------------------------------------

    def stop(self) -> None:
        """Every process of every node, by pid: SIGCONT and SIGTERM to all at once (so
        17 launchers do not each wait out their grace in turn), then ``Run.stop``."""
        try:
            self.track()  # the workers started since the last walk
        except psutil.Error:
            pass
        for run in self.runs.values():
            try:
                run.refresh()
            except Exception:  # a half-started run: Run.stop still ends what it has
                pass
            for p in run._alive():
                try:
                    p.send_signal(signal.SIGCONT)
                except psutil.Error:
                    pass
            if run.proc is not None and run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(
                r.proc is not None and r.proc.poll() is None for r in self.runs.values()):
            time.sleep(0.1)
        for run in self.runs.values():
            run.stop()

    def leftovers(self) -> list[int]:
        return [pid for run in self.runs.values() for pid in run.leftovers()]

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
