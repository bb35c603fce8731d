"""What the launcher leaves behind when it exits cleanly: nothing. Run under a child
subreaper, as under a PID 1 that does not reap (a container's shell, a benchmark harness),
every process the launcher started and did not reap would show up as its child."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import ROOT, SCRIPTS, launcher_cmd

SUBREAPER = str(SCRIPTS / "subreaper_run.py")


def run_under_subreaper(run_dir: Path, *args: str, watch_s: float = 2.0) -> dict:
    cmd = [sys.executable, SUBREAPER, str(watch_s), *launcher_cmd(run_dir, *args)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("extra", [["--no-ft-warm-restart"], ["--ft-preload", "json"], []],
                         ids=["cold", "warm-restart", "defaults"])
def test_a_clean_exit_leaves_no_process_behind(run_dir: Path, extra: list[str]):
    """Two workers that exit 0: afterwards no process of the launcher's (the guardian
    included; with warm restart, the default, the zygote and the standbys too) is left,
    running or as a zombie."""
    out = run_under_subreaper(run_dir, "--nproc-per-node", "2", *extra,
                              str(SCRIPTS / "env_dump.py"))
    assert out["returncode"] == 0
    assert out["leftovers"] == [], out["leftovers"]
