"""Simulated faults delivered by the launcher: ``--ft-simulated-fault TYPE[:key=value,...]``.

``rank_killed`` (SIGKILL) and ``rank_hung`` (SIGSTOP) are delivered from outside the worker,
so they work for any script. ``rank_exit`` needs the worker to exit with a given code, which
only the worker can do: the launcher arms it through ``FT_SIMULATED_FAULT`` and ft_agent,
once initialised in the worker, exits at the planned time. ``rank_slow:factor=F`` makes
a rank that times sections (ft_agent) stretch each to F times its work, armed the same way;
a rank that times none is stopped from outside for F-1 times each slice of its work
(SIGSTOP/SIGCONT, ft_launcher/stragglers/throttle.py); either until the cycle ends, or for
``duration`` s.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ft_agent import simulated_fault
from ft_launcher.config import ConfigError
from ft_launcher.stragglers.throttle import Throttle

if TYPE_CHECKING:
    from ft_launcher.process.workers import Worker, WorkerGroup

log = logging.getLogger("ft_launcher")

FAULT_TYPES = ("rank_killed", "rank_hung", "random", "rank_exit", "rank_slow")
KEYS = ("base_delay", "rand_delay", "rank", "cycles", "seed", "code")
SLOW_KEYS = ("factor", "duration")  # rank_slow only


@dataclass
class FaultPlan:
    """A parsed ``--ft-simulated-fault``."""

    fault_type: str
    base_delay: float = 5.0
    rand_delay: float = 0.0
    rank: int | None = None
    cycles: range | None = range(0, 1)  # None: every cycle
    seed: int | None = None
    code: int = 1
    factor: float | None = None  # rank_slow: run at 1/factor of the speed
    duration: float | None = None  # rank_slow: seconds; None: until the cycle ends

    def fires_in(self, cycle: int) -> bool:
        return self.cycles is None or cycle in self.cycles


@dataclass
class ArmedFault:
    """The fault of one cycle: what, to whom, and how long after its clock's start."""

    fault_type: str  # resolved: never "random"
    rank: int
    delay: float
    code: int = 1
    fired: bool = False
    factor: float | None = None  # rank_slow
    duration: float | None = None  # rank_slow
    at: float | None = None  # wall clock, once the delay's start is known
    clock_at: float | None = None  # wall clock the delay counts from, once known
    agent: bool = False  # a rank of the cycle said hello (sticky)

    @property
    def by_launcher(self) -> bool:
        """Delivered from outside (signals); a rank_exit is carried out by the rank."""
        return self.fault_type != "rank_exit"

    @property
    def counted_from(self) -> str:
        """Where ``delay`` counts from: ``spawn``, ``training`` or (rank_exit, counted in
        the rank by ft_agent) ``connection``."""
        if not self.by_launcher:
            return "connection"
        return "training" if self.agent else "spawn"

    def start_clock(self, spawned_at: float, training_at: float | None, connected: bool,
                    now: float) -> None:
        """Fix ``at`` (wall clock) from what is known now.

        The delay counts from the spawn, imports included, so a script that never talks to
        ft_agent in this run (one that imports it only behind a flag, say) gets its fault
        ``delay`` after it started. A hello before the fault fired re-bases the clock: from
        then on it counts from the moment every rank is training (its first heartbeat,
        section or progress report), so a script that uses ft_agent is not hit during its
        process-group setup. Nothing is read from the script's source: what it imports
        behind a flag or through another module cannot be known before it runs.
        """
        if connected and not self.agent:
            self.agent, self.at, self.clock_at = True, None, None
        if not self.agent:
            self.clock_at, self.at = spawned_at, spawned_at + self.delay
        elif self.at is None and training_at is not None:
            self.clock_at, self.at = training_at, training_at + self.delay

    def due(self) -> float | None:
        """When the watch loop must look next for this fault (wall clock), if known."""
        if self.fired or not self.by_launcher:
            return None
        return self.at

    @property
    def signum(self) -> int:
        return int(signal.SIGKILL if self.fault_type == "rank_killed" else signal.SIGSTOP)

    def env_value(self) -> str:
        """FT_SIMULATED_FAULT for the victim (read by ft_agent for rank_exit, rank_slow)."""
        if self.fault_type == "rank_slow":
            return simulated_fault.slow_fault_value(self.factor or 2.0, self.delay, self.duration)
        return simulated_fault.exit_fault_value(self.code, self.delay)


