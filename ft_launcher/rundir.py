"""The run directory: events.jsonl, summary.json, ft_state.json, per-cycle logs and stacks.

Trust: the launcher uses a run directory (and ``--log-dir``, ``stacks/``, ``ipc/``) only
when it belongs to the launcher's user and others cannot write to it, so nobody else can
plant a symlink or a fake socket there (a group-writable one of ours, as a umask of 002
makes, loses its group write bit); ``ipc/`` is 0700. Files the launcher writes are
opened with O_NOFOLLOW (or created under a fresh name and renamed).

One launcher at a time: ``launcher.lock`` is held (flock) for the launcher's life and names
its pid; a second launcher on the same directory stops at once naming the holder. Reusing
a directory after the first launcher ended (a requeued job) is a new attempt:
``RunDir.attempt`` is 1 for a new directory, else one more than the last
``launcher_started`` event's ``attempt``, and ``launcher_started`` records it.

Writes never end the job: an event that cannot be written (a full disk) is counted and
reported once; a summary that cannot be written is printed to stderr instead. On a disk
that fills up, the workers' logs stop first and the events next, so that the summary still
has room (``reserve.py``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import pwd
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_launcher.process.reserve import RECORD, NoRoom, event_fits

log = logging.getLogger("ft_launcher")

LOCK_FILE = "launcher.lock"
EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"
STATE_FILE = "ft_state.json"  # learned timeouts (hang/timeouts.py) and preloads (warm/)
PRIVATE_DIR = "ipc"
RESERVED_FIELDS = ("ts", "event", "cycle")
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class RunFile:
    """A path the launcher makes under the run directory, with what it holds: a row of
    docs/reference/run-directory.md (``python -m scripts.docs.render``). ``tests/test_docs.py``
    runs real launches and fails when one leaves a path no row matches, or a row matches
    nothing they leave."""

    path: str  # relative; <n> a cycle, <r> a rank; a trailing / is a directory and all in it
    content: str  # Markdown; a link is relative to docs/reference/


# Every path, whichever module writes it (the module in the comment).
FILES = (
    RunFile(EVENTS_FILE,  # RunDir.event
            "one JSON object per line, flushed per event: " +
            ", ".join(f"`{f}`" for f in RESERVED_FIELDS) +
            ", and fields; every event is in the [events reference](events.md)"),
    RunFile(SUMMARY_FILE,  # supervisor.py
            "at exit: `exit_code`, `reason`, `outcome` (how the last cycle ended), `cycles`, "
            "`restarts`, `faults`, `workers` (every worker's exit code or signal), `diagnoses`, "
            "`device_map`, `protocol_errors`, `events_dropped` (when an event could not be "
            "written), `run_id`, `host`, `version`, and `next_action` (`requeue`, "
            "`exclude_nodes`, `why`) for a scheduler wrapper ([exit codes](exit-codes.md))"),
    RunFile(STATE_FILE,  # hang/timeouts.py, warm/
            "observed intervals, calculated timeouts and learned preloads (`--ft-state-path` "
            "to keep it elsewhere, e.g. shared between jobs)"),
    RunFile("workers.json",  # process/workers_file.py
            "the running cycle's live workers, `{\"cycle\": N, \"workers\": {\"<pid>\": "
            "{\"rank\", \"local_rank\", \"cycle\", \"warm\"}}}`: rewritten when a cycle's "
            "workers start and whenever one exits, emptied when the cycle ends. Tools that map "
            "processes to ranks read it: a warm worker's `/proc/PID/environ` is the zygote's, "
            "without `RANK` ([warm restart](../warm-restart.md#limits))"),
    RunFile("logs/cycle_<n>/rank_<r>.log",  # RunDir.rank_log
            "each worker's output per cycle (`--log-dir` moves `logs/`)"),
    RunFile("logs/cycle_<n>/rank_<r>_error.json",  # rank_plan.py: TORCHELASTIC_ERROR_FILE
            "a rank's uncaught exception, when its script uses torch's `@record`"),
    RunFile("logs/standby/",  # services/job.py: the warm restart's zygote and standbys
            "the output of the zygote and of each standby before it becomes a worker "
            "(`zygote.log`, `local_rank_<i>.log`)"),
    RunFile("stacks/cycle_<n>_rank_<r>.txt",  # hang/stacks.py
            "a rank's Python stacks, dumped when a hang was judged (which ranks: "
            "[hang detection](../hang-detection.md#which-ranks-stacks-are-dumped)) or when "
            "the rank was stuck at its exit"),
    RunFile("stacks/cycle_<n>_rank_<r>.nccl_trace",  # hang/nccl_trace.py
            "NCCL's flight-recorder dump next to them, when it is on "
            "([GPUs](../gpus.md#nccls-flight-recorder))"),
    RunFile(f"{PRIVATE_DIR}/",  # RunDir._make_private
            "0700: the monitor's socket, the agents' stack files, the flight recorder's dumps "
            "and pipes before they are collected, the workers' learned-preload lists, and the "
            "snapshots where the node has no `/dev/shm`"),
    RunFile(LOCK_FILE,  # RunDir._take_lock
            "held (flock) by the running launcher, with its pid: a second one on the same run "
            "directory stops at once"),
)


class RunDirError(OSError):
    """The run directory cannot be created, trusted, locked or written."""


def write_json_atomic(path: Path, data: Any, durable: bool = False) -> None:
    """Write JSON so a reader never sees half a file: a fresh temp file (O_EXCL, so never
    through a symlink), then a rename over the target. ``durable`` also fsyncs it first."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True, default=str)
            f.write("\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object.
    Files several writers share (``ft_state.json``) are updated as read, change one key,
    ``write_json_atomic``."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_private_dir(path: Path, what: str, mode: int | None = None) -> None:
    """Refuse a directory another user owns or may write to (they could plant symlinks or
    a fake socket in it); with ``mode``, also require exactly that mode."""
    try:
        st = os.stat(path)
        link = os.lstat(path)
    except OSError as exc:
        raise RunDirError(f"{what} {path}: {exc.strerror or exc}") from None
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"{what} {path} is not a directory")
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise RunDirError(f"{what} {path} is a symlink owned by {_owner_name(link.st_uid)}; "
                          "refusing to follow it")
    if st.st_uid != me:
        raise RunDirError(f"{what} {path} is owned by {_owner_name(st.st_uid)}, not by this "
                          f"user ({_owner_name(me)}); refusing to use it (choose another "
                          "--ft-run-dir)")
    if st.st_mode & 0o002:
        raise RunDirError(f"{what} {path} is writable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); refusing to use it "
                          f"(chmod o-w {path}, or choose another directory)")
    if st.st_mode & 0o020:  # ours, group-writable (a umask of 002): made private here
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o020)
        log.warning("%s %s was writable by its group; removed that (mode %o)", what, path,
                    stat.S_IMODE(st.st_mode) & ~0o020)
    if mode is not None and stat.S_IMODE(st.st_mode) != mode:
        raise RunDirError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}, expected "
                          f"{mode:o}")


