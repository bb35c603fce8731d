#!/usr/bin/env bash
# A clean run of 8 gloo ranks under ft_launcher for SECONDS (default 300): no rank is slowed,
# so no straggler may be reported, however noisy the machine (issue 14).
#
#   scripts/straggler_soak.sh [SECONDS] [RUN_DIR]
#
# Prints the launcher's straggler events, and replays every rank's logged compute times
# through StragglerDetector with the launcher's settings (threshold 1.3, window 20,
# persistence 0.7, 5 warm-up steps): the transitions it would report and the highest score
# it saw; then, for comparison, what the score alone (persist=0, the rule before issue 14's
# persistence) would have reported. Exit 1 when the launcher or the replay with the
# launcher's settings reports a straggler. The training leaves the CPU idle 50 ms per step (as a data loader would), so
# the 2 cores are not pinned at 100 % for the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-300}"
run="${2:-ft_runs/straggler-soak-$(date +%Y%m%d-%H%M%S)}"
python=${PYTHON:-python}
mkdir -p "$run"
echo "straggler soak: 8 ranks, ${seconds} s, run dir $run"
"$python" -m ft_launcher.cli --ft-run-dir "$run" --nproc-per-node 8 -r 3 \
    tests/scripts/straggler_train.py "$run/steps" --seconds "$seconds" --idle 0.05
"$python" - "$run" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

from ft_launcher.stragglers.straggler import StragglerDetector, speed_table

run = Path(sys.argv[1])
events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
reported = [e for e in events if e["event"] in ("straggler_detected", "straggler_cleared")]
print(f"launcher's straggler events: {len(reported)}")
for e in reported:
    print("  ", {k: e[k] for k in ("event", "rank", "score", "steps") if k in e})
logs = {}
for path in sorted((run / "steps").glob("cycle_0_rank_*.txt")):
    rank = int(path.stem.rsplit("_", 1)[1])
    logs[rank] = [float(line.split()[2]) for line in path.read_text().splitlines()]
steps = min(len(v) for v in logs.values())


def replay(**settings):
    detector = StragglerDetector(warmup_steps=5, **settings)
    transitions, seen = [], []
    for step in range(steps):
        for rank, times in logs.items():
            detector.observe(rank, "compute", times[step])
        transitions += [(step, e) for e in detector.evaluate()]
        seen += detector.scores().values()
    return transitions, seen


replayed, scores = replay()
print(f"replay: {len(logs)} ranks x {steps} steps; transitions: {len(replayed)}")
for step, e in replayed:
    print(f"   step {step}: {e.event} rank {e.rank} score {e.score:.2f}")
median_only, _ = replay(persist=0)
print(f"the score alone (persist=0) would report: "
      f"{sum(e.event == 'straggler_detected' for _, e in median_only)}")
if scores:
    ordered = sorted(scores)
    print(f"scores: median {statistics.median(ordered):.3f}, "
          f"p99 {ordered[int(0.99 * (len(ordered) - 1))]:.3f}, max {ordered[-1]:.3f}")
medians = {r: statistics.median(t) for r, t in logs.items()}
print("median compute s per rank:", {r: round(m, 4) for r, m in sorted(medians.items())})
for row in speed_table(events):
    print("  ", row)
sys.exit(1 if reported or replayed else 0)
EOF