def _number(key: str, value: str, kind: type) -> float | int:
    try:
        number = kind(value)
    except ValueError:
        raise ConfigError(f"--ft-simulated-fault: {key}={value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"--ft-simulated-fault: {key}={value!r} must be a finite number >= 0")
    return number


def _cycles(value: str) -> range | None:
    if value == "all":
        return None
    first, sep, last = value.partition("-")
    try:
        lo = int(first)
        hi = int(last) if sep else lo
    except ValueError:
        raise ConfigError(
            f"--ft-simulated-fault: cycles={value!r}: expected N, A-B or all"
        ) from None
    if lo < 0 or hi < lo:
        raise ConfigError(f"--ft-simulated-fault: cycles={value!r} is an empty range")
    return range(lo, hi + 1)


def parse_fault(text: str) -> FaultPlan:
    """Parse ``TYPE[:key=value,...]``; raises ConfigError naming the bad part."""
    fault_type, _, rest = text.strip().partition(":")
    if fault_type not in FAULT_TYPES:
        raise ConfigError(
            f"--ft-simulated-fault: unknown fault type {fault_type!r}; "
            f"expected one of {', '.join(FAULT_TYPES)}"
        )
    plan = FaultPlan(fault_type)
    keys = KEYS + SLOW_KEYS if fault_type == "rank_slow" else KEYS
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = item.partition("=")
        if sep and key in SLOW_KEYS and key not in keys:
            raise ConfigError(f"--ft-simulated-fault: {key}= applies to rank_slow only, not to "
                              f"{fault_type}")
        if not sep or key not in keys:
            raise ConfigError(
                f"--ft-simulated-fault: unknown key {key!r}; expected key=value with key one "
                f"of {', '.join(keys)}"
            )
        if key in SLOW_KEYS:
            setattr(plan, key, _slow_number(key, value))
        elif key in ("base_delay", "rand_delay"):
            setattr(plan, key, float(_number(key, value, float)))
        elif key == "cycles":
            plan.cycles = _cycles(value)
        else:
            setattr(plan, key, int(_number(key, value, int)))
    given = {p.partition("=")[0].strip() for p in rest.split(",") if p.strip()}
    if plan.fault_type == "rank_exit":
        if "code" not in given:
            raise ConfigError("--ft-simulated-fault: rank_exit needs code=N (e.g. code=16)")
        if not 1 <= plan.code <= 255:
            raise ConfigError(f"--ft-simulated-fault: code={plan.code} is not an exit code "
                              "that signals a failure (1-255)")
    elif "code" in given:
        raise ConfigError(f"--ft-simulated-fault: code= applies to rank_exit only, not to "
                          f"{plan.fault_type}")
    if plan.fault_type == "rank_slow" and plan.factor is None:
        raise ConfigError("--ft-simulated-fault: rank_slow needs factor=F > 1 "
                          "(e.g. factor=2: half speed)")
    return plan


def _slow_number(key: str, value: str) -> float:
    """rank_slow's factor (> 1: the rank runs at 1/factor) and duration (seconds > 0)."""
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"--ft-simulated-fault: {key}={value!r} is not a number") from None
    low = 1.0 if key == "factor" else 0.0
    if not (math.isfinite(number) and number > low):
        what = "the rank runs at 1/factor of its speed" if key == "factor" else "seconds"
        raise ConfigError(f"--ft-simulated-fault: {key}={value!r} must be a finite number "
                          f"> {low:g} ({what})")
    return number


def validate_world(plan: FaultPlan, world_size: int) -> None:
    """Reject a victim rank outside a world of ``world_size`` ranks (before any cycle runs)."""
    if plan.rank is not None and plan.rank >= world_size:
        raise ConfigError(
            f"--ft-simulated-fault: rank={plan.rank} but the world has {world_size} ranks"
        )


def arm(plan: FaultPlan, cycle: int, world_size: int, run_id: str) -> ArmedFault | None:
    """The fault for this cycle, identical on every node (seeded by run id and cycle)."""
    if not plan.fires_in(cycle):
        return None
    validate_world(plan, world_size)
    seed = str(plan.seed) if plan.seed is not None else run_id
    fault = simulated_fault.draw(seed, cycle, world_size, plan.fault_type, plan.base_delay,
                                 plan.rand_delay, plan.rank)
    fault_type, rank, delay = fault.fault_type, fault.rank, fault.delay
    return ArmedFault(fault_type, rank, delay, plan.code, factor=plan.factor,
                      duration=plan.duration)


@dataclass
class Injected:
    """A fault the launcher delivered: the throttle of a ``rank_slow`` fault (stopped by
    the cycle before its teardown) and the fault's record for the summary."""

    throttle: Throttle | None
    record: dict[str, Any]


