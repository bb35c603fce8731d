"""The timeline page rendered by a real headless browser (Debian's chromium).

Chromium is required: where the tests run as root (CI, which installs it with apt-get) a
missing chromium fails the test; elsewhere it is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_ledger import killed_then_finished

from ft_launcher.observe.timeline import SKIPPED

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str:
    path = next((p for b in BROWSERS if (p := shutil.which(b))), None)
    if path:
        return path
    msg = "chromium not found (apt-get install -y chromium)"
    if os.geteuid() == 0:
        pytest.fail(msg + ": CI installs it, so its absence is an error here")
    pytest.skip(msg + "; not root, so it cannot be installed here")


def headless(browser: str, profile: Path, *args: str, timeout: float = 90) -> str:
    """Run chromium headless in its own session; kill its whole group on a timeout."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        try:  # renderer or zygote children left in the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"chromium exited {proc.returncode}"
    return out


@pytest.mark.slow
def test_timeline_renders_lanes_marks_phases_and_ledger(tmp_path: Path):
    browser = find_chromium()
    run = tmp_path / "run"
    run.mkdir()
    records = killed_then_finished().records
    (run / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = tmp_path / "timeline.html"
    subprocess.run([str(Path(sys.executable).parent / "ft_report"), str(run), "--html",
                    str(page)], check=True, capture_output=True, timeout=60)
    dom = headless(browser, tmp_path / "profile", "--dump-dom", page.as_uri())

    lanes = re.findall(r'class="ytick"[^>]*>.*?>([^<]*)</text>', dom)
    assert sorted(lanes) == ["launcher", "phases", "rank 0", "rank 1"]
    legend = re.findall(r'class="legendtext"[^>]*>([^<]*)<', dom)
    kinds = {r["event"] for r in records} - SKIPPED
    assert kinds <= set(legend), kinds - set(legend)
    assert {"productive time", "work_lost time", "detection time", "teardown time",
            "spawn time"} <= set(legend)
    # One drawn point per mark (an event with several ranks has one per rank lane) and per
    # phase bar: nothing was dropped on the way to the screen.
    marks = sum(len(r["ranks"]) if r["event"] == "workers_started" else 1
                for r in records if r["event"] not in SKIPPED)
    phase_bars = 7 + 4  # cycle 0: all 7 phases; cycle 1: no work lost, detection, teardown
    assert len(re.findall(r'class="point"', dom)) == marks + phase_bars
    # The shaded phases behind the lanes, and the ledger table beside them.
    assert dom.count('class="shapelayer"') >= 1
    cells = re.findall(r'class="cell-text"[^>]*>(.*?)</text>', dom)
    text = " ".join(re.sub("<[^>]+>", " ", c) for c in cells)
    assert "goodput ledger" in text and "work lost" in text and "60.4%" in text

    shot = tmp_path / "shot.png"
    headless(browser, tmp_path / "profile", "--hide-scrollbars", "--window-size=1500,700",
             f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
