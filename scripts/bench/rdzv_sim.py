"""One process of simulated nodes for ``rdzv_scale.py``: the real rendezvous classes of each
backend, no workers.

    python scripts/bench/rdzv_sim.py JOB_JSON FIRST COUNT

runs nodes FIRST .. FIRST+COUNT-1 of the job described by JOB_JSON (a ``JobSpec``); node 0
hosts the job's store (``is_host=true``). It reads one JSON command a line on stdin and
answers one JSON line on stdout (``COMMANDS``); everything else it prints goes to stderr.

Each simulated node runs what a launcher runs around its rendezvous, in a thread of its
own: ``next_round()``, then a watch loop that calls ``poll_round()`` every
``--monitor-interval`` (the launcher's default 0.1 s) until it reports news (nodes lost or
waiting, this node dropped, a next round opened), then ``next_round()`` again, as the
supervisor does when a cycle ends with the peers changed. The backend's own threads keep
the node alive (our ``Pulse``; torch's keep-alive timer). A fault is applied by the driver:
``kill`` / ``freeze`` stop a node's keep-alive and its loop without leaving (the two differ
only in what the driver asks of the others), ``fail`` makes a node re-join at once, as a
launcher does when its workers fail through the data plane.

A backend is one function that makes a node (``BACKENDS``): ``c10d`` (``C10dPlace`` +
``RoundRendezvous``), ``etcd`` (``EtcdPlace`` + ``RoundRendezvous``: etcd holds the job's
facts and the election, the rounds run on the elected coordinator's c10d store) and
``torch-c10d`` (``DynamicRendezvous``, torch's ``DynamicRendezvousHandler``). Times are
``time.monotonic()``: one clock for every process of the machine.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

MAKERS = 32  # threads that make a process's nodes
# A launcher is a process of a few threads; here a process holds 64 nodes' threads, which
# all want the interpreter lock as their store calls return. A thread waiting for it wakes
# every switch interval (5 ms by default) to ask for it: at 1,000 nodes joining at once,
# 70 % of the machine went to those wake-ups in the kernel (perf) and the store's thread
# starved. A longer interval only makes a thread that computes yield later; every store
# call still releases the lock.
SWITCH_INTERVAL_S = 0.05
# A launcher's heap holds one membership; a process of 64 simulated nodes holds 64 (64,000
# records at 1,000 nodes), and the collector's full passes over them took a fifth of the
# machine (perf) while rounds re-formed. Collections run less often; nothing else changes.
GC_THRESHOLDS = (50_000, 20, 20)
LAG_TICK_S, LAG_LOG_S = 0.1, 0.25  # the lag probe's sleep, and the lateness it logs


@dataclass(frozen=True)
class JobSpec:
    """One simulated job: its backend, where its store is, its size and timings."""

    backend: str
    endpoint: str  # host:port of the store node 0 hosts (etcd: the members)
    run_id: str
    min_nodes: int
    max_nodes: int
    conf: dict[str, str] = field(default_factory=dict)  # --rdzv-conf (timings)
    monitor_interval: float = 0.1

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls(**json.loads(text))


class EventLog:
    """What the nodes of this process did, in order, for the driver to collect."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []

    def add(self, node: int, kind: str, **fields: Any) -> float:
        t = time.monotonic()
        with self._lock:
            self._events.append({"node": node, "kind": kind, "t": t, **fields})
        return t

    def since(self, cursor: int) -> list[dict[str, Any]]:
        with self._lock:
            return self._events[cursor:]


class BackendNode(Protocol):
    """A node of one backend: its rendezvous, how to stop its keep-alive abruptly, and the
    requests and bytes it sent to the store (counted client-side)."""

    rdzv: Any

    def stop_keep_alive(self) -> None: ...
    def traffic(self) -> tuple[int, int]: ...
    def coordinator_traffic(self) -> tuple[int, int]: ...
    def hosted_port(self) -> int | None: ...


