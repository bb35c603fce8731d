"""``RankMonitorClient.snapshot`` / ``restore``: the rank's side of in-memory snapshots.

The launcher gives each rank, by environment, its snapshot directory (``FT_SNAPSHOT_DIR``),
the frequency (``FT_SNAPSHOT_EVERY``: ``auto``, the default, for the frequency the ranks
agree on through the launcher; steps; or seconds with an ``s``), its memory budget in
bytes (``FT_SNAPSHOT_MEMORY``), the iteration it is to restore in this cycle
(``FT_SNAPSHOT_ITERATION``, ``none`` when there is none) and the plan file
(``FT_SNAPSHOT_PLAN``) where the launcher says which copies every holder keeps and, with
``auto``, which iterations are snapshot (``ft_agent.snapshot_retention``,
``ft_agent.snapshot_frequency``). The rank reads the plan again when the file changes (one
``os.stat`` per ``snapshot()`` call), and reports what it holds after each commit and what a
snapshot costs it (``send_report("snapshot", ...)``). This module imports neither torch nor
the store until a snapshot is taken or restored.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ft_agent.snapshot_frequency import Grid, Meter
from ft_agent.snapshot_retention import MAX_PLAN_BYTES, Plan, decode_plan

log = logging.getLogger("ft_agent")

REPORT_WHAT = "snapshot"
# Skips of one reason are reported at most this often (a write slower than a step would
# otherwise report every step); each report counts the skips since the last.
SKIP_REPORT_S = 10.0
# At interpreter exit a write in flight is waited for this long: a daemon thread stopped in
# the middle of torch's C++ code as the interpreter finalizes can abort the process, and
# the write's snapshot is usually the newest there is.
EXIT_WAIT_S = 10.0
# A rank's measure goes to the launcher when it first has one, then at most this often.
MEASURE_REPORT_S = 5.0
AUTO = "auto"


@dataclass(frozen=True)
class Frequency:
    """Every ``steps`` iterations or every ``seconds`` of wall time, on a grid every rank
    shares (multiples of ``steps``; multiples of ``seconds`` of the wall clock): the ranks
    of a world, in step with each other through their collectives, snapshot the same
    iterations, which is what a restore of the whole world needs, and a rank that had to
    skip one (busy, budget) is back in phase at the next."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> Frequency | None:
        """``5`` or ``30s``; None for anything else (snapshots off)."""
        text = text.strip().lower()
        try:
            if text.endswith("s"):
                seconds = float(text[:-1])
                return cls(seconds=seconds) if 0 <= seconds < 1e9 else None
            steps = int(text)
            return cls(steps=steps) if steps >= 1 else None
        except ValueError:
            return None

    def due(self, iteration: int, now: float, last: tuple[int, float] | None) -> bool:
        """Whether a snapshot of ``iteration`` is due at wall time ``now``, given the last
        (iteration, wall time): the first of a cycle, then the first at or past each
        multiple of the grid."""
        if last is None:
            return True
        if self.steps is not None:
            return iteration // self.steps > last[0] // self.steps
        if not self.seconds:
            return True
        return now // self.seconds > last[1] // self.seconds


@dataclass(frozen=True)
class SnapshotSettings:
    """What the launcher said in the environment; ``settings_from_env`` reads it."""

    directory: str
    frequency: Frequency | None  # None: the frequency the launcher announces (auto)
    memory: int | None
    iteration: int | None  # to restore in this cycle
    plan: str | None = None  # the plan file (None: no world; each copy but the newest goes)


def settings_from_env(env: Mapping[str, str]) -> SnapshotSettings | None:
    """The rank's snapshot settings, or None when the launcher keeps no snapshots."""
    directory = env.get("FT_SNAPSHOT_DIR")
    every = env.get("FT_SNAPSHOT_EVERY", "").strip().lower()
    frequency = None if every == AUTO else Frequency.parse(every)
    if not directory or (frequency is None and every != AUTO):
        return None
    memory = _int_or_none(env.get("FT_SNAPSHOT_MEMORY", ""))
    return SnapshotSettings(directory, frequency, memory if memory else None,
                            _int_or_none(env.get("FT_SNAPSHOT_ITERATION", "")),
                            env.get("FT_SNAPSHOT_PLAN") or None)


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


