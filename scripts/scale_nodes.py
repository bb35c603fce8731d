"""Scale on one machine: N real ft_launchers of one rank each on loopback, one node lost.

    python scripts/scale_nodes.py [--nodes 16[,64]] [--backends c10d[,torch-c10d]]
        [--worker gloo|light] [--cases nospare[,spare]] [--fault-free-s 20]
        [--form-attempts 1] [--start-batch 0] [--env KEY=VALUE ...] [--name NAME]

Each case starts N launchers (``--rdzv-backend`` one of ``--backends``: ``c10d`` is the
launcher's own rendezvous, ``torch-c10d`` torch's handler; the first node hosts the store),
every one running one worker:

- ``gloo``: ``bench/node_step_worker.py``, a heartbeat and a gloo barrier of the whole world
  every 0.2 s (it imports torch); the launchers keep their default warm restart.
- ``light``: ``bench/node_light_worker.py``, a heartbeat and a step line every 1 s, no torch
  and no collective: the survivors learn of a loss from the rendezvous alone. The launchers
  run with ``--no-ft-warm-restart``: warm restart would add a zygote and a standby per node
  (192 interpreters at 64 nodes) that import torch, the preload, to save the import of
  ft_agent, about 50 ms.

The store's host starts first, then the others all at once (or ``--start-batch`` at a
time). A start ends as soon as a launcher exits (the world of N can no longer form); up to
``--form-attempts`` starts are tried, each on a fresh store, and the failed ones are kept
(``failed_starts``: which launchers exited and why, the store host's rendezvous log).
Once every node's worker runs in the world of N (``start``: from the first launcher's spawn,
with the rounds it took and the nodes dropped on the way), the case watches the fault-free
world for ``--fault-free-s`` seconds (``fault_free``: the restarts, re-formed rounds and
losses the launchers logged in it; each launcher's and worker's CPU in % of one core, RSS,
PSS and open files; the whole machine's CPU, the driver's own), waits for a steady world
(one round of N on every node, each running a worker of it), then SIGKILLs one node that
does not host the store (its launcher and worker) and times, from the kill, when every
survivor (``loss``):

- knew of the loss (its ``peers_waiting`` event),
- had its place in the new round (``rendezvous_done``),
- had started the new round's worker (``workers_started``),
- had a worker of the new world running: its first step line (the measure that counts).

``nospare``: ``--nnodes N-1:N``, the new world has N-1 ranks. ``spare``: ``--nnodes N:N``
and an (N+1)th launcher started once the world trains; it takes the lost node's place.
``--env`` sets a variable for every launcher and worker (recorded). Results: ``NAME.json``
under ``--out`` (rendered by ``python -m scripts.docs.render``) and a summary per case in the
log. Every process is stopped by pid (SIGCONT, SIGTERM, SIGKILL) when a start ends,
whatever happened.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from loopback_nodes import LIGHT_WORKER, WORKER, Cluster  # noqa: E402
from runner import JsonlTail  # noqa: E402

log = logging.getLogger("scale_nodes")
OURS_EXTRA = ("--workers-stop-timeout", "2")
BACKENDS = ("c10d", "torch-c10d")
CASES = ("nospare", "spare")
MB = 2**20


@dataclass(frozen=True)
class Worker:
    script: Path
    ours_extra: tuple[str, ...]
    step_s: str


WORKERS = {
    "gloo": Worker(WORKER, (), "0.2"),
    "light": Worker(LIGHT_WORKER, ("--no-ft-warm-restart",), "1.0"),
}


@dataclass(frozen=True)
class Case:
    backend: str
    nodes: int
    spare: bool

    @property
    def nnodes(self) -> str:
        return f"{self.nodes}:{self.nodes}" if self.spare else f"{self.nodes - 1}:{self.nodes}"

    @property
    def world_after(self) -> int:
        return self.nodes if self.spare else self.nodes - 1

    @property
    def label(self) -> str:
        return f"{self.backend}-{self.nodes}-{'spare' if self.spare else 'nospare'}"


def node_names(n: int) -> list[str]:
    return [f"n{i:02d}" for i in range(n)]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# -- reading the launchers' events -----------------------------------------------------


def events(cluster: Cluster, name: str, event: str, t0: float = 0.0,
           t1: float = float("inf")) -> list[dict[str, Any]]:
    """A node's ``event`` records with t0 < ts <= t1."""
    path = cluster.base / name / "ft" / "events.jsonl"
    return [e for e in JsonlTail(path).read() if e.get("event") == event and t0 < e["ts"] <= t1]