# -- backends -------------------------------------------------------------------------------


class OursNode:
    """``--rdzv-backend c10d`` (``C10dPlace``) and ``etcd`` (``EtcdPlace``): the launcher's
    own rendezvous. With etcd, node 0 is made first and so is elected: it hosts the round
    store and coordinates."""

    def __init__(self, job: JobSpec, index: int, events: Callable[..., Any]) -> None:
        from ft_launcher.nodes.member import RoundRendezvous, node_id
        from ft_launcher.nodes.rendezvous import RendezvousTimings

        timings, _ = RendezvousTimings.from_conf(job.conf)
        host = f"sim{index}"
        me = node_id(host)
        place = self._place(job, timings, index, me)
        self.rdzv = RoundRendezvous(place, job.run_id, job.min_nodes, job.max_nodes, timings,
                                    None, "127.0.0.1", host, events, me=me)

    @staticmethod
    def _place(job: JobSpec, timings: Any, index: int, me: str) -> Any:
        if job.backend == "etcd":
            from ft_launcher.nodes.etcd_place import EtcdPlace

            return EtcdPlace(job.endpoint, job.run_id, timings, job.min_nodes, job.max_nodes,
                             {}, me, "127.0.0.1")
        from ft_launcher.nodes.place import C10dPlace

        return C10dPlace(job.endpoint, job.run_id, timings, job.min_nodes, job.max_nodes,
                         {"is_host": "true" if index == 0 else "false"}, me)

    def stop_keep_alive(self) -> None:
        self.rdzv.pulse.stop()  # sets its stop flag first: no keep-alive after this call

    def _counters(self) -> list[Any]:
        """Every client of this node that counts its requests: the main thread's and the
        pulse's, the coordinator's where it runs, etcd's with etcd."""
        place = self.rdzv.place
        kvs = [place.main, self.rdzv.pulse.kv]
        if place.coordinator is not None:
            kvs.append(place.coordinator.kv)
        if getattr(place, "etcd", None) is not None:
            kvs.append(place.etcd)
        return kvs

    def traffic(self) -> tuple[int, int]:
        kvs = self._counters()
        return sum(kv.requests for kv in kvs), sum(kv.bytes for kv in kvs)

    def coordinator_traffic(self) -> tuple[int, int]:
        """The coordinator's own requests and bytes (part of ``traffic``), where it runs."""
        loop = self.rdzv.place.coordinator
        return (0, 0) if loop is None else (loop.kv.requests, loop.kv.bytes)

    def hosted_port(self) -> int | None:
        server = self.rdzv.place.server
        return None if server is None else int(server.port)


class TorchNode:
    """``--rdzv-backend torch-c10d``: torch's ``DynamicRendezvousHandler``, same timings.
    Its requests are counted where torch's handler reaches the store (the c10d backend's
    ``_call_store``: the state's get and compare-and-set)."""

    def __init__(self, job: JobSpec, index: int, events: Callable[..., Any]) -> None:
        from ft_launcher.nodes.torch_rendezvous import DynamicRendezvous

        conf = {**job.conf, "is_host": "true" if index == 0 else "false"}
        self.rdzv = DynamicRendezvous(job.endpoint, job.run_id, job.min_nodes, job.max_nodes,
                                      conf, None, "torch-c10d", events, "127.0.0.1")
        self.requests = self.bytes = 0
        self._count_store_calls(self.rdzv.handler._state_holder._backend)

    def _count_store_calls(self, backend: Any) -> None:
        original = backend._call_store

        def counted(op: str, *args: Any, **kwargs: Any) -> Any:
            result = original(op, *args, **kwargs)
            self.requests += 1
            self.bytes += sum(len(x) for x in (*args, result) if isinstance(x, str | bytes))
            return result

        backend._call_store = counted

    def stop_keep_alive(self) -> None:
        self.rdzv.handler._stop_heartbeats()

    def traffic(self) -> tuple[int, int]:
        return self.requests, self.bytes

    def coordinator_traffic(self) -> tuple[int, int]:
        return 0, 0  # torch's handler has no coordinator: every node writes the state

    def hosted_port(self) -> int | None:
        return int(self.rdzv.job_store.port)  # torch's TCPStore, the one its nodes share


