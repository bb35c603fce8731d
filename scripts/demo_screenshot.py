#!/usr/bin/env python3
"""Regenerate the README's timeline picture: run the demo, render its timeline with
``ft_report --html``, and screenshot the page with headless chromium.

    python scripts/demo_screenshot.py [--out docs/timeline.png] [--keep-run-dir]

Needs the ``report`` extra (plotly) and chromium (``apt-get install -y chromium``). Takes
about a minute on 2 cores. Every process it starts is waited for or killed by its group.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The README's demo (2 ranks of DDP on CPU, rank 1 SIGKILLed 10 s after every rank is
# training), run longer so the kill lands mid-training even on a slow, busy machine.
DEMO = ["--nproc-per-node", "2", "--max-restarts", "3", "--ft-rank-heartbeat-timeout", "10",
        "--ft-simulated-fault", "rank_killed:base_delay=10,rank=1",
        str(ROOT / "examples" / "train_ddp.py"), "--steps", "800", "--step-time", "0.02"]


def run_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a command in its own process group; kill the whole group if it overruns."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"{cmd[0]} did not finish within {timeout:.0f} s") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # chromium's helpers, if any are left
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "timeline.png")
    parser.add_argument("--width", type=int, default=1500)
    parser.add_argument("--height", type=int, default=None,
                        help="Window height [the figure's own height].")
    parser.add_argument("--keep-run-dir", action="store_true",
                        help="Keep the demo's run directory and page (printed at the end).")
    args = parser.parse_args()
    browser = next((p for b in ("chromium", "chromium-browser", "google-chrome")
                    if (p := shutil.which(b))), None)
    if browser is None:
        return print("chromium not found: apt-get install -y chromium", file=sys.stderr) or 2

    work = Path(tempfile.mkdtemp(prefix="ft_demo_"))
    run_dir, page = work / "demo", work / "timeline.html"
    demo = run_group([str(BIN / "ft_launcher"), "--ft-run-dir", str(run_dir), *DEMO],
                     timeout=300, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True)
    print("\n".join(demo.stdout.splitlines()[-5:]))
    if demo.returncode != 0:
        print(f"the demo exited {demo.returncode}; run dir kept: {run_dir}", file=sys.stderr)
        return 1
    report = run_group([str(BIN / "ft_report"), str(run_dir), "--html", str(page)],
                       timeout=120, stdout=subprocess.PIPE, text=True)
    if report.returncode != 0:
        return report.returncode
    print(report.stdout[report.stdout.find("Goodput ledger"):])
    if args.height is None:  # the page's own height: the whole figure, nothing more
        from ft_launcher.observe import report as ft_report
        from ft_launcher.observe import timeline
        from ft_launcher.rundir import read_events

        events = read_events(run_dir)
        fig = timeline.build_figure(events, ft_report.build_report(run_dir, events))
        args.height = int(fig.layout.height) + 20
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shot = run_group([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                      f"--user-data-dir={work / 'profile'}", "--hide-scrollbars",
                      f"--window-size={args.width},{args.height}",
                      "--virtual-time-budget=10000", f"--screenshot={args.out.resolve()}",
                      page.as_uri()], timeout=120, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    if shot.returncode != 0 or not args.out.is_file():
        print(f"chromium exited {shot.returncode} without a screenshot", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    if args.keep_run_dir:
        print(f"run dir and page kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
