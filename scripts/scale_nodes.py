"""Scale, simulated: 16 ft_launchers of one rank each on loopback, one node lost.

    python scripts/scale_nodes.py [--nodes 16] [--sample-s 20] [--cases nospare,spare]

Each case starts N launchers (c10d; the first hosts the store), every one running
``bench/node_step_worker.py`` (a heartbeat through ft_agent and a gloo barrier of the whole
world every step). Once the world of N trains, it samples each launcher's CPU (% of one
core over ``--sample-s`` seconds) and memory (RSS, PSS) and the workers' memory, then
SIGKILLs one node that does not host the store (its launcher and worker) and times:

- loss → every survivor's launcher has a new round (its ``rendezvous_done``),
- loss → every rank of the new world has trained a step (``world_formed``).

``nospare``: ``--nnodes N-1:N``, the new world has N-1 ranks. ``spare``: ``--nnodes N:N``
and an (N+1)th launcher started once the world trains; it takes the lost node's place.
Results: a table on stdout, ``scale_nodes.json`` and ``scale_nodes.md`` under ``--out``.
Every process is stopped by pid (SIGCONT, SIGTERM, SIGKILL) when a case ends, whatever
happened.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from loopback_nodes import Cluster  # noqa: E402
from runner import JsonlTail  # noqa: E402

log = logging.getLogger("scale_nodes")
OURS_EXTRA = ("--workers-stop-timeout", "2")
MB = 2**20


def node_names(n: int) -> list[str]:
    return [f"n{i:02d}" for i in range(n)]


def sample(cluster: Cluster, names: list[str], seconds: float) -> dict[str, dict[str, Any]]:
    """Per node: its launcher's CPU % over ``seconds`` and RSS/PSS at the end; its
    workers' RSS/PSS. Steps go on meanwhile (the cluster is refreshed as it waits)."""
    procs = {n: cluster.node_processes(n) for n in names}
    before = {n: _cpu(ps[0]) for n, ps in procs.items() if ps}
    t0 = time.monotonic()
    cluster.wait(lambda: time.monotonic() - t0 >= seconds, seconds + 5)
    dt = time.monotonic() - t0
    out = {}
    for n, ps in procs.items():
        if not ps or n not in before:
            continue
        launcher, workers = ps[0], ps[1:]
        after = _cpu(launcher)
        mem = _mem(launcher)
        wmem = [_mem(w) for w in workers]
        out[n] = {"cpu_pct": round(100 * (after - before[n]) / dt, 2) if after else None,
                  "rss_mb": mem[0], "pss_mb": mem[1],
                  "workers_rss_mb": round(sum(m[0] or 0 for m in wmem), 1),
                  "workers_pss_mb": round(sum(m[1] or 0 for m in wmem), 1)}
    return out


def _cpu(p: psutil.Process) -> float | None:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


def _mem(p: psutil.Process) -> tuple[float | None, float | None]:
    try:
        m = p.memory_full_info()
        return round(m.rss / MB, 1), round(m.pss / MB, 1)
    except psutil.Error:
        return None, None


def events_after(cluster: Cluster, name: str, event: str, t: float) -> list[dict[str, Any]]:
    path = cluster.base / name / "ft" / "events.jsonl"
    return [e for e in JsonlTail(path).read() if e.get("event") == event and e["ts"] > t]


