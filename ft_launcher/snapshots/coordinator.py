"""The plan every snapshot holder of a world follows, kept by each launcher for its node.

The plan (``ft_agent.snapshot_retention``) says which copies every holder keeps (the
world's pin, the copies at or above its floor) and, with the default frequency, which
iterations the ranks snapshot (``ft_agent.snapshot_frequency``). It moves on from what the
holders report: each rank, after each commit, what its slots hold, and what a snapshot
costs it; each replica server, what it holds for the ranks of other nodes.

One node: a rank's report moves the plan at once. Several nodes: every ``EXCHANGE_S`` each
launcher publishes its node's summary (``NodeSummary``) in the round's rendezvous store; the
launcher of group rank 0 reads every summary, decides and publishes the plan; the others
read it back. Each launcher writes the plan it follows to its node's plan file (write +
rename: a rank never reads half of one), which its ranks read, and hands it to its replica
server. Everything read from the store is untrusted: ``decode_summary`` checks each field
and returns None rather than raising.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_agent.snapshot_frequency import (
    Measure,
    extend,
    node_busy,
    settle,
    start_of,
    wanted_every,
)
from ft_agent.snapshot_retention import (
    MAX_ITERATION,
    SLOTS,
    Plan,
    advance,
    decode_plan,
    encode_plan,
)
from ft_launcher.snapshots.buddy import buddies

log = logging.getLogger("ft_launcher")

EXCHANGE_S = 0.25  # several nodes: between two publications of a node's summary
# While ranks commit snapshots (a report in the last ACTIVE_S), the launcher's loop reads
# their reports at least this often: a rank two commits ahead of the plan it knows skips
# the next snapshot ("held"), and the loop otherwise reads messages in batches of 250 ms.
PROMPT_S = 0.05
ACTIVE_S = 1.0
MEASURE_WAIT_S = 10.0  # the first frequency waits this long for every rank's measure
PLAN_FILE = "plan.json"
MAX_SUMMARY_BYTES = 1 << 20
MAX_RANKS = 1 << 20
SUMMARY_VERSION = 1


@dataclass(frozen=True)
class Cost:
    """What one snapshot costs a rank: ``cost_s`` (what the frequency counts), the step, and
    its parts; ``commit_counted``: the node has no idle core, so the commit counts."""

    cost_s: float
    step_s: float
    blocking_s: float
    commit_s: float
    commit_counted: bool


@dataclass(frozen=True)
class NodeSummary:
    """One node's part: what its ranks hold and the furthest iteration each reached, what
    its replica server holds per rank of other nodes, each measured rank's cost, and the
    buddy nodes its pushes currently fail to."""

    node: int
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)
    at: dict[int, int] = field(default_factory=dict)
    hosted: dict[int, tuple[int, ...]] = field(default_factory=dict)
    costs: dict[int, Cost] = field(default_factory=dict)
    failing: tuple[int, ...] = ()


@dataclass(frozen=True)
class World:
    """The ranks of the world (``nproc`` per node, node = rank // nproc), its number of
    nodes and ``--ft-snapshot-replicas``."""

    ranks: tuple[int, ...]
    nproc: int
    nodes: int = 1
    replicas: int = 0

    def buddies_of(self, rank: int) -> tuple[int, ...]:
        if self.nodes < 2 or self.replicas < 1:
            return ()
        return buddies(list(range(self.nodes)), self.replicas).get(rank // self.nproc, ())


def holdings(world: World, summaries: Mapping[int, NodeSummary]
             ) -> dict[str, tuple[int, ...] | None]:
    """Every holder of the world and what it holds (None: not known yet): each rank's own
    directory, and its replica on each buddy node its pushes do not currently fail to."""
    out: dict[str, tuple[int, ...] | None] = {}
    for rank in world.ranks:
        home = summaries.get(rank // world.nproc) if world.nodes > 1 else \
            next(iter(summaries.values()), None)
        out[str(rank)] = None if home is None else home.held.get(rank)
        for b in world.buddies_of(rank):
            if home is not None and b in home.failing:
                continue
            there = summaries.get(b)
            out[f"{rank}@{b}"] = None if there is None else there.hosted.get(rank, ())
    return out


@dataclass
class FrequencyState:
    """The leader's interval, when it was set, and when the first measure came."""

    every: int | None = None
    since: float = 0.0
    first_measure: float | None = None
    why: dict[str, Any] = field(default_factory=dict)


def next_frequency(plan: Plan, world: World, summaries: Mapping[int, NodeSummary],
                   state: FrequencyState, budget: float, now: float) -> Plan:
    """``plan`` with its grid extended when the interval must change (``state`` updated),
    or announced again in a new cycle (the plan starts each cycle without a grid)."""
    costs = {r: c for s in summaries.values() for r, c in s.costs.items() if r in world.ranks}
    ats = [a for s in summaries.values() for r, a in s.at.items() if r in world.ranks]
    if not ats:
        return plan
    if not costs:
        if plan.grid or state.every is None:
            return plan
        start = _first_point(plan, world, summaries, max(ats), state.every,
                             state.why.get("step_s", 0.0))
        return _announce(plan, start, state.every, {**state.why, "reason": "new cycle",
                                                     "previous": state.every})
    if state.first_measure is None:
        state.first_measure = now
    if len(costs) < len(world.ranks) and now - state.first_measure < MEASURE_WAIT_S:
        return plan
    wanted = wanted_every({r: (c.cost_s, c.step_s) for r, c in costs.items()}, budget)
    every = settle(state.every, wanted, now, state.since)
    if every == state.every and plan.grid:
        return plan
    reason = "first measure" if state.every is None else "over budget" \
        if every > state.every else "cheaper" if every < state.every else "new cycle"
    rank = max(costs, key=lambda r: costs[r].cost_s / max(costs[r].step_s, 1e-9))
    c = costs[rank]
    why = {"previous": state.every, "reason": reason, "rank": rank,
           "blocking_s": round(c.blocking_s, 6), "commit_s": round(c.commit_s, 6),
           "commit_counted": c.commit_counted, "step_s": round(c.step_s, 6),
           "budget": budget, "overhead": round(c.cost_s / (every * max(c.step_s, 1e-9)), 4),
           "ranks_measured": len(costs)}
    if every != state.every:
        state.every, state.since = every, now
    state.why = why
    start = _first_point(plan, world, summaries, max(ats), every,
                         statistics.median(x.step_s for x in costs.values()))
    return _announce(plan, start, every, why)


def _first_point(plan: Plan, world: World, summaries: Mapping[int, NodeSummary], at: int,
                 every: int, step_s: float) -> int:
    """Where an announced segment starts: ``start_of`` ahead of every rank and, when the
    cycle has no grid yet, no sooner than ``every`` steps after the newest copy a rank
    holds at or below ``at``. That copy is the snapshot each rank took to measure;
    counting it as a point of the grid keeps a short run, which would otherwise pay it on
    top, within the budget. (A copy above ``at`` is from before a restart that went back
    further, to a disk checkpoint: it says nothing of this cycle.)"""
    start = start_of(at, step_s)
    if plan.grid:
        return start  # a grid in force keeps its points until the change takes effect
    held = [i for s in summaries.values() for r, its in s.held.items() if r in world.ranks
            for i in its if i <= at]
    return max(start, max(held) + every) if held else start


def _announce(plan: Plan, start: int, every: int, why: dict[str, Any]) -> Plan:
    return Plan(plan.seq + 1, plan.pin, plan.floor, extend(plan.grid, start, every), why)


# -- a node's summary in the store (untrusted on reading) --------------------------------


def encode_summary(s: NodeSummary) -> str:
    return json.dumps({
        "v": SUMMARY_VERSION, "node": s.node,
        "held": {str(r): list(h) for r, h in s.held.items()},
        "at": {str(r): a for r, a in s.at.items()},
        "hosted": {str(r): list(h) for r, h in s.hosted.items()},
        "costs": {str(r): [c.cost_s, c.step_s, c.blocking_s, c.commit_s, c.commit_counted]
                  for r, c in s.costs.items()},
        "failing": list(s.failing)}, separators=(",", ":"), allow_nan=False)


def _is_int(v: Any, lo: int = -MAX_ITERATION, hi: int = MAX_ITERATION) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_seconds(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v < 86_400


def _per_rank(obj: Any, check: Callable[[Any], Any]) -> dict[int, Any] | None:
    """{rank: check(value)} of a JSON object keyed by rank, None when anything is off."""
    if type(obj) is not dict or len(obj) > MAX_RANKS:
        return None
    out = {}
    for key, value in obj.items():
        if not (key.isdigit() and key.isascii() and len(key) <= 9):
            return None
        got = check(value)
        if got is None:
            return None
        out[int(key)] = got
    return out


def _iterations(v: Any) -> tuple[int, ...] | None:
    ok = type(v) is list and len(v) <= 2 * len(SLOTS) and all(_is_int(i) for i in v)
    return tuple(sorted(set(v))) if ok else None


def _cost(v: Any) -> Cost | None:
    if not (type(v) is list and len(v) == 5 and all(_is_seconds(x) for x in v[:4])
            and type(v[4]) is bool):
        return None
    return Cost(float(v[0]), float(v[1]), float(v[2]), float(v[3]), v[4])


def decode_summary(raw: bytes | str) -> NodeSummary | None:
    """A node's summary read from the store, or None when anything in it is malformed."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        if len(text) > MAX_SUMMARY_BYTES:
            return None
        obj = json.loads(text, parse_constant=lambda name: None)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if type(obj) is not dict or obj.get("v") != SUMMARY_VERSION \
            or not _is_int(obj.get("node"), 0, MAX_RANKS):
        return None
    held = _per_rank(obj.get("held"), _iterations)
    at = _per_rank(obj.get("at"), lambda v: v if _is_int(v) else None)
    hosted = _per_rank(obj.get("hosted"), _iterations)
    costs = _per_rank(obj.get("costs"), _cost)
    failing = obj.get("failing")
    if held is None or at is None or hosted is None or costs is None or not (
            type(failing) is list and len(failing) <= 64
            and all(_is_int(n, 0, MAX_RANKS) for n in failing)):
        return None
    return NodeSummary(obj["node"], held, at, hosted, costs, tuple(failing))


class PlanExchange:
    """A round's summaries and plan in its rendezvous store. Never raises: a store that
    fails is logged once per kind of failure, and the plan waits."""

    def __init__(self, store: Any, round_no: int, node: int, nodes: int) -> None:
        self.store, self.round_no, self.node, self.nodes = store, round_no, node, nodes
        self._warned: set[str] = set()

    def key(self, what: str) -> str:
        return f"ft/snapshots/round{self.round_no}/{what}"

    def publish(self, summary: NodeSummary) -> None:
        self._try("publish", lambda: self.store.set(self.key(f"node/{self.node}"),
                                                    encode_summary(summary)))

    def gather(self) -> dict[int, NodeSummary]:
        out = {}
        for n in range(self.nodes):
            raw = self._read(self.key(f"node/{n}"))
            got = None if raw is None else decode_summary(raw)
            if got is not None and got.node == n:
                out[n] = got
        return out

    def publish_plan(self, plan: Plan) -> None:
        self._try("publish the plan",
                  lambda: self.store.set(self.key("plan"), encode_plan(plan).decode()))

    def read_plan(self) -> bytes | None:
        return self._read(self.key("plan"))

    def _read(self, key: str) -> bytes | None:
        # check() first: get() of a missing key blocks until the store's timeout.
        return self._try("read", lambda: self.store.get(key) if self.store.check([key])
                         else None)

    def _try(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - each store kind raises its own
            if what not in self._warned:
                self._warned.add(what)
                log.warning("snapshots: cannot %s in round %d's store: %s", what,
                            self.round_no, str(e)[:200])
            return None


@dataclass
class RankState:
    """What a local rank last said: its copies, the furthest iteration, its measure."""

    held: tuple[int, ...] = ()
    at: int | None = None
    measure: Measure | None = None


class Coordinator:
    """This node's side of the plan: the ranks' reports in, the plan file out.

    ``hosted()`` and ``failing()`` give what the replica server holds and the buddy nodes
    pushes fail to; ``on_plan`` hands each new plan to the replica server."""

    def __init__(self, directory: Path, *, auto: bool, budget: float,
                 events: Callable[..., Any], cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = directory / PLAN_FILE
        self.auto, self.budget, self.events, self.clock = auto, budget, events, clock
        self.cores = cores or len(os.sched_getaffinity(0))
        self.plan = Plan()
        self.ranks: dict[int, RankState] = {}
        self.world = World((), 1)
        self.node = 0
        self.exchange: PlanExchange | None = None
        self.frequency = FrequencyState()
        self.next_exchange = 0.0
        self.last_report: float | None = None
        self.written = False  # whether the plan file holds self.plan
        self.hosted: Callable[[], dict[int, tuple[int, ...]]] = dict
        self.failing: Callable[[], tuple[int, ...]] = tuple
        self.on_plan: Callable[[Plan], None] | None = None

    # -- a cycle -----------------------------------------------------------------------

    def begin_cycle(self, held: Mapping[int, Sequence[int]], choice: int | None,
                    world: World, node: int, exchange: PlanExchange | None) -> None:
        """A new cycle: its ranks hold ``held``, they restore ``choice`` (the first pin:
        every rank holds it); the plan starts without a grid (one snapshot to measure)."""
        self.ranks = {r: RankState(tuple(sorted(set(h)))) for r, h in held.items()}
        self.world, self.node, self.exchange = world, node, exchange
        self.next_exchange = 0.0
        floor = None if choice is None else choice + 1
        self._apply(Plan(self.plan.seq + 1, choice, floor, ()))
        self._update()

    @property
    def env(self) -> str:
        return str(self.path)

    def on_held(self, rank: int, held: list[int], at: int) -> None:
        self.last_report = self.clock()
        state = self.ranks.setdefault(rank, RankState())
        state.held, state.at = tuple(held), max(at, state.at if state.at is not None else at)
        self._update()

    def on_measure(self, rank: int, fields: Mapping[str, Any]) -> None:
        state = self.ranks.setdefault(rank, RankState())
        state.measure = Measure(fields["blocking_s"], fields["commit_s"], fields["step_s"],
                                fields["cpu"])
        at = fields["iteration"]
        state.at = max(at, state.at if state.at is not None else at)
        self._update()

    def due(self, now: float) -> float | None:
        """When the launcher's loop must read the ranks' reports and ``tick`` next: soon
        while ranks are committing snapshots; None otherwise."""
        if self.last_report is None or now - self.last_report > ACTIVE_S:
            return None
        if self.exchange is not None:
            return max(now + PROMPT_S, self.next_exchange)
        return now + PROMPT_S

    def tick(self) -> None:
        """Several nodes: publish this node's summary, and decide (group rank 0) or read
        the plan back, at most every ``EXCHANGE_S``."""
        ex = self.exchange
        if ex is None:
            return
        now = self.clock()
        if now < self.next_exchange:
            return
        self.next_exchange = now + EXCHANGE_S
        mine = self.summary()
        ex.publish(mine)
        if self.node == 0:
            self._decide({**ex.gather(), 0: mine})
            return
        raw = ex.read_plan()
        plan = None if raw is None else decode_plan(raw)
        if plan is not None and plan != self.plan:
            self._apply(plan)

    def summary(self) -> NodeSummary:
        """This node's part of the world, as the leader reads it."""
        measured = {r: s.measure for r, s in self.ranks.items() if s.measure is not None}
        busy = node_busy([m.cpu for m in measured.values()], self.cores)
        return NodeSummary(
            self.node, {r: s.held for r, s in self.ranks.items()},
            {r: s.at for r, s in self.ranks.items() if s.at is not None},
            self.hosted(),
            {r: Cost(m.cost_s(busy), m.step_s, m.blocking_s, m.commit_s, busy)
             for r, m in measured.items()},
            self.failing())

    # -- internals ---------------------------------------------------------------------

    def _update(self) -> None:
        if not self.written:
            self._write()
        if self.exchange is None:  # one node: decide now
            self._decide({self.node: self.summary()})

    def _decide(self, summaries: Mapping[int, NodeSummary]) -> None:
        plan = advance(self.plan, holdings(self.world, summaries))
        if self.auto:
            plan = next_frequency(plan, self.world, summaries, self.frequency, self.budget,
                                  self.clock())
        if plan != self.plan:
            self._apply(plan)
            if self.exchange is not None:
                self.exchange.publish_plan(plan)

    def _apply(self, plan: Plan) -> None:
        old, self.plan = self.plan, plan
        self._write()
        if self.on_plan is not None:
            self.on_plan(plan)
        if plan.grid and (not old.grid or plan.grid[-1] != old.grid[-1]):
            start, every = plan.grid[-1]
            self.events("snapshot_frequency", every=every, start=start, **plan.why)

    def _write(self) -> None:
        """The plan to the plan file, once the node's snapshot directory exists (its first
        rank to snapshot makes it; until then a rank keeps every copy, as the first plan
        of a job says)."""
        self.written = False
        if not self.path.parent.is_dir():
            return
        plan = self.plan
        try:
            tmp = self.path.with_name(f".{PLAN_FILE}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, encode_plan(plan))
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            self.written = True
        except OSError as e:
            log.warning("snapshots: cannot write the plan %s: %s", self.path, e)