BACKENDS: dict[str, Callable[[JobSpec, int, Callable[..., Any]], BackendNode]] = {
    "c10d": OursNode,
    "torch-c10d": TorchNode,
    "etcd": OursNode,
}


# -- a simulated node -----------------------------------------------------------------------


def _news(view: Any) -> dict[str, Any] | None:
    """What ``poll_round()``'s view reports, or None when nothing changed."""
    if not (view.dropped or view.waiting or view.lost or view.why):
        return None
    return {"why": view.why, "lost": list(view.lost), "waiting": view.waiting,
            "dropped": view.dropped}


class SimNode:
    """One simulated launcher: the round loop in a thread, faults applied from outside."""

    def __init__(self, index: int, job: JobSpec, log: EventLog) -> None:
        self.index, self.job, self.log = index, job, log
        self.node = BACKENDS[job.backend](job, index, self._event)
        self.name = str(self.node.rdzv.node_name)
        self.halted = threading.Event()  # killed or frozen: the loop ends, sends nothing
        self.failed = threading.Event()  # its workers failed: re-join now
        self.watching = False  # in a round, its workers (were they real) running
        self.wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sim-node-{index}",
                                        daemon=True)

    def _event(self, name: str, **fields: Any) -> None:
        self.log.add(self.index, name, **fields)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.halted.is_set():
            self.log.add(self.index, "join")
            try:
                rnd = self.node.rdzv.next_round()
            except Exception as exc:  # noqa: BLE001 - every failure is a figure to record
                self.log.add(self.index, "error", text=f"{type(exc).__name__}: {exc}"[:300])
                return
            self.log.add(self.index, "round", round=rnd.round, world=rnd.group_world_size,
                         rank=rnd.group_rank)
            if not self._watch():
                return

    def _watch(self) -> bool:
        """Poll until news (True: re-join) or a halt (False)."""
        self.watching = True
        try:
            return self._poll()
        finally:
            self.watching = False

    def _poll(self) -> bool:
        while True:
            self.wake.clear()
            if self.halted.is_set():
                return False
            if self.failed.is_set():
                self.failed.clear()
                return True
            try:
                news = _news(self.node.rdzv.poll_round())
            except Exception as exc:  # noqa: BLE001
                self.log.add(self.index, "error", text=f"{type(exc).__name__}: {exc}"[:300])
                return False
            if news is not None:
                self.log.add(self.index, "news", **news)
                if news["dropped"]:
                    self.node.rdzv.mark_dropped()
                return True
            self.wake.wait(self.job.monitor_interval)

    def halt(self, kind: str) -> float:
        """Stop the keep-alive and the loop without leaving; the time it stopped."""
        self.halted.set()
        t = self.log.add(self.index, kind)
        self.node.stop_keep_alive()
        self.wake.set()
        return t

    def fail(self) -> float | None:
        """Its workers fail (the data plane broke): it re-joins now. A node in no round
        (joining, or waiting as a spare) has no workers to fail."""
        if not self.watching or self.halted.is_set():
            return None
        t = self.log.add(self.index, "fail")
        self.failed.set()
        self.wake.set()
        return t


# -- the process ----------------------------------------------------------------------------


