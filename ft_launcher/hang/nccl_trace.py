"""NCCL's flight recorder: ask a hung job's ranks for their dumps and file them in stacks/.

torch's NCCL process group keeps a ring buffer of recent collectives per rank (the flight
recorder; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` / ``TORCH_FR_BUFFER_SIZE`` entries). Its heartbeat
monitor thread writes the buffer to ``<prefix><rank>`` (prefix ``TORCH_FR_DUMP_TEMP_FILE``,
else ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) when a collective times out and, with
``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<stem>`` set, whenever something is written into the named
pipe ``<stem><rank>.pipe`` that it creates. That thread runs beside the training's main
thread, so a rank stuck in a CUDA kernel or a collective still answers.

The launcher's side, all plain file logic (no torch import):

- ``worker_env(env, private_dir)``: what to add to a worker's environment so dumps and pipes
  live in the run's private directory (only when the user turned the recorder on);
- ``request_dumps(settings, ranks)``: one byte into each rank's pipe, never blocking;
- ``collect_traces(stacks_dir, cycle, prefix, ranks, ...)``: wait (bounded) for each rank's
  dump and move it to ``stacks/cycle_<n>_rank_<r>.nccl_trace``, next to the Python stacks.

A worker writes the dump files, so they are handled as untrusted: symbolic links are never
followed, only regular files are taken, sizes are bounded, and a file older than the request
(a stale dump of an earlier timeout) is left alone. The dump is torch's pickle; this module
never unpickles it (``torchfrtrace`` reads it, see the README). With
``TORCH_FR_DUMP_DYNAMIC_FILE_NAME`` set, torch writes to the exact file named at dump time
instead of ``<prefix><rank>``; such dumps are not collected.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("ft_launcher")

# torch reads the first of each list that is set (FlightRecorder.hpp, FlightRecorder.cpp).
BUFFER_SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
PIPE_VAR = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
DUMP_ON_TIMEOUT_VAR = "TORCH_NCCL_DUMP_ON_TIMEOUT"

SUBDIR = "nccl_trace"  # under the run's private directory (ipc/, 0700)
DUMP_PREFIX = "dump_rank_"
PIPE_STEM = "pipe_rank_"
TRACE_SUFFIX = ".nccl_trace"
MAX_TRACE_BYTES = 64 * 1024 * 1024  # a 2000-entry dump is well under 10 MiB
WAIT_S = 3.0  # the monitor thread looks at its pipe about once a second, then writes
POLL_S = 0.05


@dataclass(frozen=True)
class TraceSettings:
    """Where one worker's flight recorder writes and listens, read from its environment."""

    buffer_size: int
    dump_prefix: str
    pipe_stem: str | None


@dataclass
class TraceCollection:
    """The outcome of ``collect_traces``: the files written, and why other ranks have none."""

    collected: dict[int, Path] = field(default_factory=dict)
    missing: dict[int, str] = field(default_factory=dict)


def buffer_size(env: Mapping[str, str]) -> int | None:
    """The flight recorder's size as torch reads it from ``env``; None when unset or bad."""
    for name in BUFFER_SIZE_VARS:
        value = env.get(name)
        if value is not None and value.strip():
            try:
                return int(value)
            except ValueError:
                return None
    return None


def trace_settings(env: Mapping[str, str]) -> TraceSettings | None:
    """The worker's dump prefix and pipe stem, or None unless a buffer size > 0 is set and a
    dump prefix is known (torch's own default location is not collected)."""
    size = buffer_size(env)
    prefix = next((env[n] for n in DUMP_FILE_VARS if env.get(n)), None)
    if not size or size <= 0 or not prefix:
        return None
    return TraceSettings(size, prefix, env.get(PIPE_VAR) or None)


