"""A rank directory's slots, read and written in the store's own on-disk format
(``ft_agent.snapshot``), for replicas streamed between nodes.

``SlotReader`` opens a directory's newest committed slot (or a given iteration's) to stream
it out; ``SlotWriter`` receives one into a slot that keeps nothing the plan keeps
(``ft_agent.snapshot_retention``: the world's pin, the copies at or above its floor, the
newest): it removes that slot's commit record first, writes the bytes, and only then writes
the new commit record (write + rename), so a transfer cut at any point leaves every kept
copy whole. The directory is checked like the store's (0700, this uid, no symlink).
"""

from __future__ import annotations

import os
from dataclasses import replace

from ft_agent.snapshot import FILE_MODE, commit_file, open_dir, slot_file
from ft_agent.snapshot_format import (
    MAX_COMMIT_BYTES,
    Commit,
    SnapshotError,
    encode_commit,
    parse_commit,
)
from ft_agent.snapshot_retention import SLOTS, Plan, write_slot

_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def rank_dir_name(rank: int) -> str:
    """The directory of ``rank``'s replica under a replica root."""
    return f"rank_{rank}"


def read_commits(dir_fd: int) -> dict[str, tuple[Commit, bytes]]:
    """Each slot's parsed commit record and its raw bytes, for slots whose record is there,
    readable, names its own slot and whose slot file has the size it records."""
    out = {}
    for slot in SLOTS:
        try:
            raw = _read_small(dir_fd, commit_file(slot))
            commit = parse_commit(raw)
            st = os.stat(slot_file(slot), dir_fd=dir_fd, follow_symlinks=False)
        except (SnapshotError, OSError):
            continue
        if commit.slot == slot and st.st_size == commit.file_bytes:
            out[slot] = (commit, raw)
    return out