class SnapshotAgent:
    """One rank's snapshots: the store (created at the first snapshot), the frequency, the
    plan, and the reports sent to the launcher through ``report(what, message)``."""

    def __init__(self, settings: SnapshotSettings, report: Any) -> None:
        self.settings = settings
        self.report = report
        self.store: Any = None  # ft_agent.snapshot.SnapshotStore
        self.last: tuple[int, float] | None = None
        self.taken = 0  # snapshots this process started
        self.at = -(2**62)  # the furthest iteration snapshot() was called with
        self.restored = False
        self.broken = False  # the directory was refused: no snapshots for this process
        self.plan: Plan | None = Plan() if settings.plan else None
        self._plan_seen: tuple[int, int, int] | None = None  # (inode, mtime, size) read
        self.meter = Meter()
        self._commit_cpu: deque[float] = deque()  # from the write's thread to the meter
        self._measure_sent: float | None = None
        self._skips: dict[str, tuple[int, float]] = {}  # reason -> (count, last report)
        self._write_seen: Any = None

    def snapshot(self, state: Any, iteration: int, at_once: bool = False) -> Any:
        """Take a snapshot when due (``at_once``: whatever the frequency, written before
        returning); the store's ``SnapshotStatus``, or None when not due."""
        from ft_agent import snapshot as store  # noqa: PLC0415 - torch on first use only

        start = time.perf_counter()
        now, wall = time.monotonic(), time.time()  # the grid is the wall clock's: shared
        self._read_plan()
        self.at = max(self.at, iteration)
        while self._commit_cpu:
            self.meter.commit(self._commit_cpu.popleft())
        self.meter.call(iteration, now, time.process_time())
        self._send_measure(now)
        if not at_once and not self._due(iteration, wall):
            return None
        if self.store is None:
            if self.broken:
                return None
            try:
                self.store = store.SnapshotStore(self.settings.directory,
                                                 memory_budget=self.settings.memory,
                                                 on_commit=self._committed)
                atexit.register(self.store.wait, EXIT_WAIT_S)
            except store.SnapshotError as e:  # the training goes on without snapshots
                self.broken = True
                log.warning("snapshots off for this rank: %s", e)
                self._skipped(iteration, "io", 0, now)
                return None
        self._check_last_write()
        try:
            status = self.store.snapshot(state, iteration, wait=at_once, plan=self.plan,
                                         force=at_once)
        except store.SnapshotError:
            self._skipped(iteration, "unsupported", 0, now)
            raise
        if status.started and at_once:
            self.store.wait()
            self._check_last_write()
        # A skipped grid point counts as this rank's too: trying again at the next call
        # would snapshot an iteration the other ranks did not, and keep it off the grid.
        self.last = (iteration, wall)
        if status.started:
            self.taken += 1
            if not at_once:  # the whole call but a fresh slot's claim: what the step lost
                self.meter.blocked(time.perf_counter() - start
                                   - (status.blocking_s - status.copy_s))
        else:
            self._skipped(iteration, status.reason or "busy", status.bytes, now)
        return status

    def restore(self, newer_than: int | None = None) -> tuple[Any, int] | None:
        """The state and iteration the launcher chose for this cycle, or None (also when
        the choice is not newer than ``newer_than``: nothing is read or reported)."""
        from ft_agent import snapshot as store  # noqa: PLC0415

        iteration = self.settings.iteration
        if iteration is None or self.restored:
            return None
        if newer_than is not None and iteration <= newer_than:
            self.restored = True
            log.info("snapshot of iteration %d not restored: the training starts at %d",
                     iteration, newer_than)
            return None
        try:
            snap = store.load(self.settings.directory, iteration)
        except store.SnapshotError as e:
            for slot, reason in e.rejected:
                self._send("rejected", iteration=iteration, slot=slot, reason=reason[:500])
                try:
                    store.uncommit(self.settings.directory, slot)
                except (store.SnapshotError, OSError) as exc:
                    log.warning("cannot discard snapshot slot %s: %s", slot, exc)
            # Every other rank restores this iteration: going on from elsewhere would split
            # the world. Failing makes the launcher choose again, without this copy.
            raise
        self.restored = True
        self.last = (snap.iteration, time.monotonic())
        self._send("restored", iteration=snap.iteration, source="local", bytes=snap.bytes,
                   seconds=round(snap.seconds, 6))
        return snap.state, snap.iteration

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def _due(self, iteration: int, wall: float) -> bool:
        if self.settings.frequency is not None:
            return self.settings.frequency.due(iteration, wall, self.last)
        grid = Grid(self.plan.grid if self.plan is not None else ())
        if not grid.segments:
            # No agreed frequency yet: one snapshot to measure, then wait for it.
            return self.taken == 0
        return grid.due(iteration, None if self.last is None else self.last[0])

    def _read_plan(self) -> None:
        """The launcher's newest plan, read when its file changed; a file that is missing
        or malformed leaves the plan as it was."""
        path = self.settings.plan
        if path is None:
            return
        try:
            st = os.stat(path, follow_symlinks=False)
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen == self._plan_seen:
                return
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                data = os.read(fd, MAX_PLAN_BYTES + 1)
            finally:
                os.close(fd)
        except OSError:
            return
        self._plan_seen = seen
        plan = decode_plan(data)
        if plan is None:
            log.warning("snapshot plan %s is malformed; keeping the previous one", path)
        elif self.plan is None or plan.seq != self.plan.seq:
            self.plan = plan

    def _committed(self, result: Any) -> None:
        """From the write's thread (or the call, for a small state): what this rank holds
        now, to the launcher."""
        if result.ok:  # a commit inside snapshot() is already in the call's time
            self._commit_cpu.append(0.0 if result.inline else result.cpu_s)
        held = sorted({i for i in self.store.held().values() if i is not None})
        self._send("held", held=held, at=self.at)

    def _send_measure(self, now: float) -> None:
        m = self.meter.measure()
        if m is None or (self._measure_sent is not None and
                         now - self._measure_sent < MEASURE_REPORT_S):
            return
        self._measure_sent = now
        self._send("measure", iteration=self.at, blocking_s=round(m.blocking_s, 6),
                   commit_s=round(m.commit_s, 6), step_s=round(m.step_s, 6),
                   cpu=round(m.cpu, 3))

    def _check_last_write(self) -> None:
        result = self.store.last_write
        if result is not None and result is not self._write_seen:
            self._write_seen = result
            if not result.ok:
                self._skipped(result.iteration, "io", result.bytes, time.monotonic())

    def _skipped(self, iteration: int, reason: str, nbytes: int, now: float) -> None:
        count, sent = self._skips.get(reason, (0, -SKIP_REPORT_S))
        count += 1
        if now - sent < SKIP_REPORT_S:
            self._skips[reason] = (count, sent)
            return
        self._skips[reason] = (0, now)
        log.warning("snapshot of iteration %d skipped (%s, %d bytes)", iteration, reason, nbytes)
        self._send("skipped", iteration=iteration, reason=reason, bytes=nbytes, count=count)

    def _send(self, kind: str, **fields: Any) -> None:
        self.report(REPORT_WHAT, json.dumps({"kind": kind, **fields}))


