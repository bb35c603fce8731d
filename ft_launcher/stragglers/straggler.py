"""Straggler detection: which rank is slow, from the time each spends in one named section.

In a synchronous job every rank waits for the slowest in each collective, so heartbeat and
step intervals are the same on every rank and show nothing. The time *inside* a section that
excludes the collective (``client.section("compute")`` around forward and backward) does:
a slow rank's compute takes longer, the others' does not.

The score of a rank is its recent median (over its last ``window`` section times) divided by
the median of the other ranks' recent medians. Medians, not means: a shared machine gives
every rank occasional spikes. Leaving the rank itself out of the reference keeps the score
honest with two ranks (with all ranks, a 2x slow rank of two would score 1.33) and changes
nothing with many.

A score above ``threshold`` is not enough on a shared machine: measured on 2 loaded cores
(tests/test_straggler.py cites the figures), the scheduler alone keeps one healthy rank's
median 1.5-1.7x the other's for up to ~30 steps. So a rank is reported only when, besides,
its excess is *persistent* within the window: at least ``persist`` (0.7) of its last
``window`` steps took more than ``threshold`` times the same step's median of the other local
ranks (the per-step ratio: every rank of a synchronous step shares that step's machine-wide
noise, which cancels). And a rank must be slow against the others' *usual* times: its recent
median must also exceed ``threshold`` times the others' medians over a longer horizon
(``baseline_steps``, ten windows), and exceed its own usual as much (its times before the
current window: it got slower), unless it has been that slow for half the horizon (slow from
its first step: reported after 5 windows). With two ranks the score cannot tell a slow rank
from a peer that got faster: measured on 2 cores, one rank's sections ran 1.7x faster than
usual for ~40 steps with nothing slowed, and score and per-step ratio alike named the other,
unchanged rank; against the usual times it is not slow. All must hold for ``confirm_steps``
of its own steps in a row; it is cleared when its score stays below ``clear_threshold``
(lower: hysteresis) as long. No score exists before a rank has ``window`` section times, so
nothing is ever decided on fewer.

A rank alone on its node has no per-step ratio: its reference is other nodes' medians, read
seconds late, so a load that slows the whole machine for a moment slowed it against a median
from before the load (measured: a healthy rank named so, in the two-node end-to-end case). It
is reported only once the other nodes' medians were read ``remote_settle_s`` plus a window's
span after its excess began, and it still holds.

Device time: when every local rank reports the GPU time of the section (``observe_device``,
from ``client.section(..., device=True)``), those times are scored instead of wall times
(``clock`` "device"): a GPU's time does not depend on how the host's CPUs are shared.

Pure: no I/O, no clock but the injected one (used to age remote medians). The monitor calls
``observe`` when a rank closes the section; the supervisor calls ``evaluate`` and records the
transitions it returns. Remote ranks (other nodes) enter as medians via ``observe_remote``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

DETECTED = "straggler_detected"
CLEARED = "straggler_cleared"
MAX_DURATION_S = 7 * 24 * 3600.0  # a section time beyond a week is garbage, not a sample


@dataclass(frozen=True)
class StragglerEvent:
    """A transition of one rank: ``straggler_detected`` or ``straggler_cleared``."""

    event: str
    rank: int
    host: str
    section: str
    score: float  # the rank's median over the others' (1.0 = typical, 2.0 = twice as slow)
    window: int  # section times behind each median
    median_s: float  # this rank's recent median section time
    reference_s: float  # the median of the other ranks' recent medians
    steps: int  # section times this rank had closed when the transition was decided
    clock: str = "wall"  # "wall", or "device" for GPU time of the section

    def fields(self) -> dict[str, Any]:
        """Event fields for events.jsonl (everything but the event name), rounded."""
        out = asdict(self)
        del out["event"]
        for key in ("score", "median_s", "reference_s"):
            out[key] = round(out[key], 6)
        return out


@dataclass
class _Series:
    """One rank's recent section times of one clock; step k (0 = the first after warm-up)
    is ``times[k - (count - len(times))]`` while still held."""

    times: deque[float]
    count: int = 0

    def add(self, seconds: float) -> None:
        self.times.append(seconds)
        self.count += 1

    def at(self, step: int) -> float | None:
        i = step - (self.count - len(self.times))
        return self.times[i] if 0 <= i < len(self.times) else None

    def last(self, n: int) -> list[float]:
        return list(self.times)[-n:]


@dataclass
class _Track:
    """One local rank's recent section times (wall and device) and its straggler state."""

    host: str
    wall: _Series
    device: _Series
    steps: int = 0
    flagged: bool = False
    crossed_at: int | None = None  # step at which the score crossed the current boundary
    crossed_t: float = 0.0  # and when (the detector's clock)
    stamps: deque[float] = field(default_factory=deque)  # when its last window closed


