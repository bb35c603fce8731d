"""The guardian: kills every worker's process group when the launcher dies, however it dies.

PDEATHSIG reaches only a worker itself, not the processes it started (dataloader workers,
a ``sleep`` in a shell script), so a SIGKILLed launcher would leave those running. The
launcher therefore starts one tiny guardian process (this file, run by path with ``python
-S``: standard library only, no imports of the project) and keeps the write end of a pipe
to it. It tells the guardian each process group it spawns (``+ PGID STARTTIME``) and each
it has cleaned up (``- PGID``). When the pipe reads EOF, the launcher is gone (exit, crash
or SIGKILL: the kernel closes its descriptors either way); the guardian SIGKILLs every
group still registered and exits.

A group is killed only while it is still the one registered: its leader is gone (a pid
that leads a live group is never reused) or is the same process (same start time in
``/proc/PID/stat``). Processes that left the group (double-forked daemons, ``setsid``)
are out of reach, as with torchrun.

The guardian runs in its own session and ignores the terminal's and the scheduler's
signals, so it outlives a launcher that died for the moment it needs; it exits right after.
A launcher that exits (not killed) closes the pipe itself and reaps the guardian.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading

log = logging.getLogger("ft_launcher")

STOP_TIMEOUT_S = 5.0  # at the launcher's exit: how long to wait for the guardian to exit


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), or None if there is no PID."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


def kill_groups(groups: dict[int, str]) -> list[int]:
    """SIGKILL every registered group that is still the one registered; the pgids killed."""
    killed = []
    for pgid, started in groups.items():
        now = start_time(pgid)
        if now is not None and now != started:
            continue  # the pid was reused by another process: not ours
        try:
            os.killpg(pgid, signal.SIGKILL)
            killed.append(pgid)
        except OSError:
            pass
    return killed


class Guardian:
    """The launcher's side: starts the guardian on first use and tells it about groups."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._broken = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _ensure(self, tag: str) -> subprocess.Popen | None:
        if self._proc is None and not self._broken:
            env = {"PATH": os.environ.get("PATH", "")}
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-S", os.path.abspath(__file__), tag],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                    start_new_session=True, close_fds=True,
                )
            except OSError as exc:
                self._fail(f"cannot start: {exc}")
            else:
                atexit.register(self.stop, os.getpid())
        return self._proc

    def _send(self, line: str, tag: str = "") -> None:
        with self._lock:
            proc = self._ensure(tag)
            if proc is None or proc.stdin is None:
                return
            try:
                proc.stdin.write(line.encode())
                proc.stdin.flush()
            except (OSError, ValueError) as exc:
                self._fail(f"gone ({exc})")

    def _fail(self, why: str) -> None:
        if not self._broken:
            self._broken = True
            log.warning("process-group guardian %s: a SIGKILLed launcher may leave workers' "
                        "children behind (workers themselves still die with it)", why)

    def register(self, pid: int, tag: str = "") -> None:
        """A new process group led by ``pid`` (spawned with start_new_session)."""
        started = start_time(pid)
        if started is not None:
            self._send(f"+ {pid} {started}\n", tag)

    def unregister(self, pid: int) -> None:
        """The group led by ``pid`` was killed and reaped by the launcher itself."""
        if self._proc is not None:
            self._send(f"- {pid}\n")

    def close(self) -> None:
        """Close the pipe: the guardian kills what is still registered, then exits."""
        with self._lock:
            if self._proc is not None and self._proc.stdin is not None:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass

    def stop(self, owner: int | None = None, timeout: float = STOP_TIMEOUT_S) -> None:
        """Close the pipe and reap the guardian once it exited, so that the launcher leaves
        no process behind (without it, the guardian outlives the launcher for a moment and
        is then a zombie wherever PID 1 does not reap). Runs at the launcher's exit
        (``atexit``); ``owner``: only in that process, not in a forked copy of it."""
        if owner is not None and owner != os.getpid():
            return
        self.close()
        proc = self._proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("process-group guardian (pid %d) still runs %.0f s after the "
                        "launcher closed its pipe", proc.pid, timeout)


def main() -> None:
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    groups: dict[int, str] = {}
    stdin = sys.stdin.buffer
    for line in iter(stdin.readline, b""):
        parts = line.split()
        try:
            if parts[0] == b"+" and len(parts) == 3:
                groups[int(parts[1])] = parts[2].decode()
            elif parts[0] == b"-" and len(parts) == 2:
                groups.pop(int(parts[1]), None)
        except (IndexError, ValueError):
            continue
    kill_groups(groups)


if __name__ == "__main__":
    main()
