#!/usr/bin/env bash
# Run the test suite N times in a row (default 3) while busy loops keep every core busy,
# to prove the suite's timing bounds hold on a loaded machine. Extra arguments go to pytest
# (e.g. -m "not slow" for the fast tier). Prints each run's result and duration, and the
# failed tests of a failed run; each run's whole log is kept in a fresh directory under /tmp
# (printed first). Exits non-zero when any run failed.
#
#   scripts/suite_under_load.sh            # the whole suite, 3 times, under load
#   RUNS=1 scripts/suite_under_load.sh -m "not slow"
set -u
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
cores=$(nproc)
burners=()
cleanup() { for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null; done; }
trap cleanup EXIT INT TERM
for _ in $(seq "$cores"); do
  # nice 0, like any other job on the machine: the suite competes for every core.
  python3 -c 'while True: pass' &
  burners+=("$!")
done
logs=$(mktemp -d /tmp/suite_under_load.XXXXXX)
echo "load: ${#burners[@]} busy loops on $cores cores; logs in $logs"
failed=0
for i in $(seq "$runs"); do
  start=$(date +%s)
  log="$logs/run_$i.log"
  if python -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1; then
    status=passed
  else
    status=FAILED; failed=1
  fi
  # The load average at the end: the busy loops and the suite count 2 + its share, more
  # means other work on the machine too.
  echo "run $i: $status in $(( $(date +%s) - start )) s ($(tail -n 1 "$log")); load" \
    "$(cut -d' ' -f1-3 /proc/loadavg)"
  grep -E '^(FAILED|ERROR) ' "$log" || true
done
exit "$failed"
