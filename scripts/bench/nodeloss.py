"""Node loss, side by side: ft_launcher against torchrun on the same c10d scenarios.

    python scripts/bench/nodeloss.py [--trials 5] [--quick] [--out DIR] [--resume JSON]

For each launcher (ours, torchrun) x lost node (a: a node that does not host the store;
b: the store's host; c: a frozen node, SIGSTOP of its launcher and workers) x spare (no:
``--nnodes 1:2``; yes: ``--nnodes 2:2`` and a third launcher started once the world of 2
trains), N=2 (+1) launchers start on loopback with one rank each, running
``node_step_worker.py`` (a gloo barrier and a heartbeat per step). After the world of 2 has
trained a few seconds the target node is killed (the launcher and every process under it)
or frozen, and the driver waits for the new world: every rank of it (1 rank without a
spare, 2 with) has logged a step from a worker started after the loss. The figure is loss
→ that step; a trial that does not get there within ``--bound`` seconds (or whose every
surviving launcher exits) is a failure, with the reason. Trials are interleaved (trial i of
every cell before trial i+1 of any; the launcher that goes first alternates).

Writes ``nodeloss.json`` (every trial, the load average at its start) and ``nodeloss.md``
(the table: median (min–max) over successes, successes out of trials) under ``--out``.
Every process of a trial is stopped by pid when the trial ends, whatever happened.
``--resume`` takes an earlier run's ``nodeloss.json`` and runs only the trials it lacks up
to ``--trials`` (its trials keep their own load averages; the date and command say both).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback_nodes import LAUNCHERS, Cluster  # noqa: E402

log = logging.getLogger("bench.nodeloss")

SCENARIOS = {
    "a": "a node that does not host the store, SIGKILLed",
    "b": "the store's host, SIGKILLed",
    "c": "a node frozen (SIGSTOP of its launcher and workers)",
}
# ours: hang detection on (what the launcher is for): a rank silent 10 s is a hang. The
# worker's gloo timeout (30 s) is the same under both launchers.
OURS_EXTRA = ("--workers-stop-timeout", "2", "--ft-rank-heartbeat-timeout", "10",
              "--ft-initial-rank-heartbeat-timeout", "180")


@dataclass(frozen=True)
class Cell:
    launcher: str
    scenario: str  # a, b, c
    spare: bool

    @property
    def title(self) -> str:
        return f"{self.launcher}/{self.scenario}/{'spare' if self.spare else 'no spare'}"


@dataclass
class Trial:
    launcher: str
    scenario: str
    spare: bool
    trial: int
    ok: bool = False
    recovery_s: float | None = None
    note: str = ""
    loadavg: str = ""
    t_loss: float | None = None
    exit_codes: dict[str, int | None] | None = None


@dataclass(frozen=True)
class Settings:
    trials: int
    bound_s: float
    train_s: float
    start_s: float


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_trial(cell: Cell, i: int, base: Path, st: Settings) -> Trial:
    """One trial of one cell; every process it started is stopped before it returns."""
    res = Trial(cell.launcher, cell.scenario, cell.spare, i, loadavg=loadavg())
    names = ["a", "b", "c"] if cell.spare else ["a", "b"]
    cluster = Cluster(cell.launcher, base, "2:2" if cell.spare else "1:2",
                      f"nl-{cell.launcher}-{cell.scenario}-{int(cell.spare)}-{i}",
                      ours_extra=OURS_EXTRA if cell.launcher == "ours" else ())
    try:
        _drive(cluster, cell, names, st, res)
    except Exception as exc:  # a trial that breaks is a failed trial, not a failed bench
        log.exception("%s trial %d", cell.title, i)
        res.ok, res.note = False, f"driver error: {exc}"
    finally:
        cluster.stop()
        left = cluster.leftovers()
        if left:
            log.error("%s trial %d: processes left: %s", cell.title, i, left)
            res.note += f" (processes left: {left})"
    return res


def _drive(cluster: Cluster, cell: Cell, names: list[str], st: Settings, res: Trial) -> None:
    cluster.start_host_first(names[:2], st.start_s)
    formed = cluster.wait(lambda: cluster.world_formed(2, {"a", "b"}), st.start_s)
    if formed is None:
        res.note = f"the world of 2 did not form within {st.start_s:.0f} s"
        return
    if cell.spare:
        cluster.start("c")
        # The spare has joined once its launcher holds a connection to the store; a little
        # more for it to read the full round and wait on the redundancy list.
        if cluster.wait(lambda: cluster.connected_to_store("c"), st.start_s) is None:
            res.note = "the spare never reached the store"
            return
        time.sleep(2.0)
    t_train = time.time()
    cluster.wait(lambda: time.time() - t_train >= st.train_s, st.train_s + 5)
    if min(cluster.steps_since(n, t_train) for n in ("a", "b")) == 0:
        res.note = "the world of 2 stopped training before the loss"
        return
    target = "a" if cell.scenario == "b" else "b"
    survivors = {n for n in names if n != target}
    world = 2 if cell.spare else 1
    res.t_loss = t = cluster.lose_node(target, "freeze" if cell.scenario == "c" else "kill")
    log.info("%s trial %d: %s lost at %.3f", cell.title, res.trial, target, t)

    def done() -> str | float | None:
        first = cluster.world_formed(world, survivors, after=t)
        if first is not None:
            return first
        if all(cluster.exited(n) is not None for n in survivors):
            return "exited"
        return None

    got = cluster.wait(done, st.bound_s)
    res.exit_codes = {n: cluster.exited(n) for n in names}
    if isinstance(got, float):
        res.ok, res.recovery_s = True, round(got - t, 3)
    elif got == "exited":
        codes = ", ".join(f"{n}: {res.exit_codes[n]}" for n in sorted(survivors))
        res.note = f"every surviving launcher exited ({codes})"
    else:
        res.note = f"no new world within {st.bound_s:.0f} s"


# -- summary and table -----------------------------------------------------------------


def summarize(trials: list[Trial], cells: list[Cell]) -> list[dict[str, Any]]:
    rows = []
    for cell in cells:
        mine = [t for t in trials if (t.launcher, t.scenario, t.spare) ==
                (cell.launcher, cell.scenario, cell.spare)]
        ok = [t.recovery_s for t in mine if t.ok and t.recovery_s is not None]
        row: dict[str, Any] = {**asdict(cell), "n": len(mine), "n_ok": len(ok),
                               "samples": [t.recovery_s for t in mine],
                               "notes": sorted({t.note for t in mine if not t.ok and t.note})}
        if ok:
            row.update(min=min(ok), median=statistics.median(ok), max=max(ok))
        rows.append(row)
    return rows


def _cell_text(row: dict[str, Any]) -> str:
    if not row["n"]:
        return "—"
    head = f"{row['n_ok']}/{row['n']}"
    if row["n_ok"]:
        head += f": {row['median']:.1f} s ({row['min']:.1f}–{row['max']:.1f})"
    if row["notes"]:
        head += "; failed: " + "; ".join(row["notes"])
    return head


def markdown(doc: dict[str, Any]) -> str:
    by = {(r["launcher"], r["scenario"], r["spare"]): r for r in doc["rows"]}
    lines = [
        "| node lost | spare | ours: successes, loss → first step of the new world | "
        "torchrun: same |",
        "|---|---|---|---|",
    ]
    for sc in SCENARIOS:
        for spare in (False, True):
            world = "`2:2` + a spare: world of 2" if spare else "`1:2`: world of 1"
            cells = [_cell_text(by[(x, sc, spare)]) if (x, sc, spare) in by else "—"
                     for x in LAUNCHERS]
            lines.append(f"| ({sc}) {SCENARIOS[sc]} | {world} | " + " | ".join(cells) + " |")
    m = doc["machine"]
    head = [
        f"- date: {doc['date']}; machine: {m['cpus']} CPUs, {m['memory_gib']} GiB, "
        f"Python {m['python']}, torch {m['torch']}",
        f"- command: `{doc['command']}` ({doc['settings']['trials']} trials per cell, "
        f"interleaved; bound {doc['settings']['bound_s']:.0f} s)",
        f"- load average (1, 5, 15 min) at the trials' starts: {doc['load_range']}",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def machine() -> dict[str, Any]:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "memory_gib": round(mem, 1),
            "python": platform.python_version(), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="one trial of each cell, shorter training")
    ap.add_argument("--bound", type=float, default=90.0,
                    help="seconds from the loss within which the new world must train [90]")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("--scenarios", default="abc")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--keep", action="store_true", help="keep the trials' directories")
    ap.add_argument("--resume", type=Path, help="an earlier nodeloss.json to complete")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    launchers = [x for x in args.launchers.split(",") if x]
    bad = [x for x in launchers if x not in LAUNCHERS] + \
        [s for s in args.scenarios if s not in SCENARIOS]
    if bad or args.trials < 1:
        ap.error(f"--launchers takes {','.join(LAUNCHERS)}, --scenarios letters of "
                 f"{''.join(SCENARIOS)}, --trials at least 1; got {bad or args.trials}")
    st = Settings(trials=1 if args.quick else args.trials, bound_s=args.bound,
                  train_s=2.0 if args.quick else 4.0, start_s=180.0)
    cells = [Cell(x, sc, sp) for sc in args.scenarios for sp in (False, True)
             for x in launchers]
    root = Path(tempfile.mkdtemp(prefix="nodeloss-"))
    trials: list[Trial] = []
    command = "python scripts/bench/nodeloss.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.resume is not None:
        earlier = json.loads(args.resume.read_text())
        trials = [Trial(**t) for t in earlier["trials"]]
        date, command = f"{earlier['date']}, then {date}", f"{earlier['command']}, then {command}"
    doc: dict[str, Any] = {"date": date, "command": command,
                           "machine": machine(), "settings": asdict(st),
                           "scenarios": SCENARIOS, "ours_extra": list(OURS_EXTRA)}
    try:
        for i in range(st.trials):
            order = cells if i % 2 == 0 else [Cell(c.launcher, c.scenario, c.spare)
                                              for c in _swap(cells)]
            for cell in order:
                if any((t.launcher, t.scenario, t.spare, t.trial) ==
                       (cell.launcher, cell.scenario, cell.spare, i) for t in trials):
                    continue  # done in the run resumed
                base = root / f"{cell.launcher}-{cell.scenario}-{int(cell.spare)}-{i}"
                t = run_trial(cell, i, base, st)
                trials.append(t)
                log.info("%s trial %d: %s", cell.title, i,
                         f"{t.recovery_s:.2f} s" if t.ok else f"FAILED ({t.note})")
                _write(args.out, doc, trials, cells)
    finally:
        _write(args.out, doc, trials, cells)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(markdown({**doc, "rows": summarize(trials, cells),
                    "load_range": _load_range(trials)}))
    return 0


def _swap(cells: list[Cell]) -> list[Cell]:
    """The same cells with the launcher order reversed within each scenario pair."""
    out = []
    for k in range(0, len(cells), len(LAUNCHERS)):
        out += list(reversed(cells[k:k + len(LAUNCHERS)]))
    return out


def _load_range(trials: list[Trial]) -> str:
    ones = [float(t.loadavg.split()[0]) for t in trials if t.loadavg[:1].isdigit()]
    return f"{min(ones):.1f} to {max(ones):.1f} (1-minute)" if ones else "?"


def _write(out: Path, doc: dict[str, Any], trials: list[Trial], cells: list[Cell]) -> None:
    full = {**doc, "trials": [asdict(t) for t in trials], "rows": summarize(trials, cells),
            "load_range": _load_range(trials)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "nodeloss.json").write_text(json.dumps(full, indent=1) + "\n")
    (out / "nodeloss.md").write_text(markdown(full))


if __name__ == "__main__":
    sys.exit(main())
