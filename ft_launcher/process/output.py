"""A child process's output: drained by one thread into a log file and the console.

One pump per process (workers, warm-restart standbys) reads its merged stdout/stderr pipe
until EOF, whatever happens downstream, so the process never blocks on a full pipe and
never sees its pipe close while it lives:

- lines are read at most ``LINE_LIMIT`` bytes at a time, so a process printing only ``\\r``
  or one endless line costs the launcher a bounded buffer, never its memory;
- the log file gets the bytes as they came; when it cannot be written (a full disk, or
  only the run's record reserve is left on the run directory's disk: ``reserve.py``), the
  bytes are dropped and counted (``Sink.dropped_bytes``), reported once (a log line and the
  ``on_drop`` callback), and writing is tried again every ``RETRY_S``;
- the console gets each line with its prefix, control characters escaped (``\\x1b`` as
  text, so a worker cannot drive the terminal), a bare ``\\r`` as a line break (progress
  bars become lines), and a line over ``LINE_LIMIT`` cut with a marker.

Entry points: ``Sink(log_file, prefix, label=..., on_drop=...)`` and
``OutputPump(stream, sink, name, on_line=None, on_eof=None).start()``; ``on_line(pump,
line)`` may take a line for itself (return True) and switch ``pump.sink`` with
``pump.swap_sink``; ``on_eof()`` runs on the pump's thread once the pipe is drained.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from ft_launcher.process.reserve import RECORD, NoRoom

log = logging.getLogger("ft_launcher")

LINE_LIMIT = 64 * 1024
RETRY_S = 1.0  # after a failed log write, drop output this long before trying again

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """Control characters (C0 but tab and newline, DEL, C1) as visible ``\\xNN`` text."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


_LINE_BREAK = re.compile(rb"[\r\n]")
_CR_RUN = re.compile(rb"\r+")


def split_lines(chunk: bytes) -> list[tuple[bytes, bytes]]:
    """(piece, terminator) for each part of a chunk: ``\\n``, ``\\r`` (a bare carriage
    return ends a line too; a run of them counts once) or ``b""`` for an unfinished line."""
    chunk = chunk.replace(b"\r\n", b"\n")
    if b"\r" in chunk:  # a progress bar or a flood of \r: C speed, whatever the length
        chunk = _CR_RUN.sub(b"\r", chunk)
    pieces, start = [], 0
    for m in _LINE_BREAK.finditer(chunk):
        pieces.append((chunk[start:m.start()], m.group()))
        start = m.end()
    if start < len(chunk):
        pieces.append((chunk[start:], b""))
    return pieces


def console_line(prefix: bytes, line: bytes) -> bytes:
    """One console line: prefix, text with control characters escaped, newline.

    A line that already starts with the rank's tag (torch prefixes its own distributed
    warnings with ``[rank0]:``) is not tagged twice.
    """
    text = escape_controls(line.decode("utf-8", errors="backslashreplace"))
    if prefix and line.startswith(prefix.rstrip(b" ")):
        prefix = b""
    return prefix + text.encode() + b"\n"