class SnapshotMixin:
    """``snapshot`` and ``restore`` of ``RankMonitorClient`` (which provides ``send_report``
    and ``_warn_disabled``)."""

    _snapshots: SnapshotAgent | None = None
    _snapshots_read = False

    def _snapshot_agent(self) -> SnapshotAgent | None:
        if not self._snapshots_read:
            self._snapshots_read = True
            if not os.environ.get("FT_ENDPOINT"):
                self._warn_disabled()  # type: ignore[attr-defined]
                return None
            settings = settings_from_env(os.environ)
            if settings is None:
                log.info("the launcher keeps no snapshots (--ft-snapshot-every off): "
                         "snapshot() and restore() do nothing")
                return None
            self._snapshots = SnapshotAgent(settings, self.send_report)  # type: ignore[attr-defined]
        return self._snapshots

    def snapshot(self, state: Any, iteration: int, *, at_once: bool = False) -> Any:
        """Snapshot ``state`` (tensors, numpy arrays and plain Python values in dicts,
        lists and tuples) as of step ``iteration``, when due (by default at the frequency
        the ranks agree on through the launcher; ``--ft-snapshot-every`` sets one).

        Blocks only while the tensors are copied to host memory; the write goes on in the
        background. With ``at_once``, the snapshot is taken whatever the frequency and
        written before this returns: for a state that must outlive an exit about to happen,
        such as the one the rerun state machine asks to checkpoint before exit 16 or 17.
        Returns a ``SnapshotStatus`` (``started``, or skipped with ``reason`` "budget",
        "busy" or "held", which the launcher records as ``snapshot_skipped``), or None
        when no snapshot was due or snapshots are off. Raises ``SnapshotError`` for a state
        it cannot hold, naming the path."""
        agent = self._snapshot_agent()
        return None if agent is None else agent.snapshot(state, int(iteration), at_once)

    def restore(self, newer_than: int | None = None) -> tuple[Any, int] | None:
        """In a new cycle: ``(state, iteration)`` of the newest iteration every rank of the
        world holds a checked copy of (the launcher chose it before the rank started), else
        None. Tensors come back on the CPU. With ``newer_than`` (the step a disk checkpoint
        already loaded), a snapshot not newer is neither read nor reported as restored.
        Call it once, after ``init_workload_monitoring``. Raises ``SnapshotError`` when
        the chosen copy fails its checks here: the rank must not go on (the others restore
        that iteration); the launcher's next cycle chooses again without that copy."""
        agent = self._snapshot_agent()
        return None if agent is None else agent.restore(newer_than)
