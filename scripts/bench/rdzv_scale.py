"""The rendezvous at scale: N simulated nodes against a real store, ours beside torch's.

    python scripts/bench/rdzv_scale.py [--nodes 100,300,1000] [--backends c10d,torch-c10d]
        [--per-proc 64] [--fault-free-s 600] [--bound-s 300] [--out FILE] [--merge]

Each node is the launcher's rendezvous code with no workers (``rdzv_sim.py``: the real
classes, a thread per node that joins and then polls every ``--monitor-interval`` as the
supervisor does). Node 0 runs in a process of its own, which hosts the store (a c10d
``TCPStore``; with ours it also runs the coordinator), so that the store host's CPU is
measured alone; the other nodes are spread over processes of ``--per-proc`` nodes at most
(a process of many more spends the machine on its threads' contention for the interpreter
lock while they all join at once, not on the rendezvous). For each backend and
N, three jobs, each from cold:

- job A, ``--nnodes N-1:N``, N nodes: the round of N formed from cold; a fault-free window
  of ``--fault-free-s`` (the store's traffic and CPU, and every round opened or node
  dropped in it: false drops); then one node frozen (its keep-alive and loop stopped,
  nothing left): until every survivor's ``poll_round()`` reports it lost, and until the
  round of N-1 has formed;
- job B, ``--nnodes N-1:N``, N nodes: one node killed (its keep-alive and loop stopped)
  while every other node re-joins at the same moment, as its workers would fail through the
  data plane: until every survivor has its RoundInfo in the round of N-1;
- job C, ``--nnodes N:N``, N+1 nodes: one waits as a spare; a member killed and the others
  re-join as in B: until the spare has its RoundInfo in the new round of N.

Every wait is bounded by ``--bound-s``: a figure not reached is reported as "not within X s"
with how far it got. Writes ``--out`` (default ``scripts/bench/rdzv_scale.json``); with
``--merge`` the cells measured now replace the same cells of the file and keep the others.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from rdzv_counters import (  # noqa: E402
    CLK_TCK,
    Backing,
    backing,
    machine_busy_pct,
    pct,
    process_ticks,
    thread_ticks,
    wire_bytes,
)
from rdzv_sim import BACKENDS, JobSpec  # noqa: E402

log = logging.getLogger("bench.rdzv_scale")

DEFAULT_OUT = HERE / "rdzv_scale.json"
QUIET_SAMPLE_S = 10.0  # how long the machine's busyness is sampled before a job
POLL_S = 0.2  # how often the driver collects the nodes' events while it waits
# A round counts as formed once none of its nodes has left it (news, a re-join, an error)
# within this of its last node's RoundInfo: the keep-alive expiry (2 s) and a second.
SETTLE_S = 3.0
# Both ends of a c10d connection look the peer's address up (reverse DNS) as it connects,
# the store in its only event-loop thread. Where the resolver drops a query now and then
# (this machine's does, about 1 in 25 at a burst of connections), the store stalls 5 s, the
# resolver's timeout, each time: setting 1,000 nodes up took minutes. The simulator's
# processes wait 1 s, once; every connection is open before the first measured phase.
SIM_ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}
# issue 47's targets, at 1,000 nodes (keep-alive bound: 0.5 s x 4 with the defaults)
TARGETS = {
    "loss_s": 5.0,
    "frozen_extra_s": 1.0,
    "traffic_bytes_per_s": 1e6,
    "store_cpu_pct": 10.0,
    "false_drops": 0,
}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- the processes of one job ---------------------------------------------------------------


class Sim:
    """The processes of one simulated job: node 0 (hosting the store) alone, the others in
    processes of ``per_proc`` nodes at most. Commands go to every process at once; each
    answers one JSON line."""

    def __init__(self, job: JobSpec, nodes: int, per_proc: int, logdir: Path) -> None:
        self.job, self.nodes = job, nodes
        self.events: list[dict[str, Any]] = []
        self.names: dict[int, str] = {}
        self.procs: list[subprocess.Popen[str]] = []
        self._cursors: list[int] = []
        self.logdir = logdir
        self._start(slices(nodes, per_proc))

    def _start(self, parts: list[tuple[int, int]]) -> None:
        for k, (first, count) in enumerate(parts):
            env = {**os.environ, **SIM_ENV}
            argv = [sys.executable, str(HERE / "rdzv_sim.py"), self.job.to_json(), str(first),
                    str(count)]
            if k > 0:  # a wait that times out is a c10d warning: 1,000 nodes, 4,000 a second
                env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
            err = open(self.logdir / f"proc{k}.log", "w")  # noqa: SIM115 - the child's stderr
            self.procs.append(subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env=env, cwd=REPO))
            err.close()
            self._cursors.append(0)
            if k == 0:  # the store exists before anyone connects
                self.names |= {int(i): n for i, n in self.call([0], "make")[0]["names"].items()}
        answers = self.call(range(1, len(parts)), "make")
        for a in answers:
            self.names |= {int(i): n for i, n in a["names"].items()}

    @property
    def host_pid(self) -> int:
        return self.procs[0].pid

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, which: Iterable[int], cmd: str, **args: Any) -> list[dict[str, Any]]:
        which = list(which)
        line = json.dumps({"cmd": cmd, **args}) + "\n"
        for k in which:
            self.procs[k].stdin.write(line)  # type: ignore[union-attr]
            self.procs[k].stdin.flush()  # type: ignore[union-attr]
        answers = []
        for k in which:
            text = self.procs[k].stdout.readline()  # type: ignore[union-attr]
            if not text:
                raise RuntimeError(f"simulator process {k} ended; see {self.logdir}/proc{k}.log")
            answer = json.loads(text)
            if "error" in answer:
                raise RuntimeError(f"simulator process {k}: {cmd}: {answer['error']}")
            answers.append(answer)
        return answers

    def call_all(self, cmd: str, **args: Any) -> list[dict[str, Any]]:
        return self.call(range(len(self.procs)), cmd, **args)

    def pull(self) -> list[dict[str, Any]]:
        """Every event so far (new ones collected from each process)."""
        for k in range(len(self.procs)):
            new = self.call([k], "events", cursor=self._cursors[k])[0]["events"]
            self._cursors[k] += len(new)
            self.events += new
        return self.events

    def traffic(self) -> dict[str, int]:
        """Every node's client-side counts, summed: requests, bytes, and the
        coordinator's own share of each."""
        answers = self.call_all("traffic")
        return {k: sum(a[k] for a in answers) for k in answers[0]}

    def fault(self, kill: list[int] = (), freeze: list[int] = (), fail: bool = False) -> float:
        """Apply a fault in every process at once; the time the first node was halted."""
        answers = self.call_all("fault", kill=list(kill), freeze=list(freeze), fail=fail)
        return min(t for a in answers for t in a["halted"].values())

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(30)