@dataclass
class _Remote:
    host: str
    median_s: float
    seen_at: float
    clock: str = "wall"


@dataclass
class StragglerDetector:
    """Scores local ranks against every rank it knows of; see the module docstring.

    ``threshold`` (> 1): report above it. ``window`` (>= 3): section times per median.
    ``section``: the section name observed; others are ignored. ``confirm_steps``: steps the
    score must stay across a boundary (default ``window // 5``, at least 1).
    ``clear_threshold``: clear below it (default halfway between 1 and ``threshold``).
    ``remote_ttl_s``: a remote median older than this is ignored. ``now``: the clock.
    ``warmup_steps``: a rank's first section times, ignored. ``persist``: the fraction of
    a window's steps that must exceed ``threshold`` (per-step ratio) for a report.
    ``baseline_steps``: the longer horizon of the others' usual times (default ten windows).
    ``remote_settle_s``: how long after its excess began a rank alone on its node waits for
    other nodes' medians before it is reported.
    """

    threshold: float = 1.3
    window: int = 12
    section: str = "compute"
    now: Callable[[], float] = time.monotonic
    host: str = ""
    clock: str = "wall"
    confirm_steps: int | None = None
    clear_threshold: float | None = None
    remote_ttl_s: float = 60.0
    # A rank's first steps of a cycle (allocator, caches, a peer still importing) say
    # nothing about its speed: that many are not scored (the launcher skips 5).
    warmup_steps: int = 0
    # Persistence within the window (see the module docstring): 0.7 kept every clean run
    # measured on 2 loaded cores quieter than 0.5 did, and a 2x rank still passes it.
    persist: float = 0.7
    baseline_steps: int | None = None
    # A rank alone on its node is compared with other nodes' medians only, which arrive
    # late (straggler_exchange.py: every 3 s, then read every 3 s): reported only on
    # medians read this long after its excess began, plus its window's span, so they cover
    # the same time (a load that slows the whole machine slows them too).
    remote_settle_s: float = 6.0
    _tracks: dict[int, _Track] = field(default_factory=dict, init=False, repr=False)
    _warmup: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _remote: dict[int, _Remote] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold)
                and self.threshold > 1):
            raise ValueError(f"threshold must be a finite number > 1, got {self.threshold!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 3:
            raise ValueError(f"window must be an integer >= 3, got {self.window!r}")
        if not self.section:
            raise ValueError("section must be a non-empty name")
        if self.confirm_steps is None:
            self.confirm_steps = max(1, self.window // 5)
        if self.clear_threshold is None:
            self.clear_threshold = 1 + (self.threshold - 1) / 2
        if not 1 <= self.clear_threshold <= self.threshold:
            raise ValueError(f"clear_threshold must be in [1, threshold], got "
                             f"{self.clear_threshold!r}")
        if not (isinstance(self.persist, (int, float)) and 0 <= self.persist <= 1):
            raise ValueError(f"persist must be a fraction in [0, 1], got {self.persist!r}")
        if not (isinstance(self.remote_settle_s, (int, float))
                and not math.isnan(self.remote_settle_s)):
            raise ValueError(f"remote_settle_s must be a number of seconds, got "
                             f"{self.remote_settle_s!r}")
        if self.baseline_steps is None:
            self.baseline_steps = 10 * self.window
        if self.baseline_steps < self.window:
            raise ValueError(f"baseline_steps must be >= window, got {self.baseline_steps!r}")

    # -- input -------------------------------------------------------------------------

    def observe(self, rank: int, section: str, duration_s: float, host: str | None = None
                ) -> bool:
        """A local rank closed ``section`` after ``duration_s``; False when ignored (another
        section, or a value that is not a plausible duration)."""
        if section != self.section or not _valid_rank(rank) or not _valid_seconds(duration_s):
            return False
        seen = self._warmup.get(rank, 0)
        if seen < self.warmup_steps:
            self._warmup[rank] = seen + 1
            return True
        track = self._track(rank, host)
        track.wall.add(float(duration_s))
        track.steps += 1
        track.stamps.append(self.now())
        if len(track.stamps) > self.window:
            track.stamps.popleft()
        return True

    def observe_device(self, rank: int, section: str, device_s: float,
                       host: str | None = None) -> bool:
        """A local rank's device (GPU) time of an earlier ``section`` (they arrive in order, a
        few steps late); False when ignored. Its first ``warmup_steps`` are skipped too."""
        if section != self.section or not _valid_rank(rank) or not _valid_seconds(device_s):
            return False
        key = -1 - rank  # the device warm-up is counted apart from the wall one
        seen = self._warmup.get(key, 0)
        if seen < self.warmup_steps:
            self._warmup[key] = seen + 1
            return True
        self._track(rank, host).device.add(float(device_s))
        return True

    def _track(self, rank: int, host: str | None) -> _Track:
        track = self._tracks.get(rank)
        if track is None:
            # The baseline horizon, and at least twice the window: a peer a few steps behind
            # still has the same steps held.
            held = max(2 * self.window, self.baseline_steps)  # type: ignore[type-var]
            track = self._tracks[rank] = _Track(host or self.host,
                                                _Series(deque(maxlen=held)),
                                                _Series(deque(maxlen=held)))
        return track

    def observe_remote(self, rank: int, host: str, median_s: float, clock: str = "wall"
                       ) -> bool:
        """Another node's rank and its recent median (from that node's ``local_medians()``);
        it counts in every reference of the same clock until ``remote_ttl_s`` passes without
        an update."""
        if not _valid_rank(rank) or not isinstance(host, str) or not _valid_seconds(median_s) \
                or clock not in ("wall", "device"):
            return False
        self._remote[rank] = _Remote(host[:255], float(median_s), self.now(), clock)
        return True

    def forget(self, rank: int) -> None:
        """A local rank is gone (exited): it no longer counts, nor is it scored."""
        self._tracks.pop(rank, None)

    # -- output ------------------------------------------------------------------------

    def active_clock(self) -> str:
        """"device" when every local rank has a window of device times, else "wall"."""
        tracks = self._tracks.values()
        if tracks and all(len(t.device.times) >= self.window for t in tracks):
            return "device"
        return "wall"

    def _series(self, track: _Track, clock: str) -> _Series:
        return track.device if clock == "device" else track.wall

    def local_medians(self, clock: str | None = None) -> dict[int, float]:
        """Recent medians of local ranks with a full window (what a node shares with others),
        in ``clock`` (default: the active one)."""
        clock = clock or self.active_clock()
        out = {}
        for rank, track in self._tracks.items():
            series = self._series(track, clock)
            if len(series.times) >= self.window:
                out[rank] = statistics.median(series.last(self.window))
        return out

    def medians(self, clock: str | None = None, steps: int | None = None
                ) -> dict[int, float]:
        """Recent medians of every rank that counts: local with a full window, fresh remote
        of the same clock. ``steps``: the local medians' horizon (default the window; a
        remote median is always its node's recent one)."""
        clock = clock or self.active_clock()
        local = self.local_medians(clock)
        if steps is not None:
            local = {rank: statistics.median(self._series(self._tracks[rank], clock)
                                             .last(steps)) for rank in local}
        horizon = self.now() - self.remote_ttl_s
        remote = {rank: r.median_s for rank, r in self._remote.items()
                  if r.seen_at >= horizon and rank not in self._tracks and r.clock == clock}
        return {**remote, **local}

    def persistence(self, rank: int, reference_s: float, clock: str | None = None
                    ) -> float | None:
        """The fraction of ``rank``'s last window of steps slower than ``threshold`` times
        that step's median over the other local ranks (``reference_s``, the others' median
        of medians, where no other local rank has that step: a rank alone on its node)."""
        track = self._tracks.get(rank)
        if track is None:
            return None
        clock = clock or self.active_clock()
        mine = self._series(track, clock)
        if len(mine.times) < self.window:
            return None
        peers = [self._series(t, clock) for r, t in self._tracks.items() if r != rank]
        above = 0
        for step in range(mine.count - self.window, mine.count):
            others = [v for v in (p.at(step) for p in peers) if v is not None]
            reference = statistics.median(others) if others else reference_s
            if mine.at(step) > self.threshold * reference:  # type: ignore[operator]
                above += 1
        return above / self.window

    def _slowed(self, rank: int, recent_s: float, own_long_s: float, others_usual_s: float,
                clock: str) -> bool:
        """Whether the rank got slower than its own usual (its times before the current
        window, within the horizon), or has been slower than the others' usual for half the
        horizon at least (slow from its first step: no faster past of its own)."""
        held = self._series(self._tracks[rank], clock).last(self.baseline_steps)
        older = held[:-self.window]
        if len(older) >= max(3, self.window // 2) and \
                recent_s > self.threshold * statistics.median(older):
            return True
        return 2 * len(held) >= self.baseline_steps and \
            own_long_s > self.threshold * others_usual_s  # type: ignore[operator]

    def _compared_alike(self, rank: int, clock: str) -> bool:
        """Whether the rank's reference covers the time of its excess: another local rank
        gives each step's own time (the per-step ratio); a rank alone on its node has only
        other nodes' medians, which must have been read ``remote_settle_s`` plus a window's
        span after the excess began (see the field's comment)."""
        track = self._tracks[rank]
        if any(r != rank for r in self._tracks):
            return True
        span = track.stamps[-1] - track.stamps[0] if track.stamps else 0.0
        horizon = self.now() - self.remote_ttl_s
        seen = [r.seen_at for r in self._remote.values()
                if r.seen_at >= horizon and r.clock == clock]
        return bool(seen) and min(seen) >= track.crossed_t + self.remote_settle_s + span

    def scores(self) -> dict[int, float]:
        """Current score of every rank that counts (empty with fewer than two)."""
        return scores(self.medians())

    def stragglers(self) -> list[int]:
        """Local ranks currently reported as stragglers."""
        return sorted(rank for rank, t in self._tracks.items() if t.flagged)

    def evaluate(self) -> list[StragglerEvent]:
        """Update every local rank's state; return the transitions since the last call."""
        clock = self.active_clock()
        medians = self.medians(clock)
        ranked = scores(medians)
        reference = _leave_one_out_medians(medians)
        # The longer horizon only where a rank's score is over the threshold (this runs at
        # every wake-up of the launcher; a clean run has no such rank).
        over = any(not t.flagged and ranked.get(r, 0.0) > self.threshold
                   for r, t in self._tracks.items())
        long = self.medians(clock, self.baseline_steps) if over else {}
        usual = _leave_one_out_medians(long)
        out = []
        for rank in sorted(self._tracks):
            track = self._tracks[rank]
            score = ranked.get(rank)
            if score is None:
                continue
            if track.flagged:
                across = score < self.clear_threshold
            else:
                across = score > self.threshold \
                    and medians[rank] > self.threshold * usual[rank] \
                    and self._slowed(rank, medians[rank], long[rank], usual[rank], clock) \
                    and (self.persistence(rank, reference[rank], clock) or 0.0) >= self.persist
            if not across:
                track.crossed_at = None
                continue
            if track.crossed_at is None:
                track.crossed_at, track.crossed_t = track.steps, self.now()
            if track.steps - track.crossed_at < self.confirm_steps or \
                    not (track.flagged or self._compared_alike(rank, clock)):
                continue
            track.flagged = not track.flagged
            track.crossed_at = None
            out.append(StragglerEvent(
                DETECTED if track.flagged else CLEARED, rank, track.host, self.section,
                score, self.window, medians[rank], reference[rank], track.steps,
                clock if clock == "device" else self.clock))
        return out

    def speed_table(self) -> list[dict[str, Any]]:
        """Every rank's relative speed now (see ``speed_rows``)."""
        hosts = {rank: r.host for rank, r in self._remote.items()}
        hosts.update({rank: t.host for rank, t in self._tracks.items()})
        return speed_rows(self.medians(), hosts, flagged=self.stragglers())


# -- pure helpers shared by the detector and ft_report ------------------------------------


def _valid_rank(rank: Any) -> bool:
    return isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 1 << 31


def _valid_seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and 0 <= value <= MAX_DURATION_S)


def _leave_one_out_medians(medians: Mapping[int, float]) -> dict[int, float]:
    """For each rank, the median of the other ranks' medians (needs two ranks or more)."""
    if len(medians) < 2:
        return {}
    ordered = sorted(medians.values())
    out = {}
    for rank, value in medians.items():
        others = list(ordered)
        others.remove(value)
        out[rank] = statistics.median(others)
    return out


def scores(medians: Mapping[int, float]) -> dict[int, float]:
    """Each rank's median over the median of the other ranks' medians.

    Ranks whose reference is zero (sections too short to time) get no score.
    """
    return {rank: medians[rank] / ref
            for rank, ref in _leave_one_out_medians(medians).items() if ref > 0}


def speed_rows(medians: Mapping[int, float], hosts: Mapping[int, str] | None = None,
               flagged: Iterable[int] = ()) -> list[dict[str, Any]]:
    """One row per rank: ``rank``, ``host``, ``median_s``, ``score`` (time relative to the
    other ranks), ``speed`` (1/score: 0.5 = half as fast), ``straggler``."""
    ranked = scores(medians)
    marked = set(flagged)
    rows = []
    for rank in sorted(medians):
        score = ranked.get(rank)
        rows.append({
            "rank": rank,
            "host": (hosts or {}).get(rank, ""),
            "median_s": round(medians[rank], 6),
            "score": None if score is None else round(score, 3),
            "speed": None if not score else round(1 / score, 3),
            "straggler": rank in marked,
        })
    return rows


def speed_table(events: Iterable[Mapping[str, Any]], section: str = "compute"
                ) -> list[dict[str, Any]]:
    """Every rank's relative speed per cycle, from a run's events (for ``ft_report``).

    Medians come from the ``interval_stats`` events of kind ``section:<section>`` (``p50``),
    written at the end of each cycle; ``straggler`` marks ranks with a ``straggler_detected``
    event in that cycle; ``host`` is that event's, else the launcher's (``launcher_started``).
    Rows are ``speed_rows`` plus ``cycle`` and ``count``. Malformed events are skipped.
    """
    kind = f"section:{section}"
    per_cycle: dict[int, dict[int, float]] = {}
    counts: dict[tuple[int, int], int] = {}
    hosts: dict[tuple[int, int], str] = {}
    detected: dict[int, set[int]] = {}
    launcher_host = ""
    for e in events:
        if e.get("event") == "launcher_started" and isinstance(e.get("host"), str):
            launcher_host = e["host"]
        cycle, rank = e.get("cycle"), e.get("rank")
        if not (_valid_rank(cycle) and _valid_rank(rank)):
            continue
        if e.get("event") == "interval_stats" and e.get("kind") == kind \
                and _valid_seconds(e.get("p50")):
            per_cycle.setdefault(cycle, {})[rank] = float(e["p50"])
            counts[(cycle, rank)] = e.get("count") if _valid_rank(e.get("count")) else 0
        elif e.get("event") == DETECTED and e.get("section", section) == section:
            detected.setdefault(cycle, set()).add(rank)
            if isinstance(e.get("host"), str):
                hosts[(cycle, rank)] = e["host"]
    rows = []
    for cycle in sorted(per_cycle):
        medians = per_cycle[cycle]
        cycle_hosts = {r: launcher_host for r in medians}
        cycle_hosts.update({r: h for (c, r), h in hosts.items() if c == cycle})
        for row in speed_rows(medians, cycle_hosts, detected.get(cycle, ())):
            rows.append({"cycle": cycle, **row, "count": counts[(cycle, row["rank"])]})
    return rows

