"""Learned preloads, the launcher's side: which modules the zygote should import next.

Each warm worker records the installed modules its script imported in the run's private
directory (``worker_side/learning.py``: ``learned_<LOCAL_RANK>``, written a few times with
growing gaps after activation). The launcher reads those files on a schedule that follows
the latest activation (``ScanClock``), treats them as untrusted (bounded size, valid module
names only: ``decode_names``), and keeps the book of what was offered, learned and refused
(``PreloadBook``). A round of learning hands the pending names to the zygote, which forks a
learner that imports them (``zygote_link.ZygoteSide.start_learning``); a module it refuses
is never tried again in the job, and what was learned and refused is kept under
``"preload"`` in ``ft_state.json``, so a requeued job preloads it from its first cycle.

``PreloadLearning`` drives it from the standby pool's ``tick``; the rest is pure, apart from
``read_names_file`` and the state file's ``load_state`` / ``save_state``.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_launcher.rundir import read_json_object, write_json_atomic
from ft_launcher.warm.standby_process import memory_mb
from ft_launcher.warm.worker_side.learning import FILE_PREFIX, MAX_NAMES, valid_name
from ft_launcher.warm.zygote_link import LearnResult, ZygoteSide

log = logging.getLogger("ft_launcher")

# After an activation: the workers write at 1, 3, 10, 30 and 90 s (learning.RECORD_AT_S);
# one more look later catches a write that a busy machine delayed.
SCAN_AFTER_S = (1.5, 4.0, 11.0, 31.0, 91.0, 150.0)
MAX_FILE_BYTES = 512 * 1024
# Failed rounds per job: each refusal costs a learner, so a bad stack cannot loop. (Rounds
# that succeed are bounded by the module names: each makes some known.)
MAX_FAILED_ROUNDS = 12
STATE_KEY = "preload"
MAX_REASON_CHARS = 300


def excluded(name: str) -> bool:
    """Never learned: private names, ``__main__``, the launcher itself."""
    top = name.split(".")[0]
    return top.startswith("_") or top == "ft_launcher"


def decode_names(data: bytes) -> list[str]:
    """The valid module names of a worker's file, in order, without repeats; anything else
    (binary, overlong lines, a path) is dropped. Never raises."""
    if len(data) > MAX_FILE_BYTES:
        return []
    seen: dict[str, None] = {}
    for line in data.decode("ascii", errors="replace").splitlines():
        name = line.strip()
        if valid_name(name) and not excluded(name):
            seen[name] = None
        if len(seen) >= MAX_NAMES:
            break
    return list(seen)


def read_names_file(path: Path) -> list[str]:
    """``decode_names`` of a worker's file; [] when it is missing or not a small regular
    file of this user (never through a link, never blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                or st.st_size > MAX_FILE_BYTES:
            return []
        return decode_names(os.read(fd, MAX_FILE_BYTES + 1))
    except OSError:
        return []
    finally:
        os.close(fd)


def read_workers(directory: Path, local_ranks: int) -> list[str]:
    """The names every local rank's worker recorded, rank 0's first."""
    names: dict[str, None] = {}
    for local_rank in range(local_ranks):
        names.update(dict.fromkeys(read_names_file(directory / f"{FILE_PREFIX}{local_rank}")))
    return list(names)


@dataclass
class ScanClock:
    """When to read the workers' files: ``SCAN_AFTER_S`` after the latest activation."""

    activated_at: float | None = None
    done: int = 0

    def activated(self, now: float) -> None:
        self.activated_at, self.done = now, 0

    def due(self) -> float | None:
        """The clock time of the next scan, None when none is left."""
        if self.activated_at is None or self.done >= len(SCAN_AFTER_S):
            return None
        return self.activated_at + SCAN_AFTER_S[self.done]

    def take(self, now: float) -> bool:
        """Whether a scan is due at ``now`` (and count it)."""
        due = self.due()
        if due is None or now < due:
            return False
        while self.done < len(SCAN_AFTER_S) and self.activated_at + SCAN_AFTER_S[self.done] <= now:
            self.done += 1  # a late look stands for every one it missed
        return True


def _under(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")


def parents_first(names: list[str]) -> list[str]:
    """``names`` with each package before its submodules (``sys.modules`` lists a package
    after them: it is moved to the end once its own import finishes). Importing a submodule
    runs its packages first anyway; tried first, a package that is refused takes its
    submodules out in the same round instead of one round each."""
    present = set(names)
    ordered: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in present:
                ordered.setdefault(prefix)
    return list(ordered)


@dataclass
class PreloadBook:
    """What the zygote has (``known``: the configured preloads and what it learned), what
    waits for the next round (``pending``, in the workers' import order), what a learner is
    importing (``in_flight``) and what was refused, with why."""

    known: set[str] = field(default_factory=set)
    learned: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)
    failed_rounds: int = 0

    def offer(self, names: list[str]) -> int:
        """Queue the names not known, refused (or under a refused package) or queued; how
        many were queued."""
        queued = set(self.pending) | set(self.in_flight)
        added = 0
        for name in names:
            if excluded(name) or name in self.known or name in queued \
                    or any(_under(name, r) for r in self.refused):
                continue
            self.pending.append(name)
            queued.add(name)
            added += 1
        return added

    def can_start(self) -> bool:
        return bool(self.pending) and not self.in_flight \
            and self.failed_rounds < MAX_FAILED_ROUNDS

    def start_round(self) -> list[str]:
        self.in_flight, self.pending = parents_first(self.pending), []
        return list(self.in_flight)

    def on_learned(self) -> list[str]:
        """The round succeeded: its names are the zygote's now. Returns them."""
        names, self.in_flight = self.in_flight, []
        self.learned += names
        self.known.update(names)
        return names

    def on_refused(self, name: str | None, reason: str) -> None:
        """The round failed at ``name`` (None: before any import): refuse it and what lies
        under it; the rest of the round waits for the next one, in order."""
        rest, self.in_flight = self.in_flight, []
        self.failed_rounds += 1
        if name is not None:
            self.refused[name] = reason[:MAX_REASON_CHARS]
            rest = [n for n in rest if not _under(n, name)]
            self.pending = [n for n in self.pending if not _under(n, name)]
        self.pending = rest + [n for n in self.pending if n not in rest]

    def to_json(self) -> dict[str, Any]:
        return {"learned": list(self.learned), "refused": dict(self.refused)}


def top_level(names: list[str]) -> list[str]:
    """The packages behind ``names``, sorted (what an event or a report line shows)."""
    return sorted({n.split(".")[0] for n in names})


def load_state(path: Path) -> tuple[list[str], dict[str, str]]:
    """What an earlier job learned and refused, from ``ft_state.json``; anything invalid
    is dropped."""
    data = read_json_object(path).get(STATE_KEY)
    if not isinstance(data, dict):
        return [], {}
    learned = data.get("learned")
    refused = data.get("refused")
    names = [n for n in learned[:MAX_NAMES] if isinstance(n, str) and valid_name(n)
             and not excluded(n)] if isinstance(learned, list) else []
    why = {n: r[:MAX_REASON_CHARS] for n, r in list(refused.items())[:MAX_NAMES]
           if isinstance(n, str) and valid_name(n) and isinstance(r, str)} \
        if isinstance(refused, dict) else {}
    return names, why


def save_state(path: Path, book: PreloadBook) -> None:
    """Keep the book in ``ft_state.json`` beside the learned timeouts (never raises)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**read_json_object(path), STATE_KEY: book.to_json()})
    except OSError as exc:
        log.warning("cannot write state file %s: %s", path, exc)


class PreloadLearning:
    """The job's learning: reads the workers' lists when due, starts a round when the zygote
    can take one, and reports each round (``preload_learned``, ``preload_refused``)."""

    def __init__(self, directory: Path, local_ranks: int, state_path: Path,
                 preload: list[str], event: Callable[..., Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory, self.local_ranks, self.state_path = directory, local_ranks, state_path
        self.event, self.clock = event, clock
        self.book = PreloadBook(known=set(preload))
        learned, refused = load_state(state_path)
        self.book.refused.update(refused)
        # What an earlier job learned is learned again before the first cycle starts.
        self.from_state = self.book.offer(learned) > 0
        self.scans = ScanClock()

    def activated(self) -> None:
        """Workers were made from standbys just now: their lists follow."""
        self.scans.activated(self.clock())

    def holds_first_cycle(self) -> bool:
        """A round of what an earlier job learned is under way or due: the first cycle's
        standbys wait for it."""
        return self.from_state and (bool(self.book.in_flight) or self.book.can_start())

    def due(self) -> float | None:
        """When (``clock``) ``tick`` must look at the workers' lists next."""
        return self.scans.due()

    def tick(self, zygotes: ZygoteSide) -> None:
        result = zygotes.learner_tick(time.monotonic())
        if result is not None:
            self._on_result(result)
        if self.scans.take(self.clock()):
            self.book.offer(read_workers(self.directory, self.local_ranks))
        if self.book.can_start() and zygotes.can_learn():
            why = zygotes.start_learning(self.book.start_round())
            if why is not None:
                log.warning("learned preloads: %s", why)
                self.book.on_refused(None, why)

    def _on_result(self, result: LearnResult) -> None:
        if result.refused is not None:
            name, reason = result.refused
            if name is None or name not in self.book.in_flight:
                log.warning("learned preloads: a round failed before any import: %s", reason)
                name = None
            else:
                self.event("preload_refused", module=name, reason=reason[:MAX_REASON_CHARS])
            self.book.on_refused(name, reason)
        else:
            assert result.pid is not None
            names = self.book.on_learned()
            self.event("preload_learned", modules=top_level(names), count=len(names),
                       imported=result.imported, import_s=result.import_s,
                       cpu_s=result.cpu_s, pid=result.pid, warmed=result.warmed,
                       from_state=self.from_state, **memory_mb(result.pid))
            self.from_state = False
        save_state(self.state_path, self.book)