def slices(nodes: int, per_proc: int) -> list[tuple[int, int]]:
    """(first node, count) per process: node 0 alone, the rest in even slices of
    ``per_proc`` at most."""
    rest = nodes - 1
    procs = -(-rest // per_proc)
    out, first = [(0, 1)], 1
    for k in range(procs):
        count = rest // procs + (1 if k < rest % procs else 0)
        out.append((first, count))
        first += count
    return out


# -- what the events say ----------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """A round every one of its nodes got: its number, its nodes, when the last got it."""

    number: int
    nodes: frozenset[int]
    done_t: float


def latest_rounds(events: list[dict[str, Any]], nodes: set[int], t0: float
                  ) -> dict[int, dict[str, Any]]:
    """Each node's newest RoundInfo after ``t0``."""
    latest: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "round" and e["t"] >= t0 and e["node"] in nodes:
            latest[e["node"]] = e
    return latest


def full_round(events: list[dict[str, Any]], nodes: set[int], world: int, t0: float,
               skip: set[int] = frozenset()) -> Round | None:
    """A round of ``world`` nodes, all of them among ``nodes``, that each of them holds as
    its newest RoundInfo since ``t0`` (none of the rounds in ``skip``)."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for e in latest_rounds(events, nodes, t0).values():
        by_round.setdefault(e["round"], []).append(e)
    for g, got in by_round.items():
        if g not in skip and len(got) == world and all(e["world"] == world for e in got):
            return Round(g, frozenset(e["node"] for e in got), max(e["t"] for e in got))
    return None


def after(events: list[dict[str, Any]], t0: float, kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["t"] >= t0 and e["kind"] == kind]


def first_by_node(events: list[dict[str, Any]], t0: float, kind: str,
                  nodes: set[int]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for e in after(events, t0, kind):
        if e["node"] in nodes and e["node"] not in out:
            out[e["node"]] = e
    return out


def wait_for(sim: Sim, check: Callable[[list[dict[str, Any]]], Any], bound_s: float) -> Any:
    """Collect events until ``check`` returns something (returned) or ``bound_s`` passes
    (None)."""
    deadline = time.monotonic() + bound_s
    while True:
        found = check(sim.pull())
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(POLL_S)


def errors(events: list[dict[str, Any]], t0: float) -> list[str]:
    texts = sorted({e["text"] for e in after(events, t0, "error")})
    return texts[:5]


def progress(events: list[dict[str, Any]], nodes: set[int], t0: float) -> str:
    """How far a phase got by its bound."""
    latest = latest_rounds(events, nodes, t0)
    worlds = sorted({e["world"] for e in latest.values()})
    text = f"{len(latest)} of {len(nodes)} nodes had a RoundInfo"
    if worlds:
        text += f" (world sizes {', '.join(map(str, worlds))})"
    errs = len({e['node'] for e in after(events, t0, 'error')})
    return text + (f"; {errs} nodes ended with an error" if errs else "")


def not_within(bound_s: float, how_far: str) -> dict[str, Any]:
    return {"s": None, "note": f"not within {bound_s:g} s: {how_far}"}


# -- the store's counters ------------------------------------------------------------------


def sim_cpu(sim: Sim) -> dict[str, float]:
    """CPU seconds so far: the store host's process, and every process of the job."""
    ticks = [process_ticks(pid) for pid in sim.pids()]
    return {"store_host": ticks[0] / CLK_TCK, "all": sum(ticks) / CLK_TCK}


def store_wire(store: Backing) -> int:
    """Bytes every socket of the store (and etcd's members) moved so far."""
    return sum(wire_bytes(port) for port in store.ports.values())


@dataclass
class Snapshot:
    """The counters at one moment of a fault-free window."""

    t: float
    counts: dict[str, int]  # every node's client-side counts (Sim.traffic)
    wire: dict[str, int]  # by store port name (Backing.ports)
    host: int  # the store host's pid
    cpu: dict[int, int]  # every process of the job, and the backing's (etcd members)
    host_threads: dict[str, int]

    @classmethod
    def take(cls, sim: Sim, store: Backing) -> Snapshot:
        counts = sim.traffic()
        pids = sim.pids() + list(store.pids.values())
        return cls(time.monotonic(), counts,
                   {name: wire_bytes(port) for name, port in store.ports.items()},
                   sim.host_pid, {pid: process_ticks(pid) for pid in pids},
                   thread_ticks(sim.host_pid))


def rates(a: Snapshot, b: Snapshot, store: Backing) -> dict[str, float]:
    """Per second between two snapshots; with etcd, its members' bytes and CPU apart."""
    dt = b.t - a.t
    out = {f"{k}_per_s": round((b.counts[k] - a.counts[k]) / dt, 1) for k in b.counts}
    out |= {"wire_bytes_per_s": round((b.wire["store"] - a.wire["store"]) / dt, 1),
            "store_host_cpu_pct": pct(b.cpu[b.host] - a.cpu[a.host], dt)}
    etcd = [n for n in store.ports if n != "store"]
    if etcd:
        out["etcd_wire_bytes_per_s"] = round(sum(b.wire[n] - a.wire[n] for n in etcd) / dt, 1)
        out["etcd_cpu_pct"] = pct(sum(b.cpu[store.pids[n]] - a.cpu[store.pids[n]]
                                      for n in etcd), dt)
    return out


def thread_kind(name: str | None) -> str:
    """What a thread of the store's host process does, by its Python name."""
    if name is None:
        return "store server (threads outside Python)"
    if name in ("ft-rdzv-coordinator", "ft-rdzv-lease"):
        return "coordinator"
    if name == "MainThread":
        return "driver protocol"
    return "node 0 (keep-alive, round loop)"


def host_breakdown(a: Snapshot, b: Snapshot, names: dict[str, str]) -> dict[str, float]:
    out: dict[str, int] = {}
    for tid, ticks in b.host_threads.items():
        kind = thread_kind(names.get(tid))
        out[kind] = out.get(kind, 0) + ticks - a.host_threads.get(tid, 0)
    return {k: pct(v, b.t - a.t) for k, v in sorted(out.items())}


# -- the phases ------------------------------------------------------------------------------


def stable(sim: Sim, check: Callable[[list[dict[str, Any]], set[int]], Round | None],
           bound_s: float) -> Round | None:
    """The first round ``check`` finds (given the rounds found unstable so far) that none
    of its nodes leaves within ``SETTLE_S`` of its forming (no news, no re-join, no error):
    a round the coordinator re-forms at once (a node dropped on the way) does not count."""
    deadline = time.monotonic() + bound_s
    unstable: set[int] = set()
    while True:
        rnd = wait_for(sim, lambda ev: check(ev, unstable), deadline - time.monotonic())
        if rnd is None:
            return None
        time.sleep(SETTLE_S)
        moved = [e for e in sim.pull() if e["t"] > rnd.done_t and e["node"] in rnd.nodes
                 and e["kind"] in ("news", "join", "error")]
        if not moved:
            return rnd
        unstable.add(rnd.number)
        if time.monotonic() >= deadline:
            return None


def phase_figures(events: list[dict[str, Any]], rnd: Round, t0: float) -> dict[str, Any]:
    """What a phase that ended in ``rnd`` took: the figure (``s``: until its last node
    held it), the first node's RoundInfo, rounds formed, nodes named lost, errors."""
    got = after(events, t0, "round")
    lost = {n for e in after(events, t0, "news") if e["t"] <= rnd.done_t for n in e["lost"]}
    return {"s": round(rnd.done_t - t0, 3),
            "first_round_info_s": round(min(e["t"] for e in got) - t0, 3),
            "rounds": len({e["round"] for e in got if e["t"] <= rnd.done_t}),
            "round": rnd.number, "named_lost": len(lost), "errors": errors(events, t0),
            "max_lag_s": max_lag(events, t0, rnd.done_t)}


def max_lag(events: list[dict[str, Any]], t0: float, t1: float) -> float:
    """The longest a thread of the node processes was held back (LagProbe) in [t0, t1]."""
    return max((e["s"] for e in after(events, t0, "lag") if e["t"] <= t1), default=0.0)


def formation(sim: Sim, store: Backing, world: int, spare: bool, bound_s: float
              ) -> tuple[dict, Round | None]:
    """Every node joins at once; until ``world`` of them hold the same round for good (and,
    with a spare, the one left out waits as a spare). Also what it cost: CPU seconds, and
    the bytes the store's sockets moved meanwhile (MB)."""
    everyone = set(range(sim.nodes))
    cpu0, wire0 = sim_cpu(sim), store_wire(store)
    t_call = time.monotonic()
    sim.call_all("join")

    def formed(events: list[dict[str, Any]], unstable: set[int]) -> Round | None:
        rnd = full_round(events, everyone, world, t_call, unstable)
        if rnd is None or not spare:
            return rnd
        waiting = {e["node"] for e in after(events, t_call, "spare_waiting")}
        return rnd if waiting - rnd.nodes else None

    rnd = stable(sim, formed, bound_s)
    cost = {"cpu_s": {k: round(v - cpu0[k], 1) for k, v in sim_cpu(sim).items()},
            "wire_mb": round((store_wire(store) - wire0) / 1e6, 1)}
    events = sim.events
    t0 = min((e["t"] for e in after(events, t_call, "join")), default=t_call)
    if rnd is None:
        return {**not_within(bound_s, progress(events, everyone, t_call)), **cost}, None
    return {**phase_figures(events, rnd, t0), **cost}, rnd


def fault_free(sim: Sim, store: Backing, seconds: float) -> dict[str, Any]:
    """Traffic, store CPU and false drops over a window in which nothing is faulted."""
    names = sim.call([0], "threads")[0]["threads"]
    slice_s = min(10.0, seconds)
    snaps = [Snapshot.take(sim, store)]
    while snaps[-1].t - snaps[0].t < seconds - 1e-3:
        time.sleep(max(0.0, min(slice_s, seconds - (time.monotonic() - snaps[0].t))))
        snaps.append(Snapshot.take(sim, store))
    a, b = snaps[0], snaps[-1]
    per_slice = [rates(x, y, store) for x, y in zip(snaps, snaps[1:], strict=False)]
    events = [e for e in sim.pull() if a.t <= e["t"] <= b.t]
    dropped = {n for e in events if e["kind"] == "news" for n in e["lost"]} | \
        {sim.names[e["node"]] for e in events if e["kind"] == "news" and e["dropped"]}
    return {"window_s": round(b.t - a.t, 1), **rates(a, b, store),
            "max_slice": {k: max(r[k] for r in per_slice) for k in per_slice[0]},
            "slice_s": slice_s,
            "store_host_threads_cpu_pct": host_breakdown(a, b, names),
            "process_cpu_pct": [pct(b.cpu[p] - a.cpu[p], b.t - a.t) for p in sim.pids()],
            "rounds_opened": len({e["round"] for e in events if e["kind"] == "round"}),
            "news": sum(e["kind"] == "news" for e in events),
            "nodes_dropped": len(dropped), "errors": errors(events, a.t),
            "max_lag_s": max_lag(events, a.t, b.t)}


def pick_victim(sim: Sim, rnd: Round) -> int:
    """A member of ``rnd`` in the last process (never node 0, the store's host)."""
    return max(rnd.nodes - {0})


def frozen(sim: Sim, store: Backing, rnd: Round, bound_s: float) -> dict[str, Any]:
    """Freeze one member; until every survivor has dropped it, then its new round."""
    victim = pick_victim(sim, rnd)
    survivors = set(rnd.nodes) - {victim}
    wire0 = store_wire(store)
    t0 = sim.fault(freeze=[victim])
    news = wait_for(sim, lambda ev: _all_news(ev, survivors, t0), bound_s)
    events = sim.events
    if news is None:
        heard = len(first_by_node(events, t0, "news", survivors))
        return {"dropped_by_every_survivor": not_within(
            bound_s, f"{heard} of {len(survivors)} survivors had news")}
    name = sim.names[victim]
    named = [e for e in news.values() if name in e["lost"]]
    times = [e["t"] - t0 for e in news.values()]
    out = {"dropped_by_every_survivor": {
        "s": round(max(times), 3) if len(named) == len(survivors) else None,
        "first_s": round(min(times), 3), "named_by": len(named),
        "survivors": len(survivors), "every_survivor_news_s": round(max(times), 3),
        "whys": sorted({e["why"] for e in news.values()}),
        "max_lag_s": max_lag(events, t0, t0 + max(times))}}
    out["new_round"] = new_round(sim, survivors, len(survivors), t0, bound_s)
    out["new_round"]["wire_mb"] = round((store_wire(store) - wire0) / 1e6, 1)
    return out


def _all_news(events: list[dict[str, Any]], nodes: set[int], t0: float) -> dict | None:
    got = first_by_node(events, t0, "news", nodes)
    return got if len(got) == len(nodes) else None


def new_round(sim: Sim, nodes: set[int], world: int, t0: float, bound_s: float
              ) -> dict[str, Any]:
    """Until ``world`` of ``nodes`` hold the same round for good since ``t0``."""
    left = max(1.0, bound_s - (time.monotonic() - t0))
    rnd = stable(sim, lambda ev, unstable: full_round(ev, nodes, world, t0, unstable), left)
    if rnd is None:
        return not_within(bound_s, progress(sim.events, nodes, t0))
    return phase_figures(sim.events, rnd, t0)


def loss(sim: Sim, store: Backing, rnd: Round, world: int, bound_s: float,
         spare: int | None = None) -> dict[str, Any]:
    """Kill one member while every other node re-joins at once (the data plane's fan-out);
    until the new round of ``world`` holds every survivor (and the spare). Also the bytes
    the store moved meanwhile (MB)."""
    victim = pick_victim(sim, rnd)
    nodes = set(rnd.nodes) - {victim} | ({spare} if spare is not None else set())
    wire0 = store_wire(store)
    t0 = sim.fault(kill=[victim], fail=True)
    out = new_round(sim, nodes, world, t0, bound_s)
    out["wire_mb"] = round((store_wire(store) - wire0) / 1e6, 1)
    fails = [e["t"] - t0 for e in after(sim.events, t0, "fail")]
    out["fail_spread_s"] = round(max(fails), 3) if fails else None
    if spare is not None and out.get("s") is not None:
        got = [e["t"] for e in after(sim.events, t0, "round")
               if e["node"] == spare and e["round"] == out["round"]]
        out["spare_s"] = round(got[0] - t0, 3)
    return out


# -- one backend at one size -------------------------------------------------------------------


@dataclass
class Cell:
    """What to run for one backend at one N, and what it measured."""

    backend: str
    nodes: int
    per_proc: int
    fault_free_s: float
    bound_s: float
    jobs: str = "abc"
    events_dir: Path | None = None
    quiet_pct: float | None = None  # wait for the machine to be less busy than this
    quiet_wait_s: float = 0.0
    conf: dict[str, str] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    def job(self, tag: str, min_nodes: int, endpoint: str) -> JobSpec:
        return JobSpec(self.backend, endpoint, f"scale-{tag}-{os.getpid()}", min_nodes,
                       self.nodes, dict(self.conf))


def run_job(cell: Cell, tag: str, nodes: int, min_nodes: int, body: Callable[..., None]) -> None:
    """One job from cold: its store, its processes, ``body(sim, store)``, then all gone."""
    with tempfile.TemporaryDirectory(prefix=f"rdzv_scale_{tag}_") as workdir, \
            backing(cell.backend, Path(workdir)) as store:
        t = time.monotonic()
        sim = Sim(cell.job(tag, min_nodes, store.endpoint), nodes, cell.per_proc,
                  Path(workdir))
        try:
            store.ports["store"] = sim.call([0], "store_port")[0]["port"]
            log.info("%s N=%d job %s: %d nodes made in %.1f s", cell.backend, cell.nodes,
                     tag, nodes, time.monotonic() - t)
            body(sim, store)
        finally:
            sim.close()
            if cell.events_dir is not None:
                dump_events(cell, tag, sim)


def dump_events(cell: Cell, tag: str, sim: Sim) -> None:
    """Every event of a job and its processes' stderr, for reading what happened
    (``--events DIR``)."""
    assert cell.events_dir is not None
    cell.events_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{cell.backend}-{cell.nodes}-{tag}"
    (cell.events_dir / f"{stem}.json").write_text(
        json.dumps({"names": sim.names, "events": sim.events}))
    for k in range(len(sim.procs)):
        shutil.copyfile(sim.logdir / f"proc{k}.log", cell.events_dir / f"{stem}-proc{k}.log")


def job_a(cell: Cell) -> None:
    """Formation, the fault-free window, a frozen node."""
    n, r = cell.nodes, cell.result

    def body(sim: Sim, store: Backing) -> None:
        r["formation"], rnd = formation(sim, store, n, False, cell.bound_s)
        log.info("formation: %s", r["formation"])
        if rnd is None:
            return
        r["fault_free"] = fault_free(sim, store, cell.fault_free_s)
        r["fault_free"]["coordinator"] = sim.call([0], "health")[0]["coordinator"]
        log.info("fault-free: %s", r["fault_free"])
        r["frozen"] = frozen(sim, store, rnd, cell.bound_s)
        log.info("frozen: %s", r["frozen"])

    run_job(cell, "a", n, n - 1, body)


def job_b(cell: Cell) -> None:
    """A node killed while the others re-join."""
    n, r = cell.nodes, cell.result

    def body(sim: Sim, store: Backing) -> None:
        r["formation_b"], rnd = formation(sim, store, n, False, cell.bound_s)
        if rnd is None:
            return
        r["loss"] = loss(sim, store, rnd, n - 1, cell.bound_s)
        log.info("loss: %s", r["loss"])

    run_job(cell, "b", n, n - 1, body)


def job_c(cell: Cell) -> None:
    """N+1 nodes for N places: a member killed, the spare admitted."""
    n, r = cell.nodes, cell.result

    def body(sim: Sim, store: Backing) -> None:
        r["formation_spare"], rnd = formation(sim, store, n, True, cell.bound_s)
        if rnd is None:
            return
        spare = next(iter(set(range(n + 1)) - rnd.nodes))
        r["spare"] = loss(sim, store, rnd, n, cell.bound_s, spare=spare)
        log.info("spare: %s", r["spare"])

    run_job(cell, "c", n + 1, n, body)


def wait_for_quiet(busy_pct: float | None, most_s: float) -> dict[str, Any]:
    """Before a job: wait (at most ``most_s``) until the machine was less than ``busy_pct``
    busy over 10 s; how busy it was when the job started, and how long that took."""
    t0 = time.monotonic()
    while True:  # without a bound to wait for, a short sample only records how busy it was
        busy = machine_busy_pct(QUIET_SAMPLE_S if busy_pct is not None else 1.0)
        waited = time.monotonic() - t0
        if busy_pct is None or busy < busy_pct or waited >= most_s:
            if busy_pct is not None:
                log.info("machine %.0f %% busy after %.0f s of waiting for quiet", busy, waited)
            return {"busy_pct": busy, "waited_s": round(waited, 1),
                    "quiet": busy_pct is not None and busy < busy_pct}


def run_cell(cell: Cell, command: str) -> dict[str, Any]:
    started = time.time()
    cell.result.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                       command=command, loadavg_start=loadavg(),
                       settings={"per_proc": cell.per_proc, "fault_free_s": cell.fault_free_s,
                                 "bound_s": cell.bound_s})
    for tag, job in (("a", job_a), ("b", job_b), ("c", job_c)):
        if tag in cell.jobs:
            cell.result.setdefault("quiet", {})[tag] = wait_for_quiet(cell.quiet_pct,
                                                                      cell.quiet_wait_s)
            job(cell)
    cell.result.update(loadavg_end=loadavg(), wall_s=round(time.time() - started, 1))
    return cell.result