def counts(cluster: Cluster, names: list[str], event: str, t0: float, t1: float) -> dict[str, int]:
    """Per node, how many ``event`` records it logged in (t0, t1]; nodes with none left out."""
    out = {n: len(events(cluster, n, event, t0, t1)) for n in names}
    return {n: c for n, c in out.items() if c}


def first_after(cluster: Cluster, names: list[str], event: str, t: float) -> dict[str, float]:
    """Per node, seconds from ``t`` to its first ``event`` after ``t`` (nodes with none left
    out)."""
    out = {}
    for n in names:
        found = events(cluster, n, event, t)
        if found:
            out[n] = round(found[0]["ts"] - t, 3)
    return out


# -- sampling processes ----------------------------------------------------------------


def _cpu(p: psutil.Process) -> float | None:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


def _mem(p: psutil.Process) -> dict[str, Any]:
    try:
        m = p.memory_full_info()
        return {"rss_mb": round(m.rss / MB, 1), "pss_mb": round(m.pss / MB, 1),
                "fds": p.num_fds(), "threads": p.num_threads()}
    except psutil.Error:
        return {}


def role(p: psutil.Process) -> str:
    """What a process under a launcher is: ``worker`` (the bench's worker script),
    ``guardian`` (ft_launcher's), or its program's name."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "gone"
    if "node_light_worker.py" in cmd or "node_step_worker.py" in cmd:
        return "worker"
    return "guardian" if "guardian" in cmd else Path(cmd.split(" ")[0]).name


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, over every core."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


class Sampler:
    """CPU of each node's launcher and worker between ``__init__`` and ``finish``; memory
    and open files at ``finish``; the machine's and the driver's CPU over the same time."""

    def __init__(self, cluster: Cluster, names: list[str]) -> None:
        self.procs = {n: cluster.node_processes(n) for n in names}
        self.before = {n: [_cpu(p) for p in ps] for n, ps in self.procs.items()}
        self.driver = psutil.Process()
        self.driver_before = _cpu(self.driver)
        self.machine_before = machine_busy()
        self.t0 = time.monotonic()

    def finish(self) -> dict[str, Any]:
        dt = time.monotonic() - self.t0
        per_node = {}
        for n, ps in self.procs.items():
            if not ps:
                continue
            pct = [None if a is None or b is None else round(100 * (b - a) / dt, 2)
                   for a, b in zip(self.before[n], [_cpu(p) for p in ps], strict=True)]
            per_node[n] = {"cpu_pct": pct[0], **_mem(ps[0]),
                           "children": [{"role": role(p), "cpu_pct": c, **_mem(p)}
                                        for c, p in zip(pct[1:], ps[1:], strict=True)]}
        busy, total = machine_busy()
        cores = psutil.cpu_count() or 1
        return {
            "seconds": round(dt, 1), "per_node": per_node,
            "machine_cpu_pct": round(100 * cores * (busy - self.machine_before[0])
                                     / max(total - self.machine_before[1], 1e-9), 1),
            "driver_cpu_pct": round(100 * ((_cpu(self.driver) or 0)
                                           - (self.driver_before or 0)) / dt, 2),
            "mem_available_gib": round(psutil.virtual_memory().available / 2**30, 1)}


# -- one case --------------------------------------------------------------------------


def start_nodes(cluster: Cluster, names: list[str], batch: int) -> None:
    """The store's host first, then every other node at once (``batch`` 0), or ``batch``
    at a time, each batch once the previous one's launchers hold a connection to the
    store (they imported torch and joined)."""
    if not batch:
        cluster.start_host_first(names, 300)
        return
    cluster.start_host_first(names[:1], 300)
    for i in range(1, len(names), batch):
        group = names[i:i + batch]
        for name in group:
            cluster.start(name)
        if cluster.wait(lambda g=group: all(cluster.connected_to_store(x) for x in g),
                        300) is None:
            raise TimeoutError(f"nodes {group[0]}..{group[-1]} did not reach the store "
                               f"within 300 s")


def form_world(cluster: Cluster, names: list[str], res: dict[str, Any],
               args: argparse.Namespace) -> float | None:
    """Start every node (the store's host first) and wait for the world of all of them;
    record how long it took and what happened on the way. Returns when it formed; None,
    with the attempt recorded in ``failed_starts``, when a launcher exited first (the world
    of N can no longer form) or ``--form-timeout`` passed."""
    n, timeout = len(names), args.form_timeout
    t0 = time.time()
    start_nodes(cluster, names, args.start_batch)
    spawned = time.time()
    formed = cluster.wait(lambda: cluster.world_formed(n, set(names)) or any(
        r.exit_code is not None for r in cluster.runs.values()), timeout)
    res["footprint"] = footprint(cluster, names)
    if formed is None or formed is True:
        res["failed_starts"].append({
            "after_s": round(time.time() - t0, 1),
            "why": "a launcher exited" if formed else f"no world of {n} in {timeout:.0f} s",
            "exits": exits(cluster, names), "footprint": res["footprint"],
            "store_host_log": rendezvous_lines(cluster, names[0])})
        log.info("%s: no world of %d: %s", cluster.run_id, n, res["failed_starts"][-1]["why"])
        return None
    rounds = counts(cluster, names, "rendezvous_done", t0, formed)
    res["start"] = {
        "batch": args.start_batch or n - 1,
        "spawn_s": round(spawned - t0, 2),
        "to_world_s": round(formed - t0, 1),
        "rounds": max(rounds.values(), default=0),
        "restarts": sum(counts(cluster, names, "restart", t0, formed).values()),
        "peers_waiting": sum(counts(cluster, names, "peers_waiting", t0, formed).values()),
        "lost_on_the_way": sorted({x for n in names
                                   for e in events(cluster, n, "peers_waiting", t0, formed)
                                   for x in e.get("lost") or []}),
        "nodes_dropped": sum(counts(cluster, names, "node_dropped", t0, formed).values())}
    log.info("%s: world of %d trains %.1f s after the first start (%d round(s))",
             cluster.run_id, n, formed - t0, res["start"]["rounds"])
    return formed


def footprint(cluster: Cluster, names: list[str]) -> dict[str, Any]:
    """Every process of the nodes now: how many, their RSS and PSS summed, and the memory
    the machine still has."""
    procs = [p for n in names for p in cluster.node_processes(n)]
    mem = [_mem(p) for p in procs]
    return {"processes": len(procs),
            "rss_mb": round(sum(m.get("rss_mb", 0) for m in mem)),
            "pss_mb": round(sum(m.get("pss_mb", 0) for m in mem)),
            "mem_available_gib": round(psutil.virtual_memory().available / 2**30, 1)}


def exits(cluster: Cluster, names: list[str]) -> dict[str, str]:
    """The launchers that exited by themselves, with their reasons."""
    out = {}
    for n in names:
        for e in events(cluster, n, "launcher_exited"):
            out[n] = f"{e.get('exit_code')}: {e.get('reason')}"
    return out


def rendezvous_lines(cluster: Cluster, name: str, last: int = 12) -> list[str]:
    """The node's last log lines about the rendezvous (its coordinator's, when it hosts
    the store): what a world that never formed leaves to read."""
    path = cluster.base / name / "launcher.log"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [x[:400] for x in lines if "rendezvous" in x][-last:]


def add_spare(cluster: Cluster, res: dict[str, Any]) -> bool:
    cluster.start("spare")
    if cluster.wait(lambda: cluster.connected_to_store("spare"), 300) is None:
        res["error"] = "the spare never reached the store"
        return False
    time.sleep(3.0)
    return True


def fault_free(cluster: Cluster, names: list[str], seconds: float) -> dict[str, Any]:
    """Watch the trained world for ``seconds``: what every launcher logged and what it
    cost."""
    load_before = load()
    t0 = time.time()
    sampler = Sampler(cluster, names)
    cluster.wait(lambda: time.time() - t0 >= seconds, seconds + 5)
    out = sampler.finish()
    t1 = time.time()
    per = {ev: counts(cluster, names, ev, t0, t1)
           for ev in ("restart", "rendezvous_done", "peers_waiting", "node_dropped",
                      "worker_exited")}
    out.update({
        "load_before": load_before, "load_after": load(),
        "restarts": sum(per["restart"].values()),
        "rounds": sum(per["rendezvous_done"].values()),
        "launchers_restarted": sorted(set(per["restart"]) | set(per["rendezvous_done"])),
        "peers_waiting": sum(per["peers_waiting"].values()),
        "nodes_dropped": sum(per["node_dropped"].values()),
        "worker_exits": sum(per["worker_exited"].values()),
        "steps": sum(1 for s in cluster.steps if t0 <= s["t"] <= t1)})
    return out


def steady(cluster: Cluster, names: list[str], world: int) -> bool:
    """Every node's latest round is the same one, of ``world`` ranks (a spare waits in
    none), and each node in it runs a worker of that world started after it joined."""
    last = {}
    for n in names:
        done = events(cluster, n, "rendezvous_done")
        if done:
            last[n] = done[-1]
    rounds = {(e["round"], e["group_world_size"]) for e in last.values()}
    if len(rounds) != 1 or rounds.pop()[1] != world:
        return False
    running = {node for (node, _), rec in cluster.first.items()
               if node in last and rec["world"] == world
               and rec.get("wstart", 0) > last[node]["ts"]}
    return running == set(last) and len(last) == world


def lose_one(cluster: Cluster, case: Case, every: list[str], bound_s: float
             ) -> dict[str, Any]:
    """Once the world is steady (a re-formation in the window may still be under way: a
    node lost while the nodes exchange what they hold at a cycle's start is another
    measure), SIGKILL a node that does not host the store; time every survivor's way
    back."""
    target = every[case.nodes // 2]  # not the store's host (every[0])
    survivors = sorted(x for x in every if x != target)
    t0 = time.monotonic()
    if not cluster.wait(lambda: steady(cluster, every, case.nodes), bound_s):
        return {"error": f"the world of {case.nodes} was not steady within {bound_s:.0f} s"}
    out: dict[str, Any] = {"target": target, "settle_s": round(time.monotonic() - t0, 2),
                           "load_before": load()}
    t = cluster.lose_node(target, "kill")
    first = cluster.wait(lambda: cluster.world_formed(case.world_after, set(survivors),
                                                      after=t), bound_s)
    out["load_after"] = load()
    if first is None:
        out["error"] = f"no world of {case.world_after} within {bound_s:.0f} s of the loss"
    out["every_new_worker_s"] = round(first - t, 2) if first is not None else None
    out["new_worker_s"] = new_worker_delays(cluster, set(survivors), case.world_after, t)
    for key, ev in (("knew_s", "peers_waiting"), ("rendezvous_s", "rendezvous_done"),
                    ("workers_started_s", "workers_started")):
        out[key] = first_after(cluster, survivors, ev, t)
    out["survivors_whose_worker_failed"] = sorted(
        x for x in survivors
        if any(not e.get("stopped_by_launcher") for e in events(cluster, x, "worker_exited", t)))
    if case.spare:
        adm = events(cluster, "spare", "spare_admitted", t)
        out["spare_admitted_s"] = round(adm[0]["ts"] - t, 2) if adm else None
    return out


def new_worker_delays(cluster: Cluster, survivors: set[str], world: int, t: float
                      ) -> dict[str, float]:
    """Per survivor: seconds from ``t`` to the first step line of a worker started after
    ``t`` in a world of ``world``."""
    out: dict[str, float] = {}
    for (node, _), rec in cluster.first.items():
        if node in survivors and rec["world"] == world and rec.get("wstart", 0) > t:
            out[node] = round(min(out.get(node, rec["t"] - t), rec["t"] - t), 3)
    return dict(sorted(out.items()))


def run_case(case: Case, worker: str, base: Path, args: argparse.Namespace
             ) -> dict[str, Any]:
    """One case: up to ``--form-attempts`` starts, each on a fresh store and fresh
    launchers, until the world of N forms; then its measures."""
    res: dict[str, Any] = {"case": "spare" if case.spare else "nospare", "nodes": case.nodes,
                           "spare": case.spare, "nnodes": case.nnodes,
                           "backend": case.backend, "load_start": load(),
                           "failed_starts": [], "leftovers": []}
    for i in range(args.form_attempts):
        if run_attempt(case, worker, base / f"start{i}", args, res):
            break
    else:
        res["error"] = f"no world of {case.nodes} in {args.form_attempts} start(s)"
    res["load_end"] = load()
    if not res["leftovers"]:
        del res["leftovers"]
    return res


def run_attempt(case: Case, worker: str, base: Path, args: argparse.Namespace,
                res: dict[str, Any]) -> bool:
    """Start the nodes; when the world forms, measure it (True); False when it did not
    form. Every process is stopped by pid whatever happens."""
    w = WORKERS[worker]
    names = node_names(case.nodes)
    cluster = Cluster("ours", base, case.nnodes, f"scale-{case.label}",
                      ours_extra=(*OURS_EXTRA, *w.ours_extra),
                      env={**args.env, "STEP_S": w.step_s},
                      backend=case.backend, worker=w.script, poll_s=args.poll_s)
    try:
        if form_world(cluster, names, res, args) is None:
            return False
        every = [*names, "spare"] if case.spare else list(names)
        if case.spare and not add_spare(cluster, res):
            return True
        res["fault_free"] = fault_free(cluster, every, args.fault_free_s)
        log.info("%s: fault-free %s", case.label, summary(res["fault_free"]))
        res["loss"] = lose_one(cluster, case, every, args.bound)
        log.info("%s: loss -> every survivor's new worker %s s", case.label,
                 res["loss"].get("every_new_worker_s"))
        return True
    except TimeoutError as exc:
        res["error"] = str(exc)
        return True
    finally:
        res["worker_torch"] = torch_check(cluster)
        cluster.stop()
        left = cluster.leftovers()
        if left:
            log.error("%s: processes left: %s", case.label, left)
            res["leftovers"] += left


def torch_check(cluster: Cluster) -> dict[str, int]:
    """How many workers said, in their first step line, whether torch was imported in them
    (the light worker does), and how many had it."""
    said = [r["torch_imported"] for r in cluster.first.values() if "torch_imported" in r]
    return {"checked": len(said), "imported": sum(1 for x in said if x)}


def summary(ff: dict[str, Any]) -> str:
    per = ff["per_node"]
    others = [v["cpu_pct"] for k, v in per.items() if k != "n00" and v["cpu_pct"] is not None]
    med = f"{statistics.median(others):.2f}" if others else "?"
    return (f"restarts {ff['restarts']}, rounds {ff['rounds']}, store host "
            f"{per.get('n00', {}).get('cpu_pct')} % of a core, others {med} %, machine "
            f"{ff['machine_cpu_pct']} %, driver {ff['driver_cpu_pct']} %")


# -- the command -----------------------------------------------------------------------


def cases_of(nodes: list[int], backends: list[str], kinds: list[str]) -> list[Case]:
    """Every combination, the smaller N first, the backends side by side at each N."""
    return [Case(b, n, k == "spare") for n in nodes for b in backends for k in kinds]


def machine() -> dict[str, Any]:
    """The machine; torch's version read from its metadata (importing it would cost the
    driver 200 MB and seconds of CPU beside the launchers)."""
    return {"cpus": psutil.cpu_count(), "memory_gib": round(
        psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"), "open_files_limit": _nofile()}


def _nofile() -> list[int]:
    import resource

    return list(resource.getrlimit(resource.RLIMIT_NOFILE))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="16", help="comma-separated N, e.g. 16,64")
    ap.add_argument("--backends", default="c10d", help=f"comma-separated, of {BACKENDS}")
    ap.add_argument("--worker", choices=sorted(WORKERS), default="gloo")
    ap.add_argument("--cases", default="nospare,spare")
    ap.add_argument("--fault-free-s", type=float, default=20.0,
                    help="seconds the trained world is watched before the loss")
    ap.add_argument("--start-batch", type=int, default=0,
                    help="start the nodes after the store's host this many at a time, "
                         "each batch once the previous one joined (0: all at once)")
    ap.add_argument("--form-attempts", type=int, default=1,
                    help="starts to try, each on a fresh store, until the world of N forms "
                         "(a launcher that exits on the way ends a start)")
    ap.add_argument("--form-timeout", type=float, default=600.0,
                    help="seconds from the first spawn within which the world must form")
    ap.add_argument("--bound", type=float, default=300.0,
                    help="seconds from the loss within which the new world must run")
    ap.add_argument("--poll-s", type=float, default=0.2,
                    help="how often the driver reads the files (every record carries its "
                         "own time: this costs the driver's CPU, not precision)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "bench")
    ap.add_argument("--name", default="scale_nodes", help="writes NAME.json under --out")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for every launcher (and its worker); "
                         "recorded in the result")
    args = ap.parse_args(argv)
    if any("=" not in kv for kv in args.env):
        ap.error("--env: expected KEY=VALUE")
    args.env = dict(kv.split("=", 1) for kv in args.env)
    try:
        args.nodes = [int(x) for x in args.nodes.split(",") if x]
    except ValueError:
        ap.error(f"--nodes: expected comma-separated integers, got {args.nodes!r}")
    args.backends = [b for b in args.backends.split(",") if b]
    args.cases = [c for c in args.cases.split(",") if c]
    if not args.nodes or min(args.nodes) < 3:
        ap.error("--nodes: at least 3 each")
    if not args.backends or any(b not in BACKENDS for b in args.backends):
        ap.error(f"--backends: of {', '.join(BACKENDS)}")
    if not args.cases or any(c not in CASES for c in args.cases):
        ap.error(f"--cases: of {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    root = Path(tempfile.mkdtemp(prefix="scale-nodes-"))
    doc: dict[str, Any] = {
        "version": 2, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python scripts/scale_nodes.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(), "load_start": load(),
        "settings": {"worker": args.worker, "step_s": float(WORKERS[args.worker].step_s),
                     "ours_extra": [*OURS_EXTRA, *WORKERS[args.worker].ours_extra],
                     "fault_free_s": args.fault_free_s, "bound_s": args.bound,
                     "form_timeout_s": args.form_timeout, "start_batch": args.start_batch,
                     "form_attempts": args.form_attempts,
                     "env": args.env},
        "results": []}
    for case in cases_of(args.nodes, args.backends, args.cases):
        res = run_case(case, args.worker, root / case.label, args)
        doc["results"].append(res)
        log.info("%s: %s", case.label, json.dumps(brief(res)))
    doc["load_end"] = load()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all("error" not in r and "leftovers" not in r for r in doc["results"]) else 1


def brief(res: dict[str, Any]) -> dict[str, Any]:
    """A case's result without its per-node figures, for the log."""
    out = {k: v for k, v in res.items() if k not in ("fault_free", "loss")}
    if "fault_free" in res:
        out["fault_free"] = summary(res["fault_free"])
    if "loss" in res:
        out["loss"] = {k: v for k, v in res["loss"].items()
                       if not isinstance(v, dict)}
    return out


if __name__ == "__main__":
    sys.exit(main())
