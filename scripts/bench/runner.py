"""One benchmark run: a launcher process, its workload's records, and its cleanup.

Every process a run starts is tracked by pid (with its start time, so a reused pid is never
signalled) and ended by pid in ``stop()``: the launcher, its descendants as last seen, and
every worker that announced itself in the events file, even one a launcher left behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

log = logging.getLogger("bench")

POLL_S = 0.01  # how often a waiting run reads its files; timestamps come from the records
TRACK_EVERY_S = 0.25  # how often the launcher's process tree is walked (costs CPU)
DRIVER_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
TERM_GRACE_S = 2.0  # launchers may tidy up; teardown itself is not measured


class LineTail:
    """Reads the complete text lines appended to a log file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        return data[:cut].decode(errors="replace").splitlines()


class JsonlTail:
    """Reads the complete JSON records appended to a JSONL file since the last call."""

    def __init__(self, path: Path) -> None:
        self.lines = LineTail(path)

    def read(self) -> list[dict[str, Any]]:
        """New complete records; a line still being written waits for the next call."""
        out = []
        for line in self.lines.read():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a stray line is not a record
        return out


@dataclass
class Run:
    """A launcher started with the workload; ``records`` are the workload's events so far."""

    name: str
    argv: list[str]
    workdir: Path
    env: dict[str, str]
    records: list[dict[str, Any]] = field(default_factory=list)
    t_start: float = 0.0
    t_exit: float | None = None
    exit_code: int | None = None
    proc: subprocess.Popen | None = None
    # How often refresh() walks the launcher's process tree; a driver of many runs walks the
    # machine's process table once for all of them instead (``track``) and sets this to inf.
    track_every_s: float = TRACK_EVERY_S
    _tracked: dict[int, psutil.Process] = field(default_factory=dict)
    _tail: JsonlTail | None = None
    _log: IO[bytes] | None = None
    _last_track: float = 0.0

    @property
    def events_path(self) -> Path:
        return self.workdir / "events.jsonl"

    @property
    def log_path(self) -> Path:
        return self.workdir / "launcher.log"

    def start(self) -> None:
        """Start the launcher; ``t_start`` is taken right before the spawn."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._tail = JsonlTail(self.events_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        log.debug("%s: %s", self.name, " ".join(self.argv))
        self.t_start = time.time()
        self.proc = subprocess.Popen(
            self.argv, cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._track_pid(self.proc.pid)

    # -- waiting -----------------------------------------------------------------------

    def refresh(self) -> None:
        """Read new records, notice the launcher's exit, walk its process tree now and then."""
        assert self._tail is not None and self.proc is not None
        for rec in self._tail.read():
            self.records.append(rec)
            if rec.get("ev") == "pid":
                self._track_pid(int(rec["pid"]))
        if self.exit_code is None:
            code = self.proc.poll()
            if code is not None:
                self.exit_code, self.t_exit = code, time.time()
        if time.monotonic() - self._last_track >= self.track_every_s and self.exit_code is None:
            self._last_track = time.monotonic()
            try:
                self.track(psutil.Process(self.proc.pid).children(recursive=True))
            except psutil.Error:
                pass

    def track(self, procs: list[psutil.Process]) -> None:
        """Remember processes to end in ``stop()`` (the launcher's descendants)."""
        for proc in procs:
            self._tracked.setdefault(proc.pid, proc)

    def wait(self, cond: Callable[[], bool], timeout: float) -> bool:
        """Refresh until ``cond()`` holds (True) or ``timeout`` passes or the launcher exits
        without it holding (False)."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if cond():
                return True
            if self.exit_code is not None or time.monotonic() >= deadline:
                self.refresh()
                return cond()
            time.sleep(POLL_S)

    def wait_exit(self, timeout: float) -> bool:
        """Wait for the launcher to exit by itself; True when it did."""
        return self.wait(lambda: self.exit_code is not None, timeout)

    def sleep_until(self, t: float) -> None:
        """Keep reading records until wall-clock time ``t``."""
        while time.time() < t:
            self.refresh()
            time.sleep(min(POLL_S, max(0.0, t - time.time())))

    # -- the workload's records --------------------------------------------------------

    def events(self, ev: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("ev") == ev]

    def first_steps(self, exclude_pids: set[int] | frozenset[int] = frozenset()
                    ) -> dict[int, dict[str, Any]]:
        """rank -> its earliest first_step record among processes not in exclude_pids."""
        out: dict[int, dict[str, Any]] = {}
        for r in self.events("first_step"):
            if r["pid"] not in exclude_pids and r["rank"] not in out:
                out[r["rank"]] = r
        return out

    def pid_of(self, rank: int, exclude_pids: set[int] | frozenset[int] = frozenset()) -> int:
        """The newest announced pid of a rank."""
        pids = [r["pid"] for r in self.events("pid")
                if r["rank"] == rank and r["pid"] not in exclude_pids]
        if not pids:
            raise LookupError(f"{self.name}: rank {rank} never announced its pid")
        return pids[-1]

    def worker_pids(self) -> set[int]:
        return {int(r["pid"]) for r in self.events("pid")}

    # -- signals and cleanup -----------------------------------------------------------

    def signal_worker(self, pid: int, signum: int) -> float:
        """Send a signal to one worker by pid; returns the wall time just before sending."""
        proc = self._tracked.get(pid) or self._track_pid(pid)
        t = time.time()
        if proc is not None:
            try:
                proc.send_signal(signum)  # psutil checks the pid was not reused
            except psutil.NoSuchProcess:
                log.warning("%s: pid %d gone before signal %d", self.name, pid, signum)
        return t

    def stop(self) -> None:
        """End every process this run started, by pid: SIGTERM to the launcher, a short
        grace, then SIGKILL to whatever is left (workers, monitors, the launcher)."""
        if self.proc is None:
            return
        # The driver turns SIGTERM/SIGINT into an exception; one arriving now would cut the
        # cleanup short, so they wait until it is done.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, DRIVER_SIGNALS)
        try:
            self._stop()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _stop(self) -> None:
        assert self.proc is not None
        self.refresh()
        for proc in self._alive():
            _send(proc, signal.SIGCONT)  # a stopped worker cannot act on anything else
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # our own child: its pid cannot be reused
            try:
                self.proc.wait(TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self.refresh()
        for proc in self._alive():
            _send(proc, signal.SIGKILL)
        _, still = psutil.wait_procs(self._alive(), timeout=5.0)
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            still.append(psutil.Process(self.proc.pid))
        if self.exit_code is None:
            self.exit_code, self.t_exit = self.proc.returncode, time.time()
        if self._log is not None:
            self._log.close()
        if still:
            log.warning("%s: processes still alive after SIGKILL: %s", self.name,
                        [p.pid for p in still])

    def leftovers(self) -> list[int]:
        """Pids of this run still alive (for the cleanup check)."""
        return [p.pid for p in self._alive()]

    def _alive(self) -> list[psutil.Process]:
        alive = []
        for proc in self._tracked.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                pass
        return alive

    def _track_pid(self, pid: int) -> psutil.Process | None:
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return None
        self._tracked.setdefault(pid, proc)
        return self._tracked[pid]

    def __enter__(self) -> Run:
        try:
            self.start()
        except BaseException:  # interrupted between the spawn and the with-block
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _send(proc: psutil.Process, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except psutil.Error:
        pass


def process_status(pid: int) -> str | None:
    """psutil status of a pid, None when it is gone or a zombie."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return None
    return None if status == psutil.STATUS_ZOMBIE else status


def base_env(workdir: Path) -> dict[str, str]:
    """The same environment for every launcher: loopback-only gloo, one OpenMP thread,
    temporary files (NVRx's sockets among them) inside the run's own directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "TORCHELASTIC_"))}
    env.update({
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(workdir),
    })
    return env