class Sink:
    """Where one process's output goes: a log file (optional) and the console (when a
    prefix is given). Used by one pump thread at a time."""

    def __init__(self, log_file: IO[bytes] | None, prefix: bytes | None, *, label: str = "",
                 console: IO[bytes] | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.log_file = log_file
        self.prefix = prefix
        self.label = label or "output"
        self.console = console if console is not None else (
            sys.stdout.buffer if prefix is not None else None)
        self.on_drop = on_drop
        self.dropped_bytes = 0
        self.cut_lines = 0
        self._retry_at = 0.0  # monotonic; 0: the log file is writable
        self._reported = False
        self._partial = b""  # the console line being assembled (< LINE_LIMIT bytes)
        self._cut: int | None = None  # bytes of an over-long line held back from the console
        self._on_record_fs: bool | None = None  # the log shares the run directory's disk

    # -- log file ----------------------------------------------------------------------

    def _log(self, data: bytes) -> None:
        if self.log_file is None or not data:
            return
        if self._retry_at and time.monotonic() < self._retry_at:
            self.dropped_bytes += len(data)
            return
        if self._keeps_reserve() and not RECORD.log_allows(len(data)):
            self.dropped_bytes += len(data)
            self._retry_at = time.monotonic() + RETRY_S
            self._report(NoRoom())
            return
        view = memoryview(data)
        try:
            while view:  # an unbuffered write may be partial when the disk fills up
                written = self.log_file.write(view)
                if not written:
                    raise OSError("log file accepts no more bytes")
                view = view[written:]
            self._retry_at = 0.0
        except (OSError, ValueError) as exc:
            self.dropped_bytes += len(view)
            self._retry_at = time.monotonic() + RETRY_S
            self._report(exc)

    def _keeps_reserve(self) -> bool:
        """Whether the log file is on the run directory's file system (``reserve.py``)."""
        if self._on_record_fs is None:
            try:
                self._on_record_fs = RECORD.covers(self.log_file.fileno())  # type: ignore[union-attr]
            except (OSError, ValueError):
                self._on_record_fs = False
        return self._on_record_fs

    def _report(self, exc: BaseException) -> None:
        if self._reported:
            return
        self._reported = True
        reason = getattr(exc, "strerror", None) or str(exc)
        log.warning("%s: log file cannot be written (%s); output is dropped and counted "
                    "until it can be, the process keeps running", self.label, reason)
        if self.on_drop is not None:
            try:
                self.on_drop(reason)
            except Exception:  # a reporting failure must not stop the draining
                log.exception("output drop callback failed")

    # -- console -----------------------------------------------------------------------

    def _echo(self, chunk: bytes) -> None:
        if self.console is None or self.prefix is None:
            return
        out = []
        for piece, end in split_lines(chunk):
            ended = bool(end)
            if self._cut is not None:  # the rest of a line already cut: count it
                self._cut += len(piece)
                if ended:
                    out.append(self.prefix + f"[... {self._cut} more bytes of this line are "
                               "in the log]\n".encode())
                    self._cut = None
                continue
            self._partial += piece
            if ended:
                if self._partial or end == b"\n":  # an empty \r-line is no line
                    out.append(console_line(self.prefix, self._partial))
                self._partial = b""
            elif len(self._partial) >= LINE_LIMIT:
                self.cut_lines += 1
                out.append(console_line(self.prefix, self._partial[:LINE_LIMIT]))
                self._cut = len(self._partial) - LINE_LIMIT
                self._partial = b""
        self._show(b"".join(out))

    def _show(self, data: bytes) -> None:
        if not data or self.console is None:
            return
        try:
            self.console.write(data)
            self.console.flush()
        except (OSError, ValueError):
            self.console = None  # the console is gone (closed, EPIPE): the log still gets it

    # -- both --------------------------------------------------------------------------

    def write(self, chunk: bytes) -> None:
        """One chunk as read by the pump (a line, or ``LINE_LIMIT`` bytes of one)."""
        self._log(chunk)
        self._echo(chunk)

    def close(self) -> None:
        """Show a last unterminated line, close the log file."""
        if self._partial and self.prefix is not None:
            self._show(console_line(self.prefix, self._partial))
        self._partial = b""
        if self.log_file is not None:
            try:
                self.log_file.close()
            except OSError:
                pass


LineHook = Callable[["OutputPump", bytes], bool]


class OutputPump:
    """A daemon thread copying a pipe into a Sink until EOF (see the module docstring)."""

    def __init__(self, stream: IO[bytes], sink: Sink, name: str,
                 on_line: LineHook | None = None,
                 on_eof: Callable[[], None] | None = None) -> None:
        self.stream = stream
        self.sink = sink
        self.on_line = on_line
        self.on_eof = on_eof  # called on the pump's thread once ``eof`` is set
        self.eof = False  # the pipe is drained and closed (the thread is about to end)
        self.failures = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> OutputPump:
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def swap_sink(self, sink: Sink) -> None:
        """From ``on_line`` (the pump's thread): send what follows to ``sink``."""
        if sink is not self.sink:
            self.sink.close()
            self.sink = sink

    def _failed(self, what: str) -> None:
        self.failures += 1
        if self.failures == 1:  # logged once, counted always
            log.exception("%s: output %s failed; still draining", self.thread.name, what)

    @property
    def dropped_bytes(self) -> int:
        return self.sink.dropped_bytes

    def _run(self) -> None:
        read = self.stream.readline
        try:
            while True:
                try:
                    chunk = read(LINE_LIMIT)
                except (OSError, ValueError):
                    break
                if not chunk:
                    break
                handled = False
                if self.on_line is not None:
                    try:
                        handled = self.on_line(self, chunk)
                    except Exception:  # the line still goes to the sink
                        self._failed("line hook")
                if not handled:
                    try:
                        self.sink.write(chunk)
                    except Exception:  # never stop draining: the process would block or die
                        self._failed("sink")
        finally:
            try:
                self.stream.close()
            except OSError:
                pass
            self.sink.close()
            self.eof = True
            if self.on_eof is not None:
                try:
                    self.on_eof()
                except Exception:
                    self._failed("end-of-file hook")


def open_log(path: os.PathLike[str] | str) -> IO[bytes]:
    """Open a log file for appending, unbuffered, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    return os.fdopen(fd, "ab", buffering=0)
