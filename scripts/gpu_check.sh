#!/usr/bin/env bash
# Prove ft-launcher's CUDA paths on a GPU machine in a few minutes (one GPU is enough).
#
#   bash scripts/gpu_check.sh [--allow-skip] [--python PY] [--wheels DIR] [--out DIR]
#                             [--limit SECONDS] [-- extra pytest arguments]
#
# Runs the tests marked `gpu` (tests/rerun/test_rerun_cuda.py, tests/gpu/) and prints one
# line per check: PASS, FAIL, or SKIP with the reason, then the figures the checks measured.
# Exit status: 0 when every check passed (a 2-rank check skipped for want of a second GPU is
# fine); 1 when one failed or the run overran --limit (default 480 s); 2 when a check was
# skipped, e.g. on a machine without a CUDA device, so the script never passes without
# checking anything (--allow-skip makes skips acceptable); 3 when the set-up failed.
#
# Python: --python PY, else the active virtual environment, else ./.venv, else a python3
# that already has torch (a GPU image's own), else a new ./.venv with
# `pip install torch==2.13.0 -e '.[test,gpu]'`. Nothing beyond the test and gpu extras is
# installed, and only what is missing: the project itself with `pip install --no-deps -e .`
# (works offline), other modules with `pip install -e '.[test,gpu]'`. On a machine with no
# package index, --wheels DIR installs the wheels in DIR first (no index, no dependencies).
# The pytest log and junit XML are kept in --out (default ft_runs/gpu_check_<time>).

set -uo pipefail
cd "$(dirname "$0")/.." || exit 3

allow_skip=0
py=""
wheels=""
out=""
limit=480
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --allow-skip) allow_skip=1 ;;
        --python) py="$2"; shift ;;
        --wheels) wheels="$2"; shift ;;
        --out) out="$2"; shift ;;
        --limit) limit="$2"; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 3 ;;
    esac
    shift
done
case "$limit" in ''|*[!0-9]*) echo "gpu_check: --limit needs whole seconds" >&2; exit 3 ;; esac
out="${out:-ft_runs/gpu_check_$(date +%Y%m%d_%H%M%S)}"
mkdir -p "$out" || exit 3
started=$SECONDS

setup_fail() { echo "FAIL setup: $*"; exit 3; }

# -- the interpreter ----------------------------------------------------------------------
if [ -z "$py" ]; then
    if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
        py="$VIRTUAL_ENV/bin/python"
    elif [ -x .venv/bin/python ]; then
        py=.venv/bin/python
    elif command -v python3 >/dev/null && python3 -c 'import torch' 2>/dev/null; then
        py="$(command -v python3)"
    else
        echo "gpu_check: creating .venv (torch==2.13.0 and the test extras)"
        python3 -m venv .venv || setup_fail "python3 -m venv .venv"
        py=.venv/bin/python
        "$py" -m pip install -q torch==2.13.0 -e '.[test,gpu]' || setup_fail "pip install"
    fi