def trace_dir(private_dir: Path) -> Path:
    """The directory for dumps and pipes (created 0700); call once per job."""
    path = Path(private_dir) / SUBDIR
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def worker_env(env: Mapping[str, str], private_dir: Path) -> dict[str, str]:
    """Variables to add to a worker's environment ``env``: none unless the user set a flight
    recorder buffer size > 0; then a dump prefix and a pipe stem in the run's private
    directory and dump-on-timeout, each only where the user did not choose one."""
    size = buffer_size(env)
    if not size or size <= 0:
        return {}
    where = Path(private_dir) / SUBDIR
    extra = {}
    if not any(env.get(n) for n in DUMP_FILE_VARS):
        extra["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(where / DUMP_PREFIX)
    if not env.get(PIPE_VAR):
        extra[PIPE_VAR] = str(where / PIPE_STEM)
    if not env.get(DUMP_ON_TIMEOUT_VAR):
        extra[DUMP_ON_TIMEOUT_VAR] = "1"
    return extra


def request_dumps(settings: TraceSettings, ranks: Iterable[int]) -> list[int]:
    """Write one byte into each rank's ``<pipe_stem><rank>.pipe``; return the ranks asked.

    Never blocks: a pipe nobody reads (no NCCL group yet, or a dead rank) is skipped, and so is
    anything at that path that is not a FIFO or is a symbolic link.
    """
    if not settings.pipe_stem:
        return []
    asked = []
    for rank in ranks:
        path = f"{settings.pipe_stem}{int(rank)}.pipe"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENXIO):
                log.warning("rank %d: cannot open NCCL dump pipe %s: %s", rank, path, exc)
            continue
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                log.warning("rank %d: %s is not a FIFO; not written", rank, path)
                continue
            os.write(fd, b"1")
            asked.append(int(rank))
        except OSError as exc:  # EAGAIN (pipe full: a dump is already asked for), EPIPE
            log.warning("rank %d: cannot write NCCL dump pipe %s: %s", rank, path, exc)
        finally:
            os.close(fd)
    return asked


def trace_file(stacks_dir: Path, cycle: int, rank: int) -> Path:
    """``stacks/cycle_<n>_rank_<r>.nccl_trace``."""
    return Path(stacks_dir) / f"cycle_{int(cycle)}_rank_{int(rank)}{TRACE_SUFFIX}"


def collect_traces(
    stacks_dir: Path,
    cycle: int,
    dump_prefix: str,
    ranks: Iterable[int],
    since: float | None = None,
    wait_s: float = 0.0,
    max_bytes: int = MAX_TRACE_BYTES,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> TraceCollection:
    """Move each rank's dump ``<dump_prefix><rank>`` to ``trace_file(stacks_dir, cycle, rank)``.

    Args:
        since: wall-clock time (``time.time()``) of the request; older files are stale.
        wait_s: how long to wait for dumps still being written (0: take what is there).
        max_bytes: a larger file is not taken.

    A dump is taken once its size held still for one poll. Returns what was collected and,
    for every other rank, why not.
    """
    pending = {int(r) for r in ranks}
    result = TraceCollection()
    seen_size: dict[int, int] = {}
    deadline = clock() + max(0.0, wait_s)
    while True:
        waiting = clock() < deadline
        for rank in sorted(pending):
            source = f"{dump_prefix}{rank}"
            size, why, may_change = _check_source(source, since, max_bytes)
            if size is not None and waiting and seen_size.get(rank) != size:
                seen_size[rank] = size  # first sight, or still growing: look once more
                size, why = None, "being written"
            if size is None:
                result.missing[rank] = why
                if not may_change:
                    pending.discard(rank)
                continue
            pending.discard(rank)
            result.missing.pop(rank, None)
            try:
                result.collected[rank] = _move(source, trace_file(stacks_dir, cycle, rank),
                                               max_bytes)
            except OSError as exc:
                result.missing[rank] = f"cannot copy: {exc.strerror or exc}"
                log.warning("rank %d: NCCL trace %s not collected: %s", rank, source, exc)
        if not pending or not waiting:
            return result
        sleep(POLL_S)


def _check_source(source: str, since: float | None,
                  max_bytes: int) -> tuple[int | None, str, bool]:
    """(size, "", _) when ``source`` is a dump to take, else (None, why, may it change?)."""
    try:
        st = os.lstat(source)
    except FileNotFoundError:
        return None, "no dump", True
    except OSError as exc:
        return None, f"cannot stat: {exc.strerror or exc}", False
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file", False
    if since is not None and st.st_mtime < since - 1.0:  # 1 s: coarse file-system clocks
        return None, "no dump since the request (an older one is left alone)", True
    if st.st_size > max_bytes:
        return None, f"larger than {max_bytes} bytes", False
    return st.st_size, "", True


def _move(source: str, dest: Path, max_bytes: int) -> Path:
    """Copy ``source`` (no symlink, a regular file, at most ``max_bytes``) to ``dest`` through
    a temporary file, then remove ``source`` so a later hang cannot collect it again."""
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes")
    finally:
        os.close(fd)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600)
    try:
        with os.fdopen(out, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        os.unlink(source)
    except OSError as exc:
        log.warning("NCCL trace %s copied but not removed: %s", source, exc)
    return dest
