"""The launcher's own stalls and floods never kill a healthy rank (issue 11, item 1).

A rank that heartbeats the whole time while the launcher is SIGSTOPped (a VM pause, CPU
starvation) must not be judged hung at the launcher's wake-up, and neither must a rank whose
own heartbeats wait behind a burst. The rules are unit-tested on a fake clock in
test_liveness.py; these prove the wiring with a real launcher, worker and socket.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from launch_helpers import (
    NO_PRELOADS,
    ROOT,
    SCRIPTS,
    events,
    launcher_cmd,
    named,
    run_launcher,
    wait_for,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]
CASES = str(SCRIPTS / "monitor_cases.py")
RUNS = int(os.environ.get("FT_STALL_RUNS", "1"))  # scripts: FT_STALL_RUNS=20 for the target


@pytest.mark.parametrize("run", range(RUNS))
def test_a_stopped_launcher_does_not_judge_a_rank_that_kept_heartbeating(run, tmp_path):
    run_dir = tmp_path / f"run{run}"
    proc = subprocess.Popen(
        launcher_cmd(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", "--max-restarts", "0",
                     "--ft-rank-heartbeat-timeout", "2", CASES, "steady"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "STEADY_S": "9"})
    try:
        wait_for(lambda: named(events(run_dir), "rank_connected"), 60, "the rank's hello")
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(5.0)  # 2.5 x the heartbeat timeout
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=90)
    finally:
        os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else None
        proc.kill()
        proc.communicate()
    evs = events(run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert not named(evs, "hang_detected"), out[-3000:]
    stalls = named(evs, "launcher_stalled")
    assert stalls and stalls[0]["late_s"] >= 2.0


def test_a_rank_behind_its_own_burst_is_not_judged(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", "--max-restarts", "0",
                       "--ft-rank-heartbeat-timeout", "1", CASES, "burst")
    assert res.returncode == 0, res.stdout[-3000:]
    assert not named(events(run_dir), "hang_detected")