def _read_small(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, _O_READ, dir_fd=dir_fd)
    try:
        data = os.read(fd, MAX_COMMIT_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_COMMIT_BYTES:
        raise SnapshotError("format", f"{name} is over {MAX_COMMIT_BYTES} bytes")
    return data


def claimed_bytes(dir_fd: int) -> dict[str, int]:
    """The memory each slot's file holds (its allocated blocks), for the slots that have a
    file."""
    out = {}
    for slot in SLOTS:
        try:
            st = os.stat(slot_file(slot), dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        out[slot] = st.st_blocks * 512
    return out


def claimed_slots(dir_fd: int) -> frozenset[str]:
    """Slots whose file already holds memory."""
    return frozenset(s for s, n in claimed_bytes(dir_fd).items() if n > 0)


def next_slot(directory: str | os.PathLike[str], avoid: frozenset[str],
              plan: Plan | None) -> tuple[str | None, dict[str, int]]:
    """The slot a ``SlotWriter`` would write now (None: none) and what every slot's file
    has claimed."""
    dir_fd = open_dir(directory, create=True)
    try:
        claimed = claimed_bytes(dir_fd)
        slot = target_slot(read_commits(dir_fd), plan, avoid,
                           frozenset(s for s, n in claimed.items() if n > 0))
        return slot, claimed
    finally:
        os.close(dir_fd)


def claim(directory: str | os.PathLike[str], slot: str, size: int) -> None:
    """Give ``slot``'s file ``size`` bytes of memory now (tmpfs pages, zeroed), so a
    transfer into it later claims nothing. A committed copy in it stays whole unless the
    file grows (then its size no longer matches its commit record: it is not offered)."""
    dir_fd = open_dir(directory, create=True)
    try:
        fd = os.open(slot_file(slot), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise SnapshotError("owner", f"{slot_file(slot)} is not this uid's")
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def newest(commits: dict[str, tuple[Commit, bytes]], iteration: int | None = None,
           skip: frozenset[tuple[str, int]] = frozenset()) -> tuple[Commit, bytes] | None:
    """The newest commit (by iteration, then write order), or the newest of ``iteration``;
    ``skip`` holds (slot, seq) pairs already found bad."""
    found = [c for c in commits.values() if (iteration is None or c[0].iteration == iteration)
             and (c[0].slot, c[0].seq) not in skip]
    return max(found, key=lambda c: (c[0].iteration, c[0].seq), default=None)


def target_slot(commits: dict[str, tuple[Commit, bytes]], plan: Plan | None,
                avoid: frozenset[str] = frozenset(),
                claimed: frozenset[str] = frozenset()) -> str | None:
    """The slot to write, ``plan`` deciding which copies stay (None: only the newest);
    never one in ``avoid``; None when every other slot keeps a copy."""
    held = {s: (commits[s][0].iteration if s in commits else None)
            for s in SLOTS if s not in avoid}
    return write_slot(held, plan, claimed=claimed) if held else None


class SlotReader:
    """An open committed slot file of a rank directory, to read in chunks."""

    def __init__(self, directory: str | os.PathLike[str], iteration: int | None = None,
                 skip: frozenset[tuple[str, int]] = frozenset()) -> None:
        dir_fd = open_dir(directory)
        try:
            found = newest(read_commits(dir_fd), iteration, skip)
            if found is None:
                what = "a committed snapshot" if iteration is None else f"iteration {iteration}"
                raise SnapshotError("none", f"{os.fspath(directory)} holds no {what}")
            self.commit, self.commit_bytes = found
            self.fd = os.open(slot_file(self.commit.slot), _O_READ, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        if os.fstat(self.fd).st_size != self.commit.file_bytes:
            os.close(self.fd)
            raise SnapshotError("truncated", "slot file size differs from its commit")

    @property
    def size(self) -> int:
        return self.commit.file_bytes

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
        data = os.pread(self.fd, min(n, self.size - offset), offset)
        if offset < self.size and not data:
            raise SnapshotError("truncated", "slot file ends early")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotWriter:
    """Receives one slot into a rank directory (created 0700 if missing), into a slot that
    keeps nothing ``plan`` keeps and is not in ``avoid`` (being read); refuses with
    ``SnapshotError('busy')`` when there is none."""

    def __init__(self, directory: str | os.PathLike[str],
                 avoid: frozenset[str] = frozenset(), plan: Plan | None = None) -> None:
        self.dir_fd = open_dir(directory, create=True)
        self.fd = -1
        try:
            commits = read_commits(self.dir_fd)
            slot = target_slot(commits, plan, avoid, claimed_slots(self.dir_fd))
            if slot is None:
                raise SnapshotError("busy", "every slot keeps a copy the plan keeps, or is "
                                    "being read")
            self.slot = slot
            self.seq = 1 + max((c.seq for c, _ in commits.values()), default=0)
            self._unlink(commit_file(self.slot))
            self.fd = os.open(slot_file(self.slot), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW |
                              os.O_CLOEXEC, FILE_MODE, dir_fd=self.dir_fd)
            if os.fstat(self.fd).st_uid != os.getuid():
                raise SnapshotError("owner", f"{slot_file(self.slot)} is not this uid's")
        except BaseException:
            self.close()
            raise

    def write(self, offset: int, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)

    def commit(self, commit: Commit) -> Commit:
        """Cut the slot file to size and write its commit record (renamed to this slot and
        numbered after the directory's others), last; the record written."""
        os.ftruncate(self.fd, commit.file_bytes)
        mine = replace(commit, slot=self.slot, seq=self.seq)
        tmp = commit_file(self.slot) + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=self.dir_fd)
        try:
            view, done = memoryview(encode_commit(mine)), 0
            while done < len(view):
                done += os.write(fd, view[done:])
        finally:
            os.close(fd)
        os.rename(tmp, commit_file(self.slot), src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        return mine

    def close(self) -> None:
        """Release the files; an uncommitted slot stays uncommitted (never loaded)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
