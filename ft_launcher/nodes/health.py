"""Node health checks, run before every rendezvous: a node that fails one does not join.

Built in: the run directory is writable and has at least ``min_free_bytes`` free; where
GPUs exist (``/proc/driver/nvidia/gpus`` or ``nvidia-smi``), every visible GPU answers a
``nvidia-smi --query-gpu`` query. Then the user's commands (``--ft-health-check CMD``),
each through the shell. Every check has a timeout and keeps only the tail of its output,
so a hung or chatty check cannot hang or flood the launcher.

Entry point: ``run_health_checks(commands, timeout, run_dir, min_free_bytes)``. The
supervisor records ``health_check_failed`` with ``failure.event_fields()`` for each failed
check and exits with ``next_action`` requeue excluding this host.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ft_launcher.process.worker_env import listed_gpus

log = logging.getLogger("ft_launcher")

OUTPUT_LIMIT = 4096  # bytes of a check's output kept (the tail: where errors are)
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
GPU_QUERY = "index,uuid,name,temperature.gpu,memory.used"


@dataclass
class CheckResult:
    """One check: ``exit_code`` None when it timed out or could not start."""

    check: str  # "run_dir", "gpu", or the user's command line
    ok: bool
    exit_code: int | None
    output: str
    duration_s: float
    skipped: bool = False

    def event_fields(self) -> dict[str, object]:
        """Fields of the ``health_check_failed`` event."""
        return {"check": self.check, "exit_code": self.exit_code, "output": self.output,
                "duration_s": round(self.duration_s, 3)}


@dataclass
class HealthResult:
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.ok]

    def summary(self) -> str:
        """One line for a log or an exit reason."""
        if self.ok:
            return f"{len(self.checks)} health checks passed"
        first = self.failures[0]
        code = "timed out" if first.exit_code is None else f"exit {first.exit_code}"
        tail = first.output.strip().splitlines()[-1:] or [""]
        return f"health check failed: {first.check} ({code}) {tail[0][:200]}".rstrip()


def run_health_checks(commands: Sequence[str], timeout: float, run_dir: Path,
                      min_free_bytes: int, nvidia_smi: str | None = None,
                      gpu_proc: Path = NVIDIA_PROC) -> HealthResult:
    """Run every check (built-ins first) and return all results; none raises.

    ``nvidia_smi`` and ``gpu_proc`` exist for tests (a stand-in for a GPU that this
    machine lacks); by default ``nvidia-smi`` is looked up on PATH.
    """
    result = HealthResult([check_run_dir(Path(run_dir), min_free_bytes)])
    result.checks.append(check_gpus(timeout, nvidia_smi or shutil.which("nvidia-smi"),
                                    gpu_proc))
    for cmd in commands:
        result.checks.append(run_command(cmd, timeout, {"FT_RUN_DIR": str(run_dir)}))
    for c in result.failures:
        log.warning("health check failed: %s (exit %s): %s", c.check, c.exit_code,
                    c.output.strip()[-300:])
    return result


def check_run_dir(run_dir: Path, min_free_bytes: int) -> CheckResult:
    """The run directory takes a small file, and has at least ``min_free_bytes`` free."""
    start = time.monotonic()

    def done(ok: bool, message: str) -> CheckResult:
        return CheckResult("run_dir", ok, 0 if ok else 1, message, time.monotonic() - start)

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".health_") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())  # a full disk may only say so here
        free = shutil.disk_usage(run_dir).free
    except OSError as exc:
        return done(False, f"{run_dir}: not writable: {exc.strerror or exc}")
    if free < min_free_bytes:
        return done(False, f"{run_dir}: {_mib(free)} free, below the {_mib(min_free_bytes)} "
                           "required (--ft-min-free-space)")
    return done(True, f"{run_dir}: writable, {_mib(free)} free")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def gpus_present(nvidia_smi: str | None, gpu_proc: Path = NVIDIA_PROC) -> bool:
    try:
        if any(gpu_proc.iterdir()):
            return True
    except OSError:
        pass
    return nvidia_smi is not None


def check_gpus(timeout: float, nvidia_smi: str | None,
               gpu_proc: Path = NVIDIA_PROC) -> CheckResult:
    """Every visible GPU answers a query (skipped where there is none)."""
    if not gpus_present(nvidia_smi, gpu_proc):
        return CheckResult("gpu", True, 0, "no GPU on this node: skipped", 0.0, skipped=True)
    if nvidia_smi is None:
        return CheckResult("gpu", False, None, "GPUs present but nvidia-smi not found", 0.0)
    cmd = [nvidia_smi, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader"]
    visible = listed_gpus(os.environ) or []
    if visible:
        cmd += ["-i", ",".join(visible)]  # ask for exactly the GPUs this node's ranks use
    res = run_command(cmd, timeout, name="gpu")
    if res.ok:
        rows = [r for r in res.output.splitlines() if r.strip()]
        bad = [r for r in rows if "ERR!" in r or "Unknown Error" in r]
        expected = len(visible) if visible else _proc_gpu_count(gpu_proc)
        if bad or (expected and len(rows) < expected):
            res.ok, res.exit_code = False, 1
            res.output += (f"\n{len(rows)} of {expected or len(rows)} GPUs answered"
                           f"{', with errors' if bad else ''}")
    return res


def _proc_gpu_count(gpu_proc: Path) -> int:
    try:
        return len(list(gpu_proc.iterdir()))
    except OSError:
        return 0


def count_gpus(gpu_proc: Path = NVIDIA_PROC, dev: Path = Path("/dev")) -> int:
    """GPUs this node's ranks may use, without importing torch."""
    listed = listed_gpus(os.environ)
    if listed is not None:
        return len(listed)
    if count := _proc_gpu_count(gpu_proc):
        return count
    # Containers may hide /proc/driver/nvidia but still pass the device files in.
    try:
        return len([n for n in os.listdir(dev) if re.fullmatch(r"nvidia\d+", n)])
    except OSError:
        return 0


def run_command(cmd: str | list[str], timeout: float, env: dict[str, str] | None = None,
                name: str | None = None) -> CheckResult:
    """Run a check (a shell line, or an argv) in its own session; on timeout the whole
    session is killed. Only the last OUTPUT_LIMIT bytes of its output are kept."""
    label = name or (cmd if isinstance(cmd, str) else " ".join(cmd))
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, shell=isinstance(cmd, str), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
    except OSError as exc:
        return CheckResult(label, False, None, f"cannot start: {exc}", 0.0)
    tail = _Tail(proc.stdout)
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        code = None
    tail.join()
    output = tail.text()
    if code is None:
        output += f"\ntimed out after {timeout:g} s"
    return CheckResult(label, code == 0, code, output, time.monotonic() - start)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the shell and everything it started
    except ProcessLookupError:
        pass
    proc.wait()


class _Tail:
    """Reads a pipe to its end on a thread, keeping the last OUTPUT_LIMIT bytes."""

    def __init__(self, pipe) -> None:
        self._buf = bytearray()
        self._pipe = pipe
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self._pipe.read1(65536), b""):
            self._buf += chunk
            if len(self._buf) > 2 * OUTPUT_LIMIT:
                del self._buf[:-OUTPUT_LIMIT]
        self._pipe.close()

    def join(self) -> None:
        # A grandchild that kept the pipe open (left its session) must not hang us.
        self._thread.join(2.0)

    def text(self) -> str:
        return bytes(self._buf[-OUTPUT_LIMIT:]).decode(errors="replace")
