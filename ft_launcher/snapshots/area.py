"""Where one job's snapshots live on this node.

``/dev/shm/ft_snapshots-<uid>-<run id>-<hash>`` (``/dev/shm`` when present, else the run
directory's private ``ipc/``): the uid and a hash of the run id and run directory keep
another user's or another job's area apart. The directory is 0700 and holds one 0700
subdirectory per global rank (``rank_<N>``). One already there that is this user's and
private is a leftover of the same job (a launcher killed by SIGKILL cannot remove it): it
is removed at start. One owned by another user, or with another mode, is refused: the job
runs without snapshots. The directory itself is made by whoever first writes in it (a
rank's store makes it, 0700, with the rank's own directory): a job whose training never
snapshots leaves nothing behind, even when its launcher is SIGKILLed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ft_launcher")

SHM = Path("/dev/shm")
PREFIX = "ft_snapshots"
DIR_MODE = 0o700


class AreaRefused(Exception):
    """The snapshot directory cannot be trusted or made; the message says why."""


def area_name(uid: int, run_id: str, run_dir: str) -> str:
    """The directory's name: readable (uid, run id) and unique per (run id, run dir)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:40] or "run"
    digest = hashlib.sha256(f"{run_id}\0{run_dir}".encode()).hexdigest()[:12]
    return f"{PREFIX}-{uid}-{safe}-{digest}"


def default_root(private_dir: Path, shm: Path = SHM) -> Path:
    """Shared memory when the node has it, else the run directory's private ``ipc/``."""
    return shm if shm.is_dir() else private_dir


@dataclass
class Area:
    """One job's snapshot directory on this node; ``make`` then ``remove``."""

    path: Path
    stale_removed: bool = False

    def make(self) -> None:
        """Create the directory (removing a stale one of this job); AreaRefused when the
        path is someone else's or not private."""
        self.clear()
        try:
            os.mkdir(self.path, DIR_MODE)
            os.chmod(self.path, DIR_MODE, follow_symlinks=False)  # the umask may narrow it
        except OSError as e:
            raise AreaRefused(f"cannot create {self.path}: {e.strerror or e}") from None

    def clear(self) -> None:
        """Remove a stale one of this job, making nothing; AreaRefused when the path is
        someone else's or not private."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise AreaRefused(f"{self.path}: {e.strerror or e}") from None
        check_leftover(self.path, st)
        shutil.rmtree(self.path)
        self.stale_removed = True
        log.warning("removed a stale snapshot directory of this job: %s", self.path)

    def remove_if_ours(self) -> bool:
        """Remove the directory when it is this user's and private (never someone else's,
        which a rank would have refused); whether one went. Never raises."""
        try:
            check_leftover(self.path, os.lstat(self.path))
        except (AreaRefused, OSError):
            return False
        self.remove()
        return True

    def rank_dir(self, rank: int) -> Path:
        """Rank ``rank``'s directory (created 0700 by the rank's store on first use)."""
        return self.path / f"rank_{rank}"

    def remove(self) -> None:
        """Remove the directory and everything in it; never raises."""
        shutil.rmtree(self.path, ignore_errors=True)

    def remove_stale(self) -> bool:
        """Remove a leftover of this job that this launcher never made (its predecessor's,
        SIGKILLed) when it is this user's private directory; whether one went. Never
        raises."""
        if not self.remove_if_ours():
            return False
        log.warning("removed a stale snapshot directory of this job: %s", self.path)
        return True


def check_leftover(path: Path, st: os.stat_result) -> None:
    """Refuse a leftover that is not a real 0700 directory of this user."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise AreaRefused(f"{path} exists and is not a directory; refused")
    if st.st_uid != os.geteuid():
        raise AreaRefused(f"{path} is owned by uid {st.st_uid}, not {os.geteuid()}; refused")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        raise AreaRefused(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not "
                          f"{DIR_MODE:o}; refused")