# -- the result file ------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu_model": model, "cpus": os.cpu_count(), "memory_gib": round(mem, 1),
            "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch")}


def timings() -> dict[str, float]:
    from ft_launcher.nodes.rendezvous import RendezvousTimings

    t = RendezvousTimings()
    return {"keep_alive_interval": t.keep_alive_interval,
            "keep_alive_max_attempt": t.keep_alive_max_attempt, "dead_after": t.dead_after,
            "last_call_timeout": t.last_call_timeout, "poll_interval": t.poll_interval,
            "monitor_interval": 0.1}


def method() -> list[str]:
    """How each figure is taken (rendered beside the figures)."""
    return [
        "Nodes: each the real rendezvous classes of its backend (scripts/bench/rdzv_sim.py), "
        "no workers: a thread per node joins (next_round()), then calls poll_round() every "
        "--monitor-interval (0.1 s) as the supervisor does, and joins again on news (nodes "
        "lost or waiting, a next round opened, itself dropped). Node 0 runs alone in the "
        "process that hosts the store (c10d: the store and the coordinator; etcd: it is "
        "elected, hosts the round store and coordinates; torch-c10d: torch's TCPStore); the "
        "others in processes of at most 64 nodes.",
        "Only the simulator differs from launchers: its processes use a 50 ms interpreter "
        "switch interval and rarer garbage collections (64 nodes' threads and records in one "
        "process), a 1 s resolver timeout (c10d connections look their peer up; every "
        "connection is open before the first measured phase), and c10d warnings off except "
        "in the store's host.",
        "Times: time.monotonic() in every process (one clock for the machine).",
        "Formation: every node calls next_round() at once; the figure is from the first call "
        "to the last node's RoundInfo of a round that holds all N (with a spare: N of N+1, "
        f"the other waiting as a spare) and that none of its nodes leaves within {SETTLE_S:g} s "
        "(a round re-formed at once, a node dropped on the way, does not count: the rounds "
        "it took and the nodes dropped are given). The same rule ends every phase below.",
        "Traffic, over the fault-free window once the round formed: requests and bytes "
        "counted by the clients (c10d and etcd: the counters of every client, the "
        "coordinator's and etcd's included; torch-c10d: every call torch's c10d rendezvous "
        "backend makes to the store, its keys and values), and bytes on the wire: the "
        "kernel's bytes_sent + bytes_received of every server-side socket of the store "
        "(ss -ti), both directions; for etcd its round store's and its members' client ports.",
        "Store host CPU: utime + stime of the process that hosts the store (it also runs node "
        "0, and with ours the coordinator), % of one core over the window; for etcd plus its "
        "three members. The simulator processes' own CPU is given per process.",
        "False drops: rounds that nodes joined, news that poll_round() reported and nodes "
        "named lost or dropped during the fault-free window, in which nothing is faulted.",
        "Frozen: one member's keep-alive and loop stopped, nothing left (as SIGSTOP): until "
        "every survivor's poll_round() named it lost; then until the round of N-1 formed "
        "(the survivors re-join on the news).",
        "Loss: one member's keep-alive and loop stopped (as SIGKILL) while every other member "
        "re-joins at the same moment (its workers would fail through the data plane): until "
        "every survivor holds its RoundInfo of the round of N-1. Spare: the same with N+1 "
        "nodes for --nnodes N:N, until the spare holds its RoundInfo of the new round.",
        "Every wait is bounded (--bound-s); a phase not done by then is reported with how far "
        "it got.",
    ]




