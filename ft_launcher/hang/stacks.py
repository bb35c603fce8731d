"""Stack capture of every local rank when one is judged hung.

Two ways, per rank: the agent's faulthandler (armed at hello; it writes from C, so it works
while the rank is stuck in a collective or a C extension) on ``STACK_SIGNAL``, and py-spy
for the ranks that cannot answer (a stopped process, one that never connected). Signals go
through ``WorkerGroup``, the one owner of signals to workers. Texts are written to
``stacks/cycle_<n>_rank_<r>.txt`` and returned, so the culprit can be chosen from them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

STACK_SIGNAL = signal.SIGUSR2
STACK_WAIT_S = 1.5
MAX_STACK_BYTES = 1 << 20  # what is read of one rank's dump


@dataclass
class StackTarget:
    """One live rank to capture: its spawned pid, and its agent's file and pid if connected."""

    rank: int
    pid: int
    agent_pid: int | None
    stack_file: Path | None


def find_py_spy() -> str | None:
    """py-spy on PATH or beside this interpreter (it is a test extra, installed in venvs)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def is_stopped(pid: int) -> bool:
    """True when the process is stopped (state T: SIGSTOP, a debugger, a frozen cgroup)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def capture(targets: list[StackTarget], signal_agent: Callable[[StackTarget], bool],
            py_spy: str | None = None, wait_s: float = STACK_WAIT_S) -> dict[int, str]:
    """Stacks of every target, by rank (a rank with nothing readable is left out).

    ``signal_agent(target)`` sends STACK_SIGNAL to the target's agent (False when it could
    not). A stopped rank cannot run its faulthandler; py-spy reads its memory instead.
    """
    offsets: dict[int, int] = {}
    pyspy: dict[int, subprocess.Popen] = {}
    for t in targets:
        if t.stack_file is not None and t.agent_pid is not None and not is_stopped(t.agent_pid):
            try:
                offsets[t.rank] = t.stack_file.stat().st_size
            except OSError:
                pass
            else:
                if signal_agent(t):
                    continue
                offsets.pop(t.rank, None)
        if py_spy:
            pyspy[t.rank] = subprocess.Popen(
                [py_spy, "dump", "--nonblocking", "--pid", str(t.agent_pid or t.pid)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + wait_s
    by_rank = {t.rank: t for t in targets}
    texts = {rank: _wait_for_growth(by_rank[rank].stack_file, offset, deadline)
             for rank, offset in offsets.items()}
    for rank, proc in pyspy.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic() + 5))
            texts[rank] = "py-spy dump:\n" + out[:MAX_STACK_BYTES].decode(errors="replace")
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    return {rank: text for rank, text in texts.items() if text and text.strip()}


def write(stacks_dir: Path, cycle: int, texts: dict[int, str]) -> list[int]:
    """Write each rank's stacks to its file; returns the ranks written."""
    written = []
    for rank, text in sorted(texts.items()):
        path = stacks_dir / f"cycle_{cycle}_rank_{rank}.txt"
        header = f"# rank {rank}, cycle {cycle}, {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(header + text)
            written.append(rank)
        except OSError:
            continue  # a full disk loses a stack file, never the job
    return written


def _read_from(path: Path | None, offset: int) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(MAX_STACK_BYTES).decode(errors="replace")
    except OSError:
        return ""


def _wait_for_growth(path: Path | None, offset: int, deadline: float) -> str:
    """Poll a growing file until its new content stops growing or the deadline passes."""
    text, stable_since = "", None
    while time.monotonic() < deadline:
        new = _read_from(path, offset)
        if new and new == text:
            if stable_since and time.monotonic() - stable_since > 0.05:
                return text
            stable_since = stable_since or time.monotonic()
        else:
            text, stable_since = new, None
        time.sleep(0.01)
    return _read_from(path, offset) or text
