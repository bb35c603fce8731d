"""Warm restart against a cold restart, as a user's faults come (issue 17).

    python scripts/bench/warm_restart.py                 # 5 interleaved repeats
    python scripts/bench/warm_restart.py --repeat 3 --only crash2,clean

Measures (ours-cold = cold restarts, --no-ft-warm-restart; ours-warm = --ft-warm-restart
with the zygote; ours = the launcher's defaults, warm restart on; the JSON files committed
before warm restart became the default name the cold launcher ours):

(ours-store = ours-cold with --ft-agent-store: a store-only zygote hosts each cycle's TCPStore.)

- crash2: SIGKILL of rank 1 2 s after every rank's first step, then again 2 s after the
  restarted cycle's first step; SIGKILL -> first step of every rank for each, and whether
  each restart was warm (nothing waits for standbys);
- hang: SIGSTOP of rank 1 2 s after every rank's first step; the hang verdict (at the
  heartbeat timeout) -> first step of every rank of the next cycle;
- clean: the fault-free training of the main benchmark (wall time, start-up);
- memory: PSS of all standby processes (zygote + forks), and of those plus the launcher,
  with 8 local ranks, against one interpreter that imported the same preloads, in the same
  run (ours, the defaults, only).

Runs of one measure alternate between the launchers; medians are printed and everything
goes to ``--out`` as JSON. Every process started is ended by pid.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measures  # noqa: E402
from bench import machine_info  # noqa: E402
from measures import COLD, STORE, WARM, Context, Launchers, Settings  # noqa: E402

MEASURES = ("crash2", "hang", "clean", "memory")


def _median(values: list[Any]) -> float | None:
    nums = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(nums), 3) if nums else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", default=",".join(MEASURES))
    p.add_argument("--out", default="warm_restart_results.json")
    p.add_argument("--preload", default=measures.WARM_PRELOAD, help="ours-warm's --ft-preload")
    p.add_argument("--launchers", default=f"{COLD},{WARM}", help="for crash2 and clean")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    only = [m for m in args.only.split(",") if m]
    settings = Settings(warm_preload=args.preload)
    ctx = Context(Launchers.default(), settings, Path(tempfile.mkdtemp(prefix="ftw-")))
    pair = tuple(x for x in (COLD, "ours", STORE, WARM) if x in args.launchers.split(","))
    command = " ".join(["python scripts/bench/warm_restart.py",
                        *(sys.argv[1:] if argv is None else argv)])
    doc: dict[str, Any] = {"machine": machine_info(), "started": time.time(),
                           "command": command, "runs": {}}
    plan = [("crash2", measures.crash_twice, pair),
            ("hang", measures.hang_restart, pair),
            ("clean", measures.clean, pair),
            ("memory", measures.standby_memory, ("ours",))]
    try:
        for name, func, launchers in plan:
            if name not in only:
                continue
            repeat = 1 if name == "memory" else args.repeat
            for i in range(repeat):
                for launcher in launchers:
                    tag = f"{name}-{launcher}-{i}"
                    result = func(ctx, launcher, tag)
                    logging.info("%s: %s", tag, result)
                    doc["runs"].setdefault(name, {}).setdefault(launcher, []).append(result)
    finally:
        leftovers = [pid for run in ctx.runs for pid in run.leftovers()]
        shutil.rmtree(ctx.root, ignore_errors=True)
    doc["leftovers"] = leftovers
    summary: dict[str, Any] = {}
    for name, per in doc["runs"].items():
        for launcher, runs in per.items():
            keys = {k for r in runs for k, v in r.items() if isinstance(v, (int, float))}
            summary[f"{name}/{launcher}"] = {k: _median([r.get(k) for r in runs])
                                             for k in sorted(keys)}
    doc["medians"] = summary
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
