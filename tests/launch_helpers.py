"""Helpers for tests that start real ft_launcher processes (imported by test modules)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"
LAUNCHER = [sys.executable, "-m", "ft_launcher.cli"]
# The zygote's preloads, chosen by the test. By default (warm restart on) the zygote imports
# torch and torch._dynamo, about 3.5 s of CPU, and the first cycle waits for it. A test whose
# script imports no torch and that is not about the defaults passes NO_PRELOADS: its workers
# are still forks of the zygote (warm), which imports nothing.
NO_PRELOADS = ("--ft-preload", "")
# For a script that imports torch but nothing torch._dynamo brings (no DDP, no compile: a
# gloo all-reduce): the zygote imports torch alone, about half the CPU.
TORCH_PRELOAD = ("--ft-preload", "torch")


def launcher_cmd(run_dir: Path, *args: str) -> list[str]:
    return [*LAUNCHER, "--ft-run-dir", str(run_dir), *args]


def run_launcher(run_dir: Path, *args: str, timeout: float = 120,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ft_launcher to completion (bounded); stdout+stderr merged in .stdout."""
    proc = subprocess.Popen(launcher_cmd(run_dir, *args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    out = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for a started launcher (bounded) and return its merged output; kill it and fail
    the test when it does not finish in time."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"ft_launcher did not finish within {timeout} s:\n{out[-3000:]}")
    return out


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def named(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["event"] == name]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll until predicate() is truthy; fail the test naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)  # /proc state T and t


def _stopped(pid: int) -> bool:
    try:
        threads = psutil.Process(pid).threads()
        return all(psutil.Process(t.id).status() in STOPPED for t in threads)
    except psutil.NoSuchProcess:  # the process, or a thread of it, has just exited
        return False


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. kill() only queues the
    stop; one thread takes it and then stops the others, so on a loaded machine another
    thread can go on for milliseconds (seen: a replica server answered a whole fetch)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: _stopped(pid), timeout, f"every thread of pid {pid} to stop", 0.001)


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes started for this run dir (launcher: cmdline; workers: FT_RUN_DIR)."""
    found = []
    key = str(run_dir)
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(key in part for part in (p.info["cmdline"] or [])) or \
                    p.environ().get("FT_RUN_DIR", "").startswith(key):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found




def mounted_tmpfs(size: str, mode: str = "0755", prefix: str = "ft_tmpfs_"):
    """A real tmpfs of ``size`` (root only; else the test is skipped), for a fixture to
    ``yield from``: unmounted and removed at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs",
                          str(path)], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
        path.rmdir()


def slower_by_the_log(times: Mapping[int, Sequence[tuple[float, ...]]], verdict: Mapping,
                      window: int = 12) -> float:
    """How much slower the rank a ``straggler_detected`` verdict names ran its last
    ``window`` sections before the verdict than the other ranks ran the same steps, by the
    job's own log (tests/scripts/straggler_train.py): the median of its sections over the
    median of theirs. ``times``: rank -> (wall time at the step's end, section seconds, ...)
    per step, in step order. A true verdict at the default threshold (1.3) shows at least
    1.2 here: the log's last steps before the verdict's time may be a step off those the
    launcher had heard of."""
    mine = times[verdict["rank"]]
    last = [i for i, row in enumerate(mine) if row[0] <= verdict["ts"]][-window:]
    peers = [rows[i][1] for rank, rows in times.items() if rank != verdict["rank"]
             for i in last if i < len(rows)]
    return statistics.median(mine[i][1] for i in last) / statistics.median(peers)
