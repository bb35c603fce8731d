"""Free space kept for the job's record (events.jsonl, summary.json) on a filling disk.

A rank that prints without end, on the file system of the run directory, would otherwise
take the last byte, and the job would end without its summary. So the workers' logs stop
``LOG_RESERVE`` bytes before the disk is full (their output is dropped and counted, with the
``output_dropped`` event, as for a full disk), and events stop ``SUMMARY_RESERVE`` bytes
before it, which leaves room for summary.json.

One reserve per launcher process (``RECORD``), set by :class:`~ft_launcher.rundir.RunDir`
for its directory; writers on another file system (``--log-dir`` elsewhere) are not held.
Free space is read with ``statvfs``, for log writes at most once per half of the room that
was left at the last look (or per second), so a chatty rank costs few system calls.
"""

from __future__ import annotations

import errno
import os
import threading
import time

LOG_RESERVE = 512 * 1024  # logs stop with this much left: the record's room
SUMMARY_RESERVE = 128 * 1024  # events stop with this much left: summary.json's room
RECHECK_S = 1.0  # other writers (the ranks' own files) fill the disk too: look again


class NoRoom(OSError):
    """A write refused to keep the reserve; reads like a full disk."""

    def __init__(self) -> None:
        super().__init__(errno.ENOSPC,
                         f"{os.strerror(errno.ENOSPC)} (the rest is kept for the run's record)")


class SpaceReserve:
    """Decides whether a write to the run directory's file system leaves the reserve."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None
        self._dev: int | None = None
        self._budget = 0  # bytes logs may write before the next look
        self._looked_at = 0.0

    def protect(self, path: os.PathLike[str] | str) -> None:
        """Keep the reserve on the file system that holds ``path`` (a directory)."""
        with self._lock:
            self._path, self._dev = os.fspath(path), os.stat(path).st_dev
            self._budget = 0

    def release(self, path: os.PathLike[str] | str) -> None:
        """Stop keeping it (the run directory was closed)."""
        with self._lock:
            if self._path == os.fspath(path):
                self._path = self._dev = None

    def covers(self, fd: int) -> bool:
        """Whether writes to ``fd`` land on the protected file system."""
        dev = self._dev
        try:
            return dev is not None and os.fstat(fd).st_dev == dev
        except OSError:
            return False

    def _free(self) -> int | None:
        path = self._path
        if path is None:
            return None
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def log_allows(self, nbytes: int) -> bool:
        """Whether a log write of ``nbytes`` (on the protected file system) may go ahead."""
        with self._lock:
            now = time.monotonic()
            if nbytes <= self._budget and now - self._looked_at < RECHECK_S:
                self._budget -= nbytes
                return True
            free = self._free()
            self._looked_at = now
            if free is None:
                self._budget = 0
                return True
            room = free - LOG_RESERVE - nbytes
            self._budget = max(0, room // 2)
            return room >= 0

RECORD = SpaceReserve()


def event_fits(fd: int, nbytes: int) -> bool:
    """Whether an event of ``nbytes`` written to ``fd`` leaves room for summary.json."""
    try:
        st = os.fstatvfs(fd)
    except OSError:
        return True
    return st.f_bavail * st.f_frsize - nbytes >= SUMMARY_RESERVE