def _check_parent(path: Path, what: str) -> None:
    # In a parent anyone may write to, without the sticky bit, anyone may rename our
    # directory away and put theirs in its place.
    parent = path.parent
    try:
        st = os.stat(parent)
    except OSError:
        return
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise RunDirError(f"{what} {path}: its parent {parent} is writable by everyone without "
                          "the sticky bit; anyone could replace it (choose another directory)")


def _make_dir(path: Path, what: str, mode: int = 0o755) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_parent(path, what)  # before creating anything in it
        path.mkdir(mode=mode, exist_ok=True)
    except RunDirError:
        raise
    except OSError as exc:
        raise RunDirError(f"{what} {path}: {exc.strerror or exc}") from None
    check_private_dir(path, what)


def open_nofollow(path: Path, append: bool = True, mode: int = 0o644) -> int:
    """A descriptor for writing ``path``, refusing a symlink there (ELOOP)."""
    flags = _WRITE_FLAGS | (os.O_APPEND if append else os.O_TRUNC)
    return os.open(path, flags, mode)


def _finite(value: Any) -> Any:
    """A JSON-safe copy: NaN and infinities become strings (never invalid JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _dumps(record: dict[str, Any]) -> str:
    try:
        return json.dumps(record, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(record), default=str, allow_nan=False)


class RunDir:
    """One job's directory, shared by every cycle (see the module docstring)."""

    def __init__(self, path: Path, log_dir: Path | None = None) -> None:
        self.path = Path(path).absolute()
        self.logs = Path(log_dir).absolute() if log_dir else self.path / "logs"
        self.stacks = self.path / "stacks"
        # The monitor's socket, the agents' stack files, the workers' learned-preload lists.
        self.private = self.path / PRIVATE_DIR
        self.events_dropped = 0
        self._torn = False  # the last event write was partial: start the next on a new line
        self._lock = threading.Lock()  # events come from output threads too
        _make_dir(self.path, "run directory")
        self._lock_fd = self._take_lock()
        try:
            _make_dir(self.logs, "log directory")
            _make_dir(self.stacks, "stacks directory")
            self._make_private()
            self.attempt = self._next_attempt()
            self._events_fd = open_nofollow(self.path / EVENTS_FILE)
            RECORD.protect(self.path)
        except OSError as exc:
            os.close(self._lock_fd)
            if isinstance(exc, RunDirError):
                raise
            raise RunDirError(f"run directory {self.path}: {exc.strerror or exc}") from None

    # -- trust and the lock ------------------------------------------------------------

    def _make_private(self) -> None:
        try:
            self.private.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"ipc directory {self.private}: {exc.strerror or exc}") from None
        check_private_dir(self.private, "ipc directory")
        os.chmod(self.private, 0o700, follow_symlinks=False)  # ours: make it private
        check_private_dir(self.private, "ipc directory", mode=0o700)

    def _take_lock(self) -> int:
        path = self.path / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunDirError(f"run directory {self.path}: cannot open {LOCK_FILE}: "
                              f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirError(f"run directory {self.path} is in use by another launcher "
                                  f"(pid {holder}); wait for it to end or choose another "
                                  "--ft-run-dir") from None
            raise RunDirError(f"run directory {self.path}: cannot lock: "
                              f"{exc.strerror or exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the pid (a full disk)
        return fd

    def _next_attempt(self) -> int:
        """1 + the attempt of the last launcher_started event already in events.jsonl."""
        last = 0
        try:
            with open(self.path / EVENTS_FILE, "rb") as f:
                for line in f:
                    if b'"launcher_started"' not in line:
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(record, dict) and record.get("event") == "launcher_started":
                        n = record.get("attempt")
                        last = max(last + 1, n) if isinstance(n, int) else last + 1
        except FileNotFoundError:
            pass
        return last + 1

    # -- events ------------------------------------------------------------------------

    def event(self, name: str, cycle: int, **fields: Any) -> dict[str, Any]:
        """Append one event line (one write, flushed); returns the record. Never raises for
        a write that fails: the event is counted in ``events_dropped``, reported once."""
        record: dict[str, Any] = {"ts": round(time.time(), 6), "event": name, "cycle": cycle}
        if name == "launcher_started":
            record["attempt"] = self.attempt
        for key, value in fields.items():
            if key not in record:  # ts, event, cycle (and attempt) are the launcher's own
                record[key] = value
        data = (_dumps(record) + "\n").encode()
        with self._lock:
            self._append(data)
        return record

    def _append(self, data: bytes) -> None:
        if self._torn:
            data = b"\n" + data
        if not event_fits(self._events_fd, len(data)):  # the rest is summary.json's
            self._dropped(NoRoom())
            return
        try:
            written = os.write(self._events_fd, data)
        except OSError as exc:
            self._dropped(exc)
            return
        self._torn = written < len(data)
        if self._torn:
            self._dropped(OSError(errno.ENOSPC, "short write"))

    def _dropped(self, exc: OSError) -> None:
        self.events_dropped += 1
        if self.events_dropped == 1:
            log.error("%s: cannot write events (%s); events are dropped and counted, the job "
                      "goes on", self.path / EVENTS_FILE, exc.strerror or exc)

    def close(self) -> None:
        RECORD.release(self.path)
        with self._lock:
            for fd in (self._events_fd, self._lock_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._events_fd = self._lock_fd = -1

    # -- files -------------------------------------------------------------------------

    def cycle_log_dir(self, cycle: int) -> Path:
        d = self.logs / f"cycle_{cycle}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def rank_log(self, cycle: int, rank: int) -> Path:
        return self.cycle_log_dir(cycle) / f"rank_{rank}.log"

    def stack_file(self, cycle: int, rank: int) -> Path:
        return self.stacks / f"cycle_{cycle}_rank_{rank}.txt"

    def write_summary(self, summary: dict[str, Any]) -> bool:
        """Write summary.json atomically and durably; when that fails (a full disk), print
        it to stderr instead. Returns whether the file was written. Never raises."""
        if self.events_dropped:
            summary = {**summary, "events_dropped": self.events_dropped}
        try:
            write_json_atomic(self.path / SUMMARY_FILE, _finite(summary), durable=True)
            return True
        except (OSError, TypeError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            try:
                text = json.dumps(_finite(summary), indent=2, sort_keys=True, default=str)
                sys.stderr.write(f"ft_launcher: cannot write {self.path / SUMMARY_FILE} "
                                 f"({reason}); the summary follows:\n{text}\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            return False


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events of a run directory (skipping a torn last line)."""
    events = []
    try:
        lines = (Path(path) / EVENTS_FILE).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return events
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            log.warning("events.jsonl: skipping malformed line %r", line[:80])
            continue
        if isinstance(record, dict):
            events.append(record)
    return events