def inject(group: WorkerGroup, armed: ArmedFault, cycle: int, events: Callable[..., Any],
           new_throttle: Callable[..., Throttle] = Throttle,
           times_sections: Callable[[int], bool] = lambda rank: False) -> Injected | None:
    """Deliver ``armed`` to its victim among ``group``'s workers (``fault_injected``);
    None when the victim is gone already. The fault fires once either way."""
    armed.fired = True
    victim = next((w for w in group.workers if w.rank == armed.rank), None)
    if victim is None or not victim.alive:
        return None
    extra: dict[str, Any] = {}
    throttle = None
    record = {"cycle": cycle, "kind": "injected", "fault_type": armed.fault_type,
              "rank": armed.rank}
    if armed.fault_type == "rank_slow":
        if times_sections(armed.rank):
            # It slows its sections itself (ft_agent, FT_SIMULATED_FAULT) and says when.
            return Injected(None, record)
        # Else stops in proportion to its work, from outside, until it closes a section
        # (throttle.py holds a pidfd of the pid we spawned, so a reused pid is never
        # signalled, and signals nothing else; the peers' pace is only read).
        peers = [w.pid for w in group.workers if w is not victim and w.alive]
        try:
            throttle = new_throttle(victim.pid, armed.factor, duration_s=armed.duration,
                                    peers=peers, until=lambda: times_sections(armed.rank))
        except ProcessLookupError:
            return None
        throttle.start()
        extra = {"factor": armed.factor, "duration": armed.duration,
                 "max_stop_s": throttle.max_stop_s, "by": "throttle"}
    else:
        group.signal_process(victim, victim.pid, armed.signum)
    events("fault_injected", rank=armed.rank, fault_type=armed.fault_type,
           pid=victim.pid, at=round(armed.at or time.time(), 6), delay=armed.delay,
           counted_from=armed.counted_from, **extra)
    return Injected(throttle, record)


def plan_for(text: str | None, world_size: int) -> FaultPlan | None:
    """The job's ``--ft-simulated-fault``, parsed and checked against the largest world;
    None when no fault is asked for."""
    if not text:
        return None
    plan = parse_fault(text)
    validate_world(plan, world_size)
    return plan


def not_fired(armed: ArmedFault | None, workers: Sequence[Worker],
              now: float) -> dict[str, Any] | None:
    """The facts of a cycle's armed fault that never fired (its cycle is over), or None:
    the clock its delay counted from and how long that clock ran (``waited_s``; None when
    it never started: a rank said hello but the ranks never all trained, or a
    ``rank_exit``, whose clock runs in the rank).

    A ``rank_exit`` is carried out by ft_agent in the rank: its victim's exit with the
    planned code is the fault firing (the agent reports it too, as ``fault_injected``)."""
    if armed is None or armed.fired or not workers:
        return None
    if not armed.by_launcher and any(w.rank == armed.rank and w.exit_code == armed.code
                                     for w in workers):
        return None
    spawned_at = max(w.started_at for w in workers)
    clock_at = spawned_at if armed.counted_from == "spawn" else armed.clock_at
    waited = None if clock_at is None or not armed.by_launcher \
        else round(max(0.0, now - clock_at), 3)
    return {"fault_type": armed.fault_type, "rank": armed.rank, "delay": armed.delay,
            "counted_from": armed.counted_from, "waited_s": waited,
            "cycle_s": round(max(0.0, now - spawned_at), 3)}


def not_fired_text(facts: dict[str, Any]) -> str:
    """What a ``fault_not_fired`` record says, in words (the log line, ft_report); a record
    of an older launcher, without ``waited_s``, reads too."""
    def seconds(key: str) -> str:
        value = facts.get(key)
        return f"{value:g} s" if isinstance(value, int | float) else "? s"

    clock = facts.get("counted_from")
    if clock == "connection":
        waited = "counted in the rank from its connection (carried out by ft_agent: a " \
                 "script without it cannot fire it)"
    elif "waited_s" not in facts:
        waited = "no record of how long it waited"
    elif facts["waited_s"] is None:
        waited = f"its clock ({clock}) never started: a rank said hello but the ranks " \
                 "never all started training"
    else:
        waited = f"it waited {seconds('waited_s')} on that clock"
    return (f"simulated {facts.get('fault_type')} for rank {facts.get('rank')} never fired: "
            f"due {seconds('delay')} after {clock}, {waited}; the cycle ended "
            f"{seconds('cycle_s')} after the spawn")


def report_not_fired(armed: ArmedFault | None, workers: Sequence[Worker], now: float,
                     cycle: int, events: Callable[..., Any]) -> None:
    """Say so when the cycle ended with its armed fault never fired: ``fault_not_fired``
    and one warning line."""
    facts = not_fired(armed, workers, now)
    if facts is None:
        return
    events("fault_not_fired", **facts)
    log.warning("cycle %d: %s", cycle, not_fired_text(facts))
