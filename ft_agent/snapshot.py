"""A node-local snapshot store of three slots for one rank's training state.

``SnapshotStore(directory).snapshot(state, iteration, plan=...)`` blocks only while the
state's tensors are copied into a slot file that keeps nothing the plan keeps
(``ft_agent.snapshot_retention``: the world's pin, the copies at or above its floor, the
newest), mapped into memory and kept mapped between snapshots (so the copy neither pays for
fresh pages nor needs a second pass to write); a background thread then checksums that slot
and, last, writes its commit record (write + rename); for a small state (up to
``INLINE_BYTES``) ``snapshot()`` does that itself before it returns. The slot's old commit
record is removed before its first byte changes, so a writer killed at any point leaves
the other slots whole and loadable. ``load`` / ``latest`` / ``available_iterations`` read a
directory back, checking every tensor's CRC32 and refusing a tensor that holds NaN/Inf
where the writer saw none.

The directory must be the caller's own: a real directory (never followed through a symlink),
owned by this uid, mode 0700; files in it are opened with O_NOFOLLOW and must be regular
files of this uid. The format is in ``ft_agent.snapshot_format``; nothing here pickles.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ft_agent import snapshot_format as fmt
from ft_agent.snapshot_format import (
    MAX_COMMIT_BYTES,
    PREFIX,
    Commit,
    Header,
    SnapshotError,
    crc32,
    decode_tree,
    encode_commit,
    encode_tree,
    layout,
    parse_commit,
    parse_header,
    parse_prefix,
)
from ft_agent.snapshot_retention import SLOTS, Plan, write_slot

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
_WRITE_CHUNK = 64 * 2**20
# A state up to this size is checked and committed inside snapshot(), not in a thread.
INLINE_BYTES = 256 * 2**10

__all__ = [
    "Snapshot", "SnapshotError", "SnapshotStatus", "SnapshotStore", "SlotInfo", "WriteResult",
    "available_iterations", "committed_slots", "latest", "load", "uncommit", "verify_slot",
]


def slot_file(slot: str) -> str:
    return f"slot_{slot}.bin"


def commit_file(slot: str) -> str:
    return f"commit_{slot}.json"


@dataclass(frozen=True)
class SnapshotStatus:
    """What ``snapshot()`` did: ``started`` (a background write is under way, or for a
    small state done), or skipped with ``reason`` "busy" (the previous write is still
    running), "budget", "held" (every slot keeps a copy the plan keeps), "claim" (the
    slot's memory is being claimed in the background) or "io". ``copy_s``: the part of
    ``blocking_s`` that was not the claim of a fresh slot's memory (which only a snapshot
    that waits pays)."""

    started: bool
    iteration: int
    reason: str | None
    bytes: int
    blocking_s: float
    slot: str | None = None
    copy_s: float = 0.0


@dataclass(frozen=True)
class WriteResult:
    """How a background write ended; ``error`` is set (and the slot left uncommitted) when
    it failed, e.g. "io: [Errno 28] No space left on device"."""

    iteration: int
    slot: str
    ok: bool
    bytes: int
    seconds: float
    error: str | None = None
    cpu_s: float = 0.0  # CPU time the write's thread used
    inline: bool = False  # written inside snapshot() (a small state): its time is blocking_s's


@dataclass
class Snapshot:
    """A loaded, checked snapshot; ``rejected`` lists (slot, reason) of newer slots that
    failed their checks on the way."""

    state: Any
    iteration: int
    bytes: int
    seconds: float
    slot: str
    seq: int
    rejected: list[tuple[str, str]] = field(default_factory=list)


# -- the directory and its files: trust checks ------------------------------------------


def open_dir(directory: str | os.PathLike[str], create: bool = False) -> int:
    """A descriptor of ``directory`` after checking it is a real directory of this uid with
    mode 0700; with ``create``, makes it (and missing parents) 0700 first."""
    path = os.fspath(directory)
    if create:
        _make_private(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotError("missing", f"{path} does not exist") from None
    except OSError as e:
        # O_DIRECTORY|O_NOFOLLOW on a symlink fails with ENOTDIR on Linux, ELOOP elsewhere
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise SnapshotError("symlink", f"{path} is a symlink; refused") from None
        if e.errno == errno.ENOTDIR:
            raise SnapshotError("not_a_directory", f"{path} is not a directory") from None
        raise SnapshotError("io", f"{path}: {e}") from None
    try:
        _check_owned(os.fstat(fd), path, DIR_MODE)
    except SnapshotError:
        os.close(fd)
        raise
    return fd


def _make_private(path: str) -> None:
    missing = []
    p = Path(path)
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
            os.chmod(d, DIR_MODE, follow_symlinks=False)  # the umask may have narrowed it
        except FileExistsError:
            pass  # a concurrent creator; open_dir checks what is there
        except OSError as e:
            raise SnapshotError("io", f"cannot create {d}: {e}") from None


def _check_owned(st: os.stat_result, what: str, mode: int | None) -> None:
    if st.st_uid != os.getuid():
        raise SnapshotError("owner", f"{what} is owned by uid {st.st_uid}, not {os.getuid()}")
    if mode is not None and stat.S_IMODE(st.st_mode) != mode:
        raise SnapshotError("mode", f"{what} has mode {stat.S_IMODE(st.st_mode):o}, "
                            f"not {mode:o}")


def _open_read(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        raise SnapshotError("missing", f"no {name}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SnapshotError("symlink", f"{name} is a symlink; refused") from None
        raise SnapshotError("io", f"{name}: {e}") from None
    st = os.fstat(fd)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise SnapshotError("not_a_file", f"{name} is not a regular file")
        _check_owned(st, name, None)
    except SnapshotError:
        os.close(fd)
        raise
    return fd, st


def _read_exact(fd: int, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise SnapshotError("truncated", f"{what} ends early")
        got += n


def _read_small(dir_fd: int, name: str, bound: int) -> bytes:
    fd, st = _open_read(dir_fd, name)
    try:
        if st.st_size > bound:
            raise SnapshotError("format", f"{name} is {st.st_size} bytes, over {bound}")
        buf = bytearray(st.st_size)
        _read_exact(fd, memoryview(buf), name)
        return bytes(buf)
    except OSError as e:
        raise SnapshotError("io", f"{name}: {e}") from None
    finally:
        os.close(fd)


# -- reading -----------------------------------------------------------------------------


def _read_commit(dir_fd: int, slot: str) -> Commit:
    commit = parse_commit(_read_small(dir_fd, commit_file(slot), MAX_COMMIT_BYTES))
    if commit.slot != slot:
        raise SnapshotError("mismatch", f"{commit_file(slot)} names slot {commit.slot}")
    return commit


def _read_header(fd: int, size: int, commit: Commit, name: str) -> Header:
    if size != commit.file_bytes:
        raise SnapshotError("truncated", f"{name} is {size} bytes, its commit says "
                            f"{commit.file_bytes}")
    prefix = bytearray(PREFIX.size)
    _read_exact(fd, memoryview(prefix), name)
    header_len = parse_prefix(bytes(prefix), size)
    data = bytearray(header_len)
    _read_exact(fd, memoryview(data), name)
    if crc32(data) != commit.header_crc:
        raise SnapshotError("checksum", f"{name}: header checksum mismatch")
    header = parse_header(bytes(data), size)
    if header.iteration != commit.iteration:
        raise SnapshotError("mismatch", f"{name} holds iteration {header.iteration}, its "
                            f"commit says {commit.iteration}")
    if len(header.tensors) != len(commit.crcs) or sum(
            t.nbytes for t in header.tensors) != commit.tensor_bytes:
        raise SnapshotError("mismatch", f"{name}: tensors differ from its commit record")
    return header


def _read_tensors(fd: int, header: Header, commit: Commit, name: str) -> list[torch.Tensor]:
    import torch  # noqa: PLC0415 - torch only where tensors are read

    out = []
    for i, spec in enumerate(header.tensors):
        raw = torch.empty(spec.nbytes, dtype=torch.uint8)
        os.lseek(fd, spec.offset, os.SEEK_SET)
        view = memoryview(raw.numpy()) if spec.nbytes else memoryview(b"")
        _read_exact(fd, view, name)
        if crc32(view) != commit.crcs[i]:
            raise SnapshotError("checksum", f"{name}: tensor {i} checksum mismatch")
        t = raw.view(fmt.DTYPES[spec.dtype]).reshape(spec.shape)
        if not commit.nonfinite[i] and has_nonfinite(t):
            raise SnapshotError("nonfinite", f"{name}: tensor {i} holds NaN/Inf, which it "
                                "did not when snapshotted")
        out.append(t)
    return out


def has_nonfinite(t: torch.Tensor) -> bool:
    """Whether a tensor holds NaN or Inf (cheap: a sum first, the exact test only if the
    sum is not finite, which overflow alone can also cause)."""
    import torch  # noqa: PLC0415

    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return False
    if bool(torch.isfinite(t.sum())):
        return False
    return not bool(torch.isfinite(t).all())


def _load_slot(dir_fd: int, slot: str, commit: Commit) -> Snapshot:
    start = time.perf_counter()
    name = slot_file(slot)
    fd, st = _open_read(dir_fd, name)
    try:
        header = _read_header(fd, st.st_size, commit, name)
        tensors = _read_tensors(fd, header, commit, name)
    except OSError as e:
        raise SnapshotError("io", f"{name}: {e}") from None
    finally:
        os.close(fd)
    state = decode_tree(header.tree, tensors)
    return Snapshot(state, header.iteration, commit.tensor_bytes,
                    time.perf_counter() - start, slot, commit.seq)


def _commits(dir_fd: int) -> dict[str, Commit | SnapshotError]:
    out: dict[str, Commit | SnapshotError] = {}
    for slot in SLOTS:
        try:
            out[slot] = _read_commit(dir_fd, slot)
        except SnapshotError as e:
            out[slot] = e
    return out


def _guard(fn: Callable[[], Any]) -> Any:
    """Run a decoder; anything but SnapshotError escaping it is a decoder bug on hostile
    input, reported as a format error rather than raised as itself."""
    try:
        return fn()
    except SnapshotError:
        raise
    except Exception as e:  # noqa: BLE001 - the decoder's contract: one exception type
        raise SnapshotError("format", f"undecodable ({type(e).__name__}: {e})") from None


def available_iterations(directory: str | os.PathLike[str]) -> list[int]:
    """Iterations with a committed slot whose file matches its commit record (size, header
    checksum, header fields); the tensors' bytes are checked by ``load``. A missing
    directory has none; an untrusted one raises ``SnapshotError``."""
    try:
        dir_fd = open_dir(directory)
    except SnapshotError as e:
        if e.reason == "missing":
            return []
        raise

    def check() -> list[int]:
        found = set()
        for slot, commit in _commits(dir_fd).items():
            if isinstance(commit, SnapshotError):
                continue
            try:
                fd, st = _open_read(dir_fd, slot_file(slot))
                try:
                    found.add(_read_header(fd, st.st_size, commit, slot_file(slot)).iteration)
                finally:
                    os.close(fd)
            except (SnapshotError, OSError):
                continue
        return sorted(found)

    try:
        return _guard(check)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class SlotInfo:
    """A committed slot whose file matches its commit record (size, header checksum)."""

    slot: str
    iteration: int
    seq: int
    bytes: int


def committed_slots(directory: str | os.PathLike[str]
                    ) -> tuple[list[SlotInfo], list[tuple[str, str]]]:
    """The committed slots of ``directory`` that pass the cheap checks (as
    ``available_iterations``), and (slot, reason) for each committed one that does not.
    A missing directory has none; an untrusted one raises ``SnapshotError``. No torch."""
    try:
        dir_fd = open_dir(directory)
    except SnapshotError as e:
        if e.reason == "missing":
            return [], []
        raise

    def check() -> tuple[list[SlotInfo], list[tuple[str, str]]]:
        good, bad = [], []
        for slot, commit in _commits(dir_fd).items():
            if isinstance(commit, SnapshotError):
                if commit.reason != "missing":
                    bad.append((slot, str(commit)))
                continue
            try:
                fd, st = _open_read(dir_fd, slot_file(slot))
                try:
                    _read_header(fd, st.st_size, commit, slot_file(slot))
                finally:
                    os.close(fd)
            except SnapshotError as e:
                bad.append((slot, str(e)))
                continue
            except OSError as e:
                bad.append((slot, f"io: {e}"))
                continue
            good.append(SlotInfo(slot, commit.iteration, commit.seq, commit.tensor_bytes))
        return good, bad

    try:
        return _guard(check)
    finally:
        os.close(dir_fd)


def verify_slot(directory: str | os.PathLike[str], slot: str) -> str | None:
    """Check every tensor of a committed slot against its CRC32 without loading it (and
    without torch: the launcher calls this); None when whole, else why not."""
    try:
        dir_fd = open_dir(directory)
    except SnapshotError as e:
        return str(e)
    try:
        _guard(lambda: _verify_from(dir_fd, slot))
    except SnapshotError as e:
        return str(e)
    finally:
        os.close(dir_fd)
    return None


def _verify_from(dir_fd: int, slot: str) -> None:
    commit = _read_commit(dir_fd, slot)
    name = slot_file(slot)
    fd, st = _open_read(dir_fd, name)
    try:
        header = _read_header(fd, st.st_size, commit, name)
        chunk = bytearray(min(_WRITE_CHUNK, max((t.nbytes for t in header.tensors),
                                                default=0)))
        for i, spec in enumerate(header.tensors):
            crc, done = 0, 0
            while done < spec.nbytes:
                n = min(len(chunk), spec.nbytes - done)
                view = memoryview(chunk)[:n]
                os.lseek(fd, spec.offset + done, os.SEEK_SET)
                _read_exact(fd, view, name)
                crc = crc32(view, crc)
                done += n
            if crc != commit.crcs[i]:
                raise SnapshotError("checksum", f"{name}: tensor {i} checksum mismatch")
    except OSError as e:
        raise SnapshotError("io", f"{name}: {e}") from None
    finally:
        os.close(fd)


def uncommit(directory: str | os.PathLike[str], slot: str) -> None:
    """Remove a slot's commit record, so nothing loads it again (its bytes stay, to be
    overwritten by a later snapshot)."""
    dir_fd = open_dir(directory)
    try:
        os.unlink(commit_file(slot), dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dir_fd)


def load(directory: str | os.PathLike[str], iteration: int | None = None) -> Snapshot:
    """The newest committed slot that passes every check (or the one holding
    ``iteration``); raises ``SnapshotError`` ("none", "iteration" or the directory's
    fault) with ``rejected`` = (slot, reason) for each slot that failed."""
    dir_fd = open_dir(directory)
    try:
        return _guard(lambda: _load_from(dir_fd, iteration))
    finally:
        os.close(dir_fd)


def _load_from(dir_fd: int, iteration: int | None) -> Snapshot:
    rejected: list[tuple[str, str]] = []
    candidates = []
    for slot, commit in _commits(dir_fd).items():
        if isinstance(commit, SnapshotError):
            if commit.reason != "missing":
                rejected.append((slot, str(commit)))
        elif iteration is None or commit.iteration == iteration:
            candidates.append(commit)
    # Newest first by iteration, then by write order (after a roll-back both may match).
    candidates.sort(key=lambda c: (c.iteration, c.seq), reverse=True)
    for commit in candidates:
        try:
            snap = _load_slot(dir_fd, commit.slot, commit)
        except SnapshotError as e:
            rejected.append((commit.slot, str(e)))
            log.warning("snapshot slot %s (iteration %d) rejected: %s",
                        commit.slot, commit.iteration, e)
            continue
        snap.rejected = rejected
        return snap
    if iteration is not None:
        raise SnapshotError("iteration", f"no checked snapshot of iteration {iteration}",
                            rejected)
    raise SnapshotError("none", "no checked snapshot", rejected)


def latest(directory: str | os.PathLike[str]) -> Snapshot | None:
    """The newest checked snapshot in ``directory``, or None when there is none (use
    ``load`` to learn why each slot was rejected)."""
    try:
        return load(directory)
    except SnapshotError as e:
        if e.reason in ("none", "missing"):
            return None
        raise


# -- writing -----------------------------------------------------------------------------


@dataclass
class _Job:
    iteration: int
    slot: str
    seq: int
    head: bytes
    targets: list[torch.Tensor]  # each tensor's place in the slot's mapping
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # (pinned copy, target) of GPU tensors
    nbytes: int
    file_bytes: int


@dataclass
class _Mapping:
    """A slot file mapped for writing, kept between snapshots: the copy then writes straight
    into pages the file already has, and the background needs no second pass to write."""

    mm: mmap.mmap
    whole: torch.Tensor  # the mapping's bytes as one uint8 tensor
    inode: tuple[int, int]


class SnapshotStore:
    """One rank's snapshots in ``directory`` (created 0700 if missing; refused if it is
    not this uid's, not 0700, or a symlink).

    ``memory_budget`` (bytes, None = no limit) bounds what the store holds: its slot files
    (and, for a GPU state, one pinned host copy); a snapshot that would exceed it is skipped
    with reason "budget". At most one write is in flight. ``on_commit`` is called with each
    write's ``WriteResult``, from the write's thread (from ``snapshot()`` for a small state).
    """

    def __init__(self, directory: str | os.PathLike[str], *,
                 memory_budget: int | None = None,
                 on_commit: Callable[[WriteResult], None] | None = None) -> None:
        self.directory = Path(directory)
        self.memory_budget = memory_budget
        self.on_commit = on_commit
        self._dir_fd = open_dir(directory, create=True)
        self._maps: dict[str, _Mapping] = {}
        self._pinned: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None  # the write, or the claim, in flight
        self._claim_failed: tuple[str, int] | None = None
        self._last: WriteResult | None = None
        # slot -> (seq, iteration, file bytes) of its committed snapshot, or None
        self._slots: dict[str, tuple[int, int, int] | None] = {}
        for slot, c in _commits(self._dir_fd).items():
            self._slots[slot] = None if isinstance(c, SnapshotError) else (
                c.seq, c.iteration, c.file_bytes)
        # slot -> bytes its file holds (its memory is claimed); a missing file holds none
        self._claimed: dict[str, int] = {}
        for slot in SLOTS:
            try:
                st = os.stat(slot_file(slot), dir_fd=self._dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                self._claimed[slot] = st.st_size

    # public API -----------------------------------------------------------------------

    def snapshot(self, state: Any, iteration: int, *, wait: bool = False,
                 plan: Plan | None = None, force: bool = False) -> SnapshotStatus:
        """Copy ``state``'s tensors into a slot that keeps nothing ``plan`` keeps (None: only
        the newest copy is kept) and check and commit it in the background. If the previous
        write is still running: with ``wait`` wait for it, else skip ("busy"). With every
        slot kept: skip ("held"), unless ``force`` (then the oldest copy but the pin and the
        newest goes). A slot whose memory is not claimed yet (at the state's size) is
        claimed in the background and the snapshot skipped ("claim"), unless ``wait``. A
        slot file that cannot be made ready (a full tmpfs) is a skip with reason "io".
        Raises ``SnapshotError('unsupported')`` for a state it cannot hold (naming the
        path)."""
        start = time.perf_counter()
        if self._busy():
            if not wait:
                return SnapshotStatus(False, iteration, "busy", 0,
                                      time.perf_counter() - start)
            self.wait()
        tensors: list[Any] = []
        tree = encode_tree(state, tensors)
        sources = [_as_tensor(t, i) for i, t in enumerate(tensors)]
        sizes = [t.numel() * t.element_size() for t in sources]
        nbytes = sum(sizes)
        specs = [(fmt.DTYPE_NAMES[t.dtype], tuple(t.shape), n)
                 for t, n in zip(sources, sizes, strict=True)]
        head, placed, total = layout(iteration, tree, specs)
        pinned = sum(n for t, n in zip(sources, sizes, strict=True) if t.is_cuda)
        slot = write_slot(self.held(), plan, claimed=self._claimed, force=force)
        if slot is None:
            return SnapshotStatus(False, iteration, "held", nbytes, time.perf_counter() - start)
        others = sum(n for s, n in self._claimed.items() if s != slot)
        if not self._fits(total + others + pinned):
            return SnapshotStatus(False, iteration, "budget", nbytes,
                                  time.perf_counter() - start)
        if not wait and not self._ready(slot, total):
            return SnapshotStatus(False, iteration, self._claim_later(slot, total), nbytes,
                                  time.perf_counter() - start)
        seq = 1 + max((s[0] for s in self._slots.values() if s), default=0)
        self._slots[slot] = None  # from here until its commit, this slot holds nothing
        fresh = slot not in self._maps
        claim_start = time.perf_counter()
        try:
            self._unlink(commit_file(slot))
            whole = self._mapping(slot, total)
        except (OSError, SnapshotError) as e:
            log.warning("snapshot of iteration %d: slot %s not ready: %s", iteration, slot, e)
            return SnapshotStatus(False, iteration, "io", nbytes, time.perf_counter() - start)
        claim_s = time.perf_counter() - claim_start if fresh else 0.0
        whole[:len(head)].copy_(_uint8(head))
        targets, staged = self._copy(sources, placed, whole)
        job = _Job(iteration, slot, seq, head, targets, staged, nbytes, total)
        if total <= INLINE_BYTES:
            # Checked and committed here: for a small state, starting a thread and handing
            # it the interpreter's lock cost the step more than the checks themselves.
            self._write(job, inline=True)
        else:
            self._thread = threading.Thread(target=self._write, args=(job,), daemon=True,
                                            name=f"ft-snapshot-{slot}")
            self._thread.start()
        blocking = time.perf_counter() - start
        return SnapshotStatus(True, iteration, None, nbytes, blocking, slot, blocking - claim_s)

    def held(self) -> dict[str, int | None]:
        """Each slot's committed iteration (None: empty or being written)."""
        return {s: (held[1] if (held := self._slots.get(s)) else None) for s in SLOTS}

    def wait(self, timeout: float | None = None) -> WriteResult | None:
        """Wait for the write (or claim) in flight, if any; the last write's result."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return self._last

    @property
    def last_write(self) -> WriteResult | None:
        return self._last

    def load(self, iteration: int | None = None) -> Snapshot:
        """``load(self.directory, iteration)`` after the write in flight ends."""
        self.wait()
        return load(self.directory, iteration)

    def discard_newer_than(self, iteration: int) -> list[str]:
        """Uncommit slots holding an iteration after ``iteration`` (after the world rolled
        back to it, they are a future that will not happen); the slots discarded."""
        self.wait()
        dropped = []
        for slot, held in self._slots.items():
            if held and held[1] > iteration:
                self._unlink(commit_file(slot))
                self._slots[slot] = None
                dropped.append(slot)
        return dropped

    def close(self) -> None:
        """Wait for the write in flight, then release the mappings and the directory."""
        self.wait()
        for slot in list(self._maps):
            self._unmap(slot)
        self._pinned = []
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # internals ------------------------------------------------------------------------

    def _fits(self, nbytes: int) -> bool:
        return self.memory_budget is None or nbytes <= self.memory_budget

    def _busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _ready(self, slot: str, size: int) -> bool:
        """Whether ``slot`` is mapped at ``size`` already (a copy into it claims nothing)."""
        kept = self._maps.get(slot)
        return kept is not None and len(kept.mm) == size

    def _claim_later(self, slot: str, size: int) -> str:
        """Start claiming ``slot``'s memory in the background; the skip's reason ("claim",
        or "io" when the last claim of it failed). Claiming costs many times the copy, and
        more while other processes claim theirs: never on the step. The next snapshot due
        finds the slot ready."""
        failed, self._claim_failed = self._claim_failed, None
        if failed == (slot, size):
            return "io"
        self._thread = threading.Thread(target=self._claim, args=(slot, size), daemon=True,
                                        name=f"ft-snapshot-claim-{slot}")
        self._thread.start()
        return "claim"

    def _claim(self, slot: str, size: int) -> None:
        """The background claim of a slot's memory (``snapshot`` waits for none)."""
        try:
            self._mapping(slot, size)
        except (OSError, SnapshotError) as e:
            log.warning("snapshot slot %s not ready: %s", slot, e)
            self._claim_failed = (slot, size)

    def _mapping(self, slot: str, size: int) -> torch.Tensor:
        """The slot file's bytes, ``size`` long, mapped: the kept mapping when the file is
        still the one mapped at that size, else the file opened (or made), given every page
        now and mapped afresh."""
        import torch  # noqa: PLC0415

        name = slot_file(slot)
        kept = self._maps.get(slot)
        if kept is not None:
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == kept.inode and st.st_size == size == len(kept.mm):
                    return kept.whole
            except FileNotFoundError:
                pass
            self._unmap(slot)
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                     dir_fd=self._dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SnapshotError("not_a_file", f"{name} is not a regular file")
            _check_owned(st, name, None)
            if st.st_size > size:
                os.ftruncate(fd, size)
            # Every page allocated up front: on a full tmpfs this fails with ENOSPC, where a
            # store into a page of the mapping that tmpfs cannot back would raise SIGBUS.
            os.posix_fallocate(fd, 0, size)
            self._claimed[slot] = size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        # Map every page now (a read of one byte each, in torch: without the GIL), so the
        # copy takes no page fault. Not MAP_POPULATE: it holds the process's memory-map
        # lock for the whole claim, and the training thread's page faults and allocations
        # wait for it (a 200 MB claim in the background stalled the step for all of it).
        whole[::mmap.PAGESIZE].sum()
        self._maps[slot] = _Mapping(mm, whole, (st.st_dev, st.st_ino))
        return whole

    def _unmap(self, slot: str) -> None:
        kept = self._maps.pop(slot)
        del kept.whole
        try:
            kept.mm.close()
        except BufferError:
            pass  # a view of it is still referenced: it is unmapped when that goes

    def _copy(self, sources: list[torch.Tensor], placed: list[fmt.TensorSpec],
              whole: torch.Tensor
              ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The blocking part: each CPU tensor copied into its place in the slot; each GPU
        tensor into a pinned host copy (kept between snapshots), which the background
        moves into the slot, so the step waits only for the device-to-host copy."""
        import torch  # noqa: PLC0415

        targets, staged, pinned = [], [], []
        old = iter(self._pinned)
        for src, spec in zip(sources, placed, strict=True):
            dst = whole[spec.offset:spec.offset + spec.nbytes].view(src.dtype).view(src.shape)
            targets.append(dst)
            if not src.is_cuda:
                dst.copy_(src)
                continue
            buf = next(old, None)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            buf.copy_(src)
            staged.append((buf, dst))
            pinned.append(buf)
        self._pinned = pinned
        return targets, staged

    def _write(self, job: _Job, inline: bool = False) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            self._commit(job)
        except Exception as e:  # noqa: BLE001 - a failed write is reported, never raised
            kind = "io" if isinstance(e, OSError) else type(e).__name__
            self._last = WriteResult(job.iteration, job.slot, False, job.nbytes,
                                     time.perf_counter() - start, f"{kind}: {e}",
                                     time.thread_time() - cpu, inline)
            log.warning("snapshot of iteration %d to slot %s failed: %s",
                        job.iteration, job.slot, e)
        else:
            self._slots[job.slot] = (job.seq, job.iteration, job.file_bytes)
            self._last = WriteResult(job.iteration, job.slot, True, job.nbytes,
                                     time.perf_counter() - start, cpu_s=time.thread_time() - cpu,
                                     inline=inline)
        if self.on_commit is not None:
            try:
                self.on_commit(self._last)
            except Exception:  # noqa: BLE001 - the caller's callback must not end the write
                log.exception("snapshot on_commit callback raised")
        if self._last.ok:
            self._prepare_another(job)

    def _prepare_another(self, job: _Job) -> None:
        """Claim and map a second slot now, when only one is: claiming a slot's pages costs
        many times the copy, so the step that first writes there would otherwise wait for
        it. The third is claimed when a write first needs it (a rank ahead of the world's
        pin). Runs in the write's thread (or inside the small state's ``snapshot()``), so
        no snapshot can be choosing a slot meanwhile."""
        if len(self._claimed) >= 2:
            return
        other = next((s for s in SLOTS if s not in self._claimed and s != job.slot), None)
        pinned = sum(b.numel() * b.element_size() for b in self._pinned)
        if other is None or not self._fits(sum(self._claimed.values()) + job.file_bytes
                                           + pinned):
            return  # a later snapshot will be skipped for its budget anyway
        try:
            self._mapping(other, job.file_bytes)
        except (OSError, SnapshotError) as e:
            # The snapshot that needs it tries again and reports what it finds.
            log.debug("slot %s not prepared: %s", other, e)

    def _commit(self, job: _Job) -> None:
        for buf, dst in job.staged:
            dst.copy_(buf)
        crcs = [crc32(_bytes_of(t)) for t in job.targets]
        nonfinite = [has_nonfinite(t) for t in job.targets]
        commit = Commit(job.slot, job.seq, job.iteration, job.file_bytes,
                        crc32(job.head[PREFIX.size:]), job.nbytes, tuple(crcs),
                        tuple(nonfinite), time.time())
        tmp = commit_file(job.slot) + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=self._dir_fd)
        try:
            _write_all(fd, memoryview(encode_commit(commit)), 0)
        finally:
            os.close(fd)
        os.rename(tmp, commit_file(job.slot), src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass


def _as_tensor(value: Any, index: int) -> torch.Tensor:
    import torch  # noqa: PLC0415

    if not isinstance(value, torch.Tensor):
        try:
            value = torch.from_numpy(value)
        except (TypeError, ValueError) as e:
            raise SnapshotError("unsupported", f"numpy array {index}: {e}") from None
    if value.layout != torch.strided or value.dtype not in fmt.DTYPE_NAMES:
        raise SnapshotError("unsupported", f"tensor {index}: {value.dtype}/{value.layout} "
                            f"(dense {', '.join(fmt.DTYPE_SIZES)} only)")
    return value.detach()


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    import torch  # noqa: PLC0415

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _uint8(data: bytes) -> torch.Tensor:
    import torch  # noqa: PLC0415

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _WRITE_CHUNK], offset + done)
