"""The liveness model: per-rank activity, deadlines and hang verdicts, on an injected clock.

Pure: no socket, no file, no signal. Every method takes the time (the node's monotonic
clock) from its caller, so each rule is unit-tested with a fake clock. The monitor decodes
frames into calls on this model; the supervisor asks it for the next deadline and verdicts.

Deadlines of an active rank:

- before its first activity (heartbeat, section, progress): ``spawned_at + initial``;
- after it: ``last heartbeat + heartbeat`` (once it heartbeats), ``opened + section`` for each
  open section, and ``last section end + out_of_section`` while no section is open.

Activity messages carry the sender's monotonic stamp; a stamp is kept between the rank's
previous activity and the time it was read, so a bogus stamp cannot move a deadline.

The launcher's own stalls (a VM pause, CPU starvation, SIGSTOP) are not the ranks' fault: a
wake-up much later than planned holds every verdict for ``STALL_SETTLE_S`` so that messages
queued during the stall are read before anyone is judged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ft_agent.protocol import HEARTBEAT_FOLD_S
from ft_launcher.hang.timeouts import (
    TIMEOUT_HEARTBEAT,
    TIMEOUT_INITIAL,
    TIMEOUT_OUT_OF_SECTION,
    TimeoutBook,
    section_kind,
)

SAMPLES_KEPT = 20_000  # per rank and kind, for the interval statistics
MAX_OPEN_SECTIONS = 64  # per rank: more at once is a bug in the training, not a section
MAX_KINDS_PER_RANK = 64  # distinct section names sampled per rank
STALL_THRESHOLD_S = 1.0  # a wake-up this much later than planned is the launcher's stall
STALL_SETTLE_S = 1.0  # verdicts wait this long after a stall, while queued messages are read


@dataclass
class HangVerdict:
    """Which rank went silent, for which timeout, and for how long."""

    rank: int
    local_rank: int
    timeout_kind: str  # "initial", "heartbeat", "out_of_section" or "section:<name>"
    timeout_s: float
    silence_s: float


@dataclass
class Samples:
    """Intervals of one kind for one rank: exact count/min/max, a bounded sample for ranks."""

    count: int = 0
    lo: float = float("inf")
    hi: float = 0.0
    kept: list[float] = field(default_factory=list)

    def add(self, value: float, rng: random.Random) -> None:
        self.count += 1
        self.lo, self.hi = min(self.lo, value), max(self.hi, value)
        if len(self.kept) < SAMPLES_KEPT:
            self.kept.append(value)
        else:  # reservoir sampling keeps the sample uniform over the whole cycle
            j = rng.randrange(self.count)
            if j < SAMPLES_KEPT:
                self.kept[j] = value

    def stats(self) -> dict[str, float]:
        ordered = sorted(self.kept)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

        return {
            "count": self.count,
            "min": round(self.lo, 6),
            "p50": round(pct(0.5), 6),
            "p99": round(pct(0.99), 6),
            "max": round(self.hi, 6),
        }


@dataclass
class RankLiveness:
    """What the model knows about one local rank in this cycle (monotonic times)."""

    rank: int
    local_rank: int
    spawned_at: float
    # False after goodbye or exit: no deadlines. What the rank said is still recorded: the
    # launcher may see a rank's exit before it reads the last frames the rank sent.
    active: bool = True
    first_activity: float | None = None
    last_activity: float | None = None
    last_hb: float | None = None
    hb_folds: bool = False  # the last heartbeat said the rank folds heartbeats
    sections: dict[str, float] = field(default_factory=dict)  # open name -> opened at
    last_section_end: float | None = None
    samples: dict[str, Samples] = field(default_factory=dict)
    iteration: int | None = None  # last step the rank reported
    progress_at: float | None = None  # when it reported it
    checkpoint: int | None = None  # last step it reported a checkpoint of

    def floor(self) -> float:
        """The latest time this rank is already known to have been active."""
        return max(self.last_activity or self.spawned_at, self.spawned_at)


@dataclass
class Progress:
    """What a progress report changed, for the caller to record."""

    first_step: bool
    checkpoint: bool
    at: float  # when the rank reported it (its stamp, clamped)


class Liveness:
    """Every local rank's liveness in one cycle, with the timeouts of a ``TimeoutBook``."""

    def __init__(self, book: TimeoutBook, seed: int = 0) -> None:
        self.book = book
        self.ranks: dict[int, RankLiveness] = {}
        self.hold_until = -math.inf
        self.rejected: dict[str, int] = {}  # what the model refused, counted per reason
        self._rng = random.Random(seed)
        # Called with (rank, section, seconds) for every closed section (stragglers).
        self.on_section_closed: Callable[[int, str, float], Any] | None = None

    # -- cycle lifecycle ---------------------------------------------------------------

    def start_cycle(self, ranks: dict[int, tuple[int, float]]) -> None:
        """Forget the previous cycle: ``{rank: (local_rank, spawned_at)}``."""
        self.ranks = {r: RankLiveness(r, lr, t) for r, (lr, t) in ranks.items()}
        self.book.new_cycle()
        self.hold_until = -math.inf

    def longest(self) -> dict[str, float]:
        """Longest interval per kind over every rank of this cycle."""
        out: dict[str, float] = {}
        for r in self.ranks.values():
            for kind, s in r.samples.items():
                if s.count:
                    out[kind] = max(out.get(kind, 0.0), s.hi)
        return out

    def stats(self) -> dict[int, dict[str, dict[str, float]]]:
        return {r.rank: {k: s.stats() for k, s in r.samples.items() if s.count}
                for r in self.ranks.values()}

    def all_training(self) -> bool:
        """Every rank of the cycle showed activity (heartbeat, section or progress)."""
        return bool(self.ranks) and all(r.first_activity is not None
                                        for r in self.ranks.values())

    def training_since(self) -> float | None:
        """When the last rank showed its first activity, once every rank did."""
        if not self.all_training():
            return None
        return max(r.first_activity for r in self.ranks.values())  # type: ignore[type-var]

    # -- what ranks say ----------------------------------------------------------------

    def heartbeat(self, rank: int, stamp: float | None, now: float,
                  folds: bool = False) -> None:
        """A heartbeat; ``folds``: the rank may have folded later ones into it (the
        heartbeat deadline then allows ``HEARTBEAT_FOLD_S`` for an unseen last one)."""
        r = self.ranks.get(rank)
        if r is None:
            return
        r.hb_folds = folds
        t = self._when(r, stamp, now)
        self._activity(r, t)
        if r.last_hb is not None:
            interval = t - r.last_hb
            self._sample(r, TIMEOUT_HEARTBEAT, interval)
            self.book.heartbeat_interval(interval)
        r.last_hb = t

    def section_open(self, rank: int, name: str, stamp: float | None, now: float) -> None:
        r = self.ranks.get(rank)
        if r is None:
            return
        if name not in r.sections and len(r.sections) >= MAX_OPEN_SECTIONS:
            self._reject("too_many_open_sections")
            return
        t = self._when(r, stamp, now)
        self._activity(r, t)
        if r.last_section_end is not None and not r.sections:
            self._sample(r, TIMEOUT_OUT_OF_SECTION, t - r.last_section_end)
        r.sections[name] = t

    def section_close(self, rank: int, name: str, stamp: float | None, now: float) -> bool:
        """Close a section; False when it was not open."""
        r = self.ranks.get(rank)
        if r is None:
            return True
        opened = r.sections.pop(name, None)
        if opened is None:
            return False
        t = self._when(r, stamp, now)
        self._activity(r, t)
        self._sample(r, section_kind(name), t - opened)
        r.last_section_end = t
        if self.on_section_closed is not None:
            self.on_section_closed(rank, name, t - opened)
        return True

    def section_close_all(self, rank: int, stamp: float | None, now: float) -> None:
        r = self.ranks.get(rank)
        if r is None:
            return
        t = self._when(r, stamp, now)
        for name, opened in r.sections.items():
            self._sample(r, section_kind(name), t - opened)
            if self.on_section_closed is not None:
                self.on_section_closed(rank, name, t - opened)
        self._activity(r, t)
        if r.sections:
            r.last_section_end = t
        r.sections.clear()

    def progress(self, rank: int, iteration: int, checkpoint: bool, stamp: float | None,
                 now: float) -> Progress | None:
        """A step finished (or a checkpoint was saved); counts as activity, not a heartbeat."""
        r = self.ranks.get(rank)
        if r is None:
            return None
        t = self._when(r, stamp, now)
        self._activity(r, t)
        first = r.iteration is None
        r.iteration = iteration if r.iteration is None else max(r.iteration, iteration)
        r.progress_at = t
        if checkpoint:
            r.checkpoint = iteration
        return Progress(first_step=first, checkpoint=checkpoint, at=t)

    def goodbye(self, rank: int) -> None:
        """The rank stopped monitoring (or exited): no more deadlines for it."""
        if rank in self.ranks:
            self.ranks[rank].active = False

    def reconnect(self, rank: int) -> None:
        """A rank that said goodbye connected again (a second ``fit()``)."""
        if rank in self.ranks:
            self.ranks[rank].active = True

    # -- the launcher's own clock --------------------------------------------------------

    def woke(self, planned: float, now: float) -> bool:
        """Tell the model when the launcher woke versus when it meant to; True on a stall."""
        return self.behind(now - planned, now)

    def behind(self, seconds: float, now: float) -> bool:
        """The launcher itself was ``seconds`` behind its ranks (it did not run, or it was
        still reading a backlog); True when that counts as the launcher's stall.

        Messages the ranks sent meanwhile may still be queued (or, past the sender's queue,
        dropped and sent again at the next beat), so verdicts wait ``STALL_SETTLE_S``.
        """
        if seconds < STALL_THRESHOLD_S:
            return False
        self.hold_until = max(self.hold_until, now + STALL_SETTLE_S)
        return True

    # -- deadlines ---------------------------------------------------------------------

    def deadlines(self, r: RankLiveness) -> list[tuple[float, str, float, float]]:
        """(deadline, kind, timeout, reference time) for one rank."""
        timeout_for = self.book.timeout_for
        out = []
        if r.first_activity is None:
            timeout = timeout_for(TIMEOUT_INITIAL)
            if timeout is not None:
                out.append((r.spawned_at + timeout, TIMEOUT_INITIAL, timeout, r.spawned_at))
            return out
        if r.last_hb is not None:
            timeout = timeout_for(TIMEOUT_HEARTBEAT)
            if timeout is not None:
                fold = HEARTBEAT_FOLD_S if r.hb_folds else 0.0
                out.append((r.last_hb + timeout + fold, TIMEOUT_HEARTBEAT, timeout, r.last_hb))
        for name, opened in r.sections.items():
            kind = section_kind(name)
            timeout = timeout_for(kind)
            if timeout is not None:
                out.append((opened + timeout, kind, timeout, opened))
        if not r.sections and r.last_section_end is not None:
            timeout = timeout_for(TIMEOUT_OUT_OF_SECTION)
            if timeout is not None:
                ref = r.last_section_end
                out.append((ref + timeout, TIMEOUT_OUT_OF_SECTION, timeout, ref))
        return out

    def next_deadline(self) -> float | None:
        """Earliest deadline over all active ranks (never inside a stall hold), or None."""
        times = [d[0] for r in self.ranks.values() if r.active for d in self.deadlines(r)]
        return max(min(times), self.hold_until) if times else None

    def check(self, now: float) -> HangVerdict | None:
        """The rank past its deadline (earliest deadline wins), if any and not on hold."""
        if now < self.hold_until:
            return None
        worst = None
        for r in self.ranks.values():
            if not r.active:
                continue
            for deadline, kind, timeout, ref in self.deadlines(r):
                if deadline <= now and (worst is None or deadline < worst[0]):
                    worst = (deadline, r, kind, timeout, now - ref)
        if worst is None:
            return None
        _, r, kind, timeout, silence = worst
        return HangVerdict(r.rank, r.local_rank, kind, timeout, round(silence, 3))

    def silent_ranks(self, verdict: HangVerdict, now: float) -> dict[int, float]:
        """Active ranks silent for at least half the verdict's silence: ``{rank: age}``.

        In a collective every rank goes quiet at once; these are the suspects among which
        the culprit is chosen (blame.py).
        """
        out = {}
        for r in self.ranks.values():
            if r.active:
                age = now - r.floor()
                if r.rank == verdict.rank or age >= verdict.silence_s / 2:
                    out[r.rank] = round(age, 3)
        return out

    # -- internals ---------------------------------------------------------------------

    @staticmethod
    def _when(r: RankLiveness, stamp: float | None, now: float) -> float:
        """When an activity happened: its own stamp, kept between the rank's previous
        activity and the time it was read; the read time when it has none."""
        if stamp is None or not math.isfinite(stamp):
            return now
        return min(max(stamp, r.floor()), now)

    def _activity(self, r: RankLiveness, t: float) -> None:
        if r.first_activity is None:
            r.first_activity = t
            self._sample(r, TIMEOUT_INITIAL, t - r.spawned_at)
        r.last_activity = max(r.last_activity or t, t)

    def _sample(self, r: RankLiveness, kind: str, value: float) -> None:
        samples = r.samples.get(kind)
        if samples is None:
            if len(r.samples) >= MAX_KINDS_PER_RANK:
                self._reject("too_many_section_names")
                return
            samples = r.samples[kind] = Samples()
        samples.add(value, self._rng)

    def _reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