class LagProbe:
    """How late this process's threads run: a thread that sleeps ``LAG_TICK_S`` and logs
    a ``lag`` event (node -1) whenever it woke more than ``LAG_LOG_S`` late. A simulated
    node's keep-alive runs in a thread of the same process: a lag of 2 s is a keep-alive
    the machine (not the rendezvous) held back past the others' expiry."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        threading.Thread(target=self._run, name="sim-lag-probe", daemon=True).start()

    def _run(self) -> None:
        while True:
            t = time.monotonic()
            time.sleep(LAG_TICK_S)
            late = time.monotonic() - t - LAG_TICK_S
            if late > LAG_LOG_S:
                self.log.add(-1, "lag", s=round(late, 3))


class Process:
    """This process's nodes and the commands the driver sends."""

    def __init__(self, job: JobSpec, first: int, count: int) -> None:
        self.job, self.first, self.count = job, first, count
        self.log = EventLog()
        self.nodes: dict[int, SimNode] = {}
        LagProbe(self.log)

    def make(self) -> dict[str, Any]:
        """Make this process's nodes, several at a time (each c10d connection looks its
        peer's address up, see ``rdzv_scale.SIM_ENV``); not part of any figure."""
        t0 = time.monotonic()
        indexes = range(self.first, self.first + self.count)
        with ThreadPoolExecutor(MAKERS) as pool:
            for node in pool.map(lambda i: SimNode(i, self.job, self.log), indexes):
                self.nodes[node.index] = node
        return {"names": {i: n.name for i, n in self.nodes.items()},
                "make_s": round(time.monotonic() - t0, 3)}

    def join(self) -> dict[str, Any]:
        for node in self.nodes.values():
            node.start()
        return {}

    def events(self, cursor: int) -> dict[str, Any]:
        return {"events": self.log.since(cursor)}

    def traffic(self) -> dict[str, Any]:
        totals = [n.node.traffic() for n in self.nodes.values()]
        coord = [n.node.coordinator_traffic() for n in self.nodes.values()]
        return {"requests": sum(t[0] for t in totals), "bytes": sum(t[1] for t in totals),
                "coordinator_requests": sum(t[0] for t in coord),
                "coordinator_bytes": sum(t[1] for t in coord)}

    def store_port(self) -> dict[str, Any]:
        """The port of the round store node 0 hosts (this process's first node)."""
        return {"port": self.nodes[self.first].node.hosted_port()}

    def health(self) -> dict[str, Any]:
        """Whether the coordinator this process runs (ours: node 0's) still runs, and why
        it stopped if it did (``CoordinatorLoop.error``)."""
        place = getattr(self.nodes[self.first].node.rdzv, "place", None)
        loop = getattr(place, "coordinator", None)
        if loop is None:
            return {"coordinator": None}
        return {"coordinator": {"alive": loop._thread.is_alive(), "error": loop.error}}

    def threads(self) -> dict[str, Any]:
        return {"threads": {str(t.native_id): t.name for t in threading.enumerate()}}

    def fault(self, kill: list[int], freeze: list[int], fail: bool) -> dict[str, Any]:
        """Kill or freeze the named nodes of this process; with ``fail`` every other node
        of it re-joins at once."""
        times = {i: self.nodes[i].halt("killed") for i in kill if i in self.nodes}
        times |= {i: self.nodes[i].halt("frozen") for i in freeze if i in self.nodes}
        if fail:
            for i, node in self.nodes.items():
                if i not in times:
                    node.fail()
        return {"halted": times}


COMMANDS = ("make", "join", "events", "traffic", "threads", "fault", "store_port", "health")


def raise_file_limit() -> None:
    """A process of 250 simulated nodes holds 500 to 750 store connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(job: JobSpec, first: int, count: int) -> None:
    """Answer the driver's commands until stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol owns the real stdout
    proc = Process(job, first, count)
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            answer = getattr(proc, name)(**cmd) if name in COMMANDS else {"error": name}
        except Exception as exc:  # noqa: BLE001 - the driver reports it
            traceback.print_exc()
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def main(argv: list[str]) -> int:
    sys.path.insert(0, os.getcwd())
    raise_file_limit()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.set_threshold(*GC_THRESHOLDS)
    serve(JobSpec.from_json(argv[0]), int(argv[1]), int(argv[2]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