def run_case(case: str, n: int, base: Path, sample_s: float, bound_s: float) -> dict[str, Any]:
    spare = case == "spare"
    names = node_names(n)
    res: dict[str, Any] = {"case": case, "nodes": n, "spare": spare,
                           "nnodes": f"{n}:{n}" if spare else f"{n - 1}:{n}",
                           "load_start": _load()}
    cluster = Cluster("ours", base, res["nnodes"], f"scale-{case}", ours_extra=OURS_EXTRA,
                      env={"STEP_S": "0.2"})
    try:
        t0 = time.time()
        cluster.start_host_first(names, 300)
        formed = cluster.wait(lambda: cluster.world_formed(n, set(names)), 600)
        if formed is None:
            res["error"] = f"the world of {n} did not form within 600 s"
            return res
        res["start_to_world_s"] = round(formed - t0, 1)
        log.info("%s: world of %d trains %.1f s after the first start", case, n, formed - t0)
        every = list(names)
        if spare:
            cluster.start("spare")
            every.append("spare")
            if cluster.wait(lambda: cluster.connected_to_store("spare"), 300) is None:
                res["error"] = "the spare never reached the store"
                return res
            time.sleep(3.0)
        res["load_sampling"] = _load()
        t_s = time.time()
        res["per_node"] = sample(cluster, every, sample_s)
        res["steps_per_s"] = round(cluster.steps_since(names[0], t_s) / (time.time() - t_s), 2)
        res["mem_available_gib"] = round(psutil.virtual_memory().available / 2**30, 1)
        target = names[n // 2]  # not the store's host (names[0])
        survivors = {x for x in every if x != target}
        world = n if spare else n - 1
        res["target"] = target
        t = cluster.lose_node(target, "kill")
        first = cluster.wait(lambda: cluster.world_formed(world, survivors, after=t), bound_s)
        res["load_end"] = _load()
        if first is None:
            res["error"] = f"no world of {world} within {bound_s:.0f} s of the loss"
        else:
            res["loss_to_first_step_s"] = round(first - t, 2)
        rdzv = [events_after(cluster, x, "rendezvous_done", t) for x in sorted(survivors)]
        if all(rdzv):
            res["loss_to_every_rendezvous_s"] = round(max(e[0]["ts"] for e in rdzv) - t, 2)
            res["loss_to_first_rendezvous_s"] = round(min(e[0]["ts"] for e in rdzv) - t, 2)
        started = [events_after(cluster, x, "workers_started", t) for x in sorted(survivors)]
        if all(started):
            res["loss_to_every_workers_started_s"] = round(
                max(e[0]["ts"] for e in started) - t, 2)
        exits = [events_after(cluster, x, "worker_exited", t) for x in sorted(survivors)]
        res["survivors_whose_worker_failed"] = sum(1 for e in exits if e)
        if spare:
            adm = events_after(cluster, "spare", "spare_admitted", t)
            res["loss_to_spare_admitted_s"] = round(adm[0]["ts"] - t, 2) if adm else None
        return res
    finally:
        cluster.stop()
        left = cluster.leftovers()
        if left:
            log.error("%s: processes left: %s", case, left)
            res["leftovers"] = left


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _stats(values: list[float]) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "—"
    return f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| case | world before → after | loss → every survivor's new round | loss → "
             "first step of the new world | launcher CPU, % of a core: host / others "
             "median (min–max) | launcher PSS MB: host / others | launcher RSS MB: others "
             "| worker PSS MB | load (1, 5, 15 min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        per = r.get("per_node", {})
        host = per.get("n00", {})
        others = [v for k, v in per.items() if k != "n00"]
        after = r["nodes"] if r["spare"] else r["nodes"] - 1
        spare = " + a spare" if r["spare"] else ""
        rdzv = r.get("loss_to_every_rendezvous_s")
        first = r.get("loss_to_first_step_s")
        lines.append(
            f"| `--nnodes {r['nnodes']}`{spare} | {r['nodes']} → {after} | "
            f"{f'{rdzv:.1f} s' if rdzv is not None else '—'} | "
            f"{f'{first:.1f} s' if first is not None else r.get('error', '—')} | "
            f"{host.get('cpu_pct', '—')} / {_stats([o['cpu_pct'] for o in others])} | "
            f"{host.get('pss_mb', '—')} / {_stats([o['pss_mb'] for o in others])} | "
            f"{_stats([o['rss_mb'] for o in others])} | "
            f"{_stats([o['workers_pss_mb'] for o in others if o['workers_pss_mb']])} | "
            f"{r.get('load_sampling', r['load_start'])} → {r.get('load_end', '?')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--sample-s", type=float, default=20.0)
    ap.add_argument("--bound", type=float, default=300.0,
                    help="seconds from the loss within which the new world must train")
    ap.add_argument("--cases", default="nospare,spare")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "bench")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if args.nodes < 3 or any(c not in ("nospare", "spare") for c in cases):
        ap.error("--nodes at least 3; --cases of nospare,spare")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    root = Path(tempfile.mkdtemp(prefix="scale-nodes-"))
    results = []
    for case in cases:
        results.append(run_case(case, args.nodes, root / case, args.sample_s, args.bound))
        log.info("%s: %s", case, json.dumps({k: v for k, v in results[-1].items()
                                             if k != "per_node"}))
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python scripts/scale_nodes.py " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "cpus": psutil.cpu_count(), "memory_gib": round(psutil.virtual_memory().total
                                                            / 2**30, 1),
           "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_nodes.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown(results)
    (args.out / "scale_nodes.md").write_text(
        f"- date: {doc['date']}; {doc['cpus']} CPUs, {doc['memory_gib']} GiB\n"
        f"- command: `{doc['command']}`\n\n{table}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
