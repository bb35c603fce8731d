"""The benchmark script runs end to end (tiny, ours only; never the Megatron comparison)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_rerun.py"


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--iters", "5", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "| VALIDATE_RESULTS |" in done.stdout
    result = json.loads(out.read_text())
    assert result["megatron"] is None
    medians = result["ours"]["medians_us"]
    assert set(medians) == {"bare", "DISABLED", "VALIDATE_RESULTS", "REPORT_DETERMINISM_STATS"}
    assert all(v > 0 for v in medians.values())
    assert result["ours"]["errors"] == {}