def load(out: Path, merge: bool) -> dict[str, Any]:
    """The result file to add to: the existing one with ``--merge``, else a new one."""
    return json.loads(out.read_text()) if merge and out.exists() else {}


def write(out: Path, doc: dict[str, Any], backend: str, n: int, result: dict[str, Any],
          command: str) -> None:
    """Put one cell into ``doc`` and write it whole."""
    doc.update(version=1, machine=machine_info(), timings=timings(), targets=TARGETS,
               method=method())
    doc["commands"] = sorted(set(doc.get("commands", [])) | {command})
    doc.setdefault("cells", {}).setdefault(backend, {})[str(n)] = result
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="100,300,1000", help="comma-separated N [100,300,1000]")
    ap.add_argument("--backends", default="c10d,torch-c10d",
                    help=f"comma-separated, of {','.join(BACKENDS)} [c10d,torch-c10d]")
    ap.add_argument("--per-proc", type=int, default=64,
                    help="nodes per process at most (node 0 has one of its own) [64]")
    ap.add_argument("--fault-free-s", type=float, default=600.0,
                    help="the fault-free window (traffic, CPU, false drops) [600]")
    ap.add_argument("--bound-s", type=float, default=300.0,
                    help="the longest any phase is waited for [300]")
    ap.add_argument("--jobs", default="abc",
                    help="which jobs: a (formation, fault-free, frozen), b (loss), c (spare)")
    ap.add_argument("--events", type=Path, help="write every job's events under this folder")
    ap.add_argument("--quiet-pct", type=float,
                    help="before each job, wait until the machine is less busy than this "
                         "(%% of all its CPUs, over 10 s); each job records how busy it was")
    ap.add_argument("--quiet-wait-s", type=float, default=3600.0,
                    help="the longest to wait for quiet before each job [3600]")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--merge", action="store_true",
                    help="keep the cells of --out that this run does not measure")
    args = ap.parse_args(argv)
    args.node_counts = [int(x) for x in args.nodes.split(",") if x]
    args.backend_list = [x for x in args.backends.split(",") if x]
    bad = [b for b in args.backend_list if b not in BACKENDS]
    if bad or any(n < 3 for n in args.node_counts):
        ap.error(f"--backends: expected a subset of {','.join(BACKENDS)}; --nodes: each >= 3")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    command = " ".join(["python scripts/bench/rdzv_scale.py",
                        *(sys.argv[1:] if argv is None else argv)])
    doc = load(args.out, args.merge)
    for backend in args.backend_list:
        for n in args.node_counts:
            cell = Cell(backend, n, args.per_proc, args.fault_free_s, args.bound_s, args.jobs,
                        args.events, args.quiet_pct, args.quiet_wait_s)
            write(args.out, doc, backend, n, run_cell(cell, command), command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