fi
"$py" -c 'import sys' 2>/dev/null || setup_fail "no Python at $py"
case "$py" in /*) ;; *) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac

if [ -n "$wheels" ]; then
    compgen -G "$wheels/*.whl" >/dev/null || setup_fail "no wheels in $wheels"
    "$py" -m pip install -q --no-index --no-deps "$wheels"/*.whl || setup_fail "wheels"
fi

missing() {  # the modules the checks need that this interpreter cannot import
    # From /: the workers run scripts outside the checkout's root, so the project must be
    # installed, not merely importable from the current directory.
    (cd / && "$py" - <<'EOF'
import importlib.util
need = ["torch", "pytest", "pytest_timeout", "zmq", "psutil", "click", "yaml", "numpy",
        "ft_launcher", "ft_agent", "rerun"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
    )
}
gone="$(missing)"
if [[ " $gone " == *" ft_launcher "* ]]; then
    "$py" -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1
    gone="$(missing)"
fi
if [ -n "$gone" ]; then
    echo "gpu_check: installing the test extras for: $gone"
    "$py" -m pip install -q -e '.[test,gpu]' >>"$out/pip.log" 2>&1
    gone="$(missing)"
fi
[ -z "$gone" ] || setup_fail "missing Python modules: $gone (see $out/pip.log; offline: --wheels DIR)"
if ! "$py" -c 'import pynvml' 2>/dev/null && ! command -v nvidia-smi >/dev/null; then
    echo "gpu_check: note: neither nvidia-ml-py nor nvidia-smi: the CUDA-context check will fail"
fi

# -- the machine ----------------------------------------------------------------------------
"$py" - <<'EOF'
import platform, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(n)) or "none"
print(f"gpu_check: python {platform.python_version()}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), {n} CUDA device(s): {gpus}")
EOF
echo "gpu_check: set-up took $((SECONDS - started)) s; log and junit XML in $out"

# -- the checks -----------------------------------------------------------------------------
# In its own session, so that on overrunning the limit the whole tree (pytest, the launchers
# it started) is stopped; workers die with their launcher.
tests_started=$SECONDS
setsid "$py" -m pytest -m gpu tests/rerun/test_rerun_cuda.py tests/gpu -v -rA \
    -p no:cacheprovider -o junit_family=xunit1 --junitxml="$out/junit.xml" \
    ${extra[@]+"${extra[@]}"} >"$out/pytest.log" 2>&1 &
pid=$!
timed_out=0
while kill -0 "$pid" 2>/dev/null; do
    if [ $((SECONDS - tests_started)) -ge "$limit" ]; then
        timed_out=1
        kill -TERM -- "-$pid" 2>/dev/null
        sleep 10
        kill -KILL -- "-$pid" 2>/dev/null
        break
    fi
    sleep 1
done
wait "$pid"
rc=$?
took=$((SECONDS - tests_started))

"$py" - "$out/junit.xml" "$rc" "$timed_out" "$allow_skip" "$took" "$limit" <<'EOF'
import sys
import xml.etree.ElementTree as ET

path, rc, timed_out, allow_skip, took, limit = sys.argv[1:]
EXPECTED_SKIP = "needs 2 GPUs"  # fine on a one-GPU machine
try:
    cases = list(ET.parse(path).getroot().iter("testcase"))
except (OSError, ET.ParseError) as exc:
    cases = []
    print(f"FAIL pytest: no junit report ({exc}); pytest exit code {rc}")
passed = failed = skipped = 0
bad_skip = False
for case in cases:
    # A module skipped at import (no CUDA device) is one case named after the module.
    where = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
    name = f"{where}::{case.get('name')}" if case.get("classname") else where
    secs = float(case.get("time") or 0)
    problem = case.find("failure")
    if problem is None:
        problem = case.find("error")
    skip = case.find("skipped")
    if problem is not None:
        failed += 1
        first = (problem.get("message") or problem.text or "").strip().splitlines()
        print(f"FAIL {name} ({secs:.1f} s): {first[0][:300] if first else ''}")
    elif skip is not None:
        skipped += 1
        reason = (skip.get("message") or "").strip()
        text = skip.text or ""
        if "Skipped: " in text:  # (file, line, 'Skipped: reason') for a module skip
            reason = text.split("Skipped: ", 1)[1].rstrip("')\"")
        expected = reason.startswith(EXPECTED_SKIP)
        bad_skip |= not expected
        print(f"SKIP {name}: {reason}" + (" (expected with one GPU)" if expected else ""))
    else:
        passed += 1
        print(f"PASS {name} ({secs:.1f} s)")
    for prop in case.iter("property"):
        print(f"     {prop.get('name')} = {prop.get('value')}")
status = 0
if timed_out == "1":
    print(f"FAIL gpu_check: the checks overran the {limit} s limit and were stopped")
    status = 1
elif failed or (rc not in ("0", "5") and not cases):
    status = 1
elif not cases or (bad_skip and allow_skip != "1"):
    status = 2
if not cases and status == 2:
    print("SKIP gpu_check: no check ran")
word = {0: "all checks passed" if passed and not bad_skip else "no failure (skips allowed)",
        1: "FAILED", 2: "NOT CHECKED (skips)"}[status]
print(f"gpu_check: {word}: {passed} passed, {failed} failed, {skipped} skipped in {took} s")
sys.exit(status)
EOF
status=$?
echo "gpu_check: pytest log: $out/pytest.log"
exit "$status"
