"""Timeout bookkeeping: which timeout is in force for each kind, and why.

Sources, per kind of timeout:

- *configured*: the command line or the YAML file (``FaultToleranceConfig``);
- *calculated*: asked for by a rank (``calculate_and_set_*``), restored from a checkpoint
  (``load_state_dict``) or loaded from ``ft_state.json``;
- *learned*: the heartbeat timeout the monitor arms by itself when none is configured,
  once it has seen ``AUTO_MIN_INTERVALS`` intervals.

Rules: a calculated value beats a learned one and replaces the configured one, except that a
value the user configured is never lowered by a calculated one unless
``learned_timeouts_override`` says so. Every calculated value is at least
``min_learned_timeout`` (a few fast steps times a safety factor must not kill a rank that
pauses for a checkpoint). Values from outside (state file, messages) are validated: a
non-finite, non-positive or oversized entry is refused, never put in force.

Pure: no file, no socket. ``load_state`` / ``save_state`` do the file side.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_agent import config as agent_config
from ft_agent import protocol
from ft_launcher.config import FaultToleranceConfig
from ft_launcher.rundir import read_json_object, write_json_atomic

log = logging.getLogger("ft_launcher")

# Kinds of timeout, as the liveness model and the events name them.
TIMEOUT_INITIAL = "initial"
TIMEOUT_HEARTBEAT = "heartbeat"
TIMEOUT_OUT_OF_SECTION = "out_of_section"
SECTION_PREFIX = "section:"
SECTIONS_KEY = protocol.SECTION_TIMEOUTS_KEY

# Kind -> the configuration / state-file / message key (NVRx's names, from the protocol).
TIMEOUT_KEYS = dict(zip((TIMEOUT_INITIAL, TIMEOUT_HEARTBEAT, TIMEOUT_OUT_OF_SECTION),
                        protocol.TIMEOUT_KEYS, strict=True))

AUTO_MIN_INTERVALS = 100
AUTO_MIN_TIMEOUT_S = 300.0
# The same limits as for configured values (ft_agent.config checks those).
DEFAULT_MIN_LEARNED_TIMEOUT_S = agent_config.DEFAULT_MIN_LEARNED_TIMEOUT_S
MAX_TIMEOUT_S = agent_config.MAX_SECONDS
MAX_SECTION_NAMES = agent_config.MAX_SECTIONS
MAX_SECTION_NAME_LEN = agent_config.MAX_SECTION_NAME_LEN
STATE_VERSION = 1


def section_kind(name: str) -> str:
    """The kind of a named section's timeout."""
    return SECTION_PREFIX + name


def valid_seconds(value: Any) -> float | None:
    """``value`` as seconds when it is a finite number in (0, MAX_TIMEOUT_S], else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TIMEOUT_S:
        return None
    return seconds


def valid_section_name(name: Any) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MAX_SECTION_NAME_LEN


@dataclass
class TimeoutValues:
    """Timeouts by key: the three rank timeouts and the named sections' ones."""

    ranks: dict[str, float] = field(default_factory=dict)  # TIMEOUT_KEYS values -> seconds
    sections: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.ranks, SECTIONS_KEY: dict(self.sections)}


def parse_timeouts(data: Any) -> tuple[TimeoutValues, list[str]]:
    """Validate a timeouts mapping from outside; returns the valid part and the problems."""
    values, problems = TimeoutValues(), []
    if not isinstance(data, dict):
        return values, [f"timeouts: expected a mapping, got {type(data).__name__}"]
    for key, value in data.items():
        if key == SECTIONS_KEY:
            if value is None:
                continue
            if not isinstance(value, dict):
                problems.append(f"{SECTIONS_KEY}: expected a mapping")
                continue
            for name, seconds in value.items():
                ok = valid_seconds(seconds)
                if not valid_section_name(name) or (ok is None and seconds is not None):
                    problems.append(f"{SECTIONS_KEY}[{str(name)[:40]!r}]: {seconds!r}")
                elif ok is not None and len(values.sections) < MAX_SECTION_NAMES:
                    values.sections[name] = ok
        elif key in TIMEOUT_KEYS.values():
            ok = valid_seconds(value)
            if ok is None and value is not None:
                problems.append(f"{key}: {value!r} is not a positive finite number of seconds")
            elif ok is not None:
                values.ranks[key] = ok
        else:
            problems.append(f"unknown timeout {str(key)[:40]!r}")
    return values, problems


@dataclass
class TimeoutState:
    """What ft_state.json holds: longest intervals observed per kind, calculated timeouts."""

    observed: dict[str, float] = field(default_factory=dict)
    calculated: TimeoutValues = field(default_factory=TimeoutValues)

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "observed": dict(self.observed),
                "calculated": self.calculated.to_json()}


def state_from_json(data: Any) -> tuple[TimeoutState, list[str]]:
    """A TimeoutState from parsed JSON; anything invalid is dropped and named."""
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        return TimeoutState(), ["not a state file of this version"]
    problems = []
    observed = {}
    raw_observed = data.get("observed", {})
    if isinstance(raw_observed, dict):
        for kind, value in list(raw_observed.items())[:MAX_SECTION_NAMES + 3]:
            ok = valid_seconds(value)
            known = kind in TIMEOUT_KEYS or (
                isinstance(kind, str) and kind.startswith(SECTION_PREFIX)
                and valid_section_name(kind[len(SECTION_PREFIX):]))
            if ok is None or not known:
                problems.append(f"observed[{str(kind)[:40]!r}]")
            else:
                observed[kind] = ok
    else:
        problems.append("observed: not a mapping")
    calculated, more = parse_timeouts(data.get("calculated", {}))
    return TimeoutState(observed, calculated), problems + [f"calculated: {p}" for p in more]


def load_state(path: Path) -> TimeoutState:
    """Read ft_state.json: any content is either valid or ignored with one warning."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return TimeoutState()
    except OSError as exc:
        log.warning("ignoring unreadable state file %s: %s", path, exc)
        return TimeoutState()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        log.warning("ignoring state file %s: not JSON (%s)", path, str(exc)[:80])
        return TimeoutState()
    state, problems = state_from_json(data)
    if problems:
        log.warning("state file %s: ignored %d invalid entr%s: %s", path, len(problems),
                    "y" if len(problems) == 1 else "ies", "; ".join(problems[:5]))
    return state


def save_state(path: Path, state: TimeoutState) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Other keys are other writers' (the learned preloads): kept as they are.
        write_json_atomic(path, {**read_json_object(path), **state.to_json()})
    except OSError as exc:
        log.warning("cannot write state file %s: %s", path, exc)


class TimeoutBook:
    """The timeouts in force, from configuration, calculations and learning."""

    def __init__(self, cfg: FaultToleranceConfig, state: TimeoutState | None = None) -> None:
        self.cfg = cfg
        self.state = state or TimeoutState()
        self.floor = float(getattr(cfg, "min_learned_timeout", DEFAULT_MIN_LEARNED_TIMEOUT_S))
        self.override = bool(getattr(cfg, "learned_timeouts_override", False))
        # Heartbeat intervals seen in this cycle: the learned timeout is asked for at every
        # wake-up, so it is kept as running totals.
        self.hb_count = 0
        self.hb_longest = 0.0

    # -- what is in force ----------------------------------------------------------------

    def timeout_for(self, kind: str) -> float | None:
        """Seconds for a kind ("initial", "heartbeat", "out_of_section", "section:<name>"),
        or None when that kind is not judged."""
        return self.explain(kind)[0]

    def explain(self, kind: str) -> tuple[float | None, str]:
        """(seconds or None, where the value comes from)."""
        if kind.startswith(SECTION_PREFIX):
            name = kind[len(SECTION_PREFIX):]
            configured = self.cfg.rank_section_timeouts.get(name)
            calculated = self.state.calculated.sections.get(name)
            explicit = name in self.cfg.rank_section_timeouts
        else:
            key = TIMEOUT_KEYS[kind]
            configured = getattr(self.cfg, key)
            calculated = self.state.calculated.ranks.get(key)
            explicit = configured is not None or key in _configured(self.cfg)
        if calculated is not None:
            calculated = max(calculated, self.floor)
            if explicit and configured is not None and not self.override \
                    and calculated < configured:
                return configured, "configured (not lowered by a calculated value)"
            return calculated, "calculated"
        if configured is not None or explicit or kind != TIMEOUT_HEARTBEAT:
            return configured, "configured" if configured is not None else "off"
        learned = self._learned()
        return learned, "learned" if learned is not None else "not learned yet"

    def _learned(self) -> float | None:
        longest = self.state.observed.get(TIMEOUT_HEARTBEAT)
        if self.hb_count < AUTO_MIN_INTERVALS and longest is None:
            return None
        longest = max(self.hb_longest, longest or 0.0)
        if not longest:
            return None
        return max(self.cfg.safety_factor * longest, AUTO_MIN_TIMEOUT_S, self.floor)

    def section_names(self) -> set[str]:
        return set(self.cfg.rank_section_timeouts) | set(self.state.calculated.sections)

    def knows_section(self, name: str) -> bool:
        return name in self.cfg.rank_section_timeouts or name in self.state.calculated.sections

    def in_force(self) -> dict[str, Any]:
        """Every timeout in force, keyed as in the configuration (sent to ranks, logged)."""
        result: dict[str, Any] = {key: self.timeout_for(k) for k, key in TIMEOUT_KEYS.items()}
        result[SECTIONS_KEY] = {n: self.timeout_for(section_kind(n))
                                for n in sorted(self.section_names())}
        return result

    def calculated_kinds(self) -> list[str]:
        """The kinds whose timeout in force is a calculated one (NVRx's "were calculated")."""
        kinds = [*TIMEOUT_KEYS, *(section_kind(n) for n in sorted(self.section_names()))]
        return [k for k in kinds if self.explain(k)[1] == "calculated"]

    def describe(self) -> str:
        """One line for the log: each timeout in force and its source."""
        parts = []
        for kind in (*TIMEOUT_KEYS, *(section_kind(n) for n in sorted(self.section_names()))):
            value, source = self.explain(kind)
            shown = "off" if value is None else f"{value:g}s"
            parts.append(f"{kind}={shown} ({source})")
        return ", ".join(parts)

    # -- what changes it -----------------------------------------------------------------

    def heartbeat_interval(self, seconds: float) -> None:
        self.hb_count += 1
        self.hb_longest = max(self.hb_longest, seconds)

    def new_cycle(self) -> None:
        self.hb_count, self.hb_longest = 0, 0.0

    def observe(self, longest: dict[str, float]) -> None:
        """Fold a cycle's longest intervals per kind into the observed ones."""
        for kind, value in longest.items():
            self.state.observed[kind] = max(self.state.observed.get(kind, 0.0), value)

    def calculate(self, kind: str, longest: float | None) -> None:
        """Put ``safety_factor x longest`` in force for a kind of timeout, merged with the
        earlier calculated value: a calculated timeout only grows, so a slow interval seen
        in an earlier cycle is never forgotten."""
        if longest is None or not math.isfinite(longest):
            return
        if kind.startswith(SECTION_PREFIX):
            into, name = self.state.calculated.sections, kind[len(SECTION_PREFIX):]
        else:
            into, name = self.state.calculated.ranks, TIMEOUT_KEYS[kind]
        # Saved as calculated; the floor applies to what is in force (explain), so a
        # state file shared by jobs with different floors stays meaningful.
        new = min(max(self.cfg.safety_factor * longest, 1e-3), MAX_TIMEOUT_S)
        into[name] = round(max(new, into.get(name, 0.0)), 6)

    def set_values(self, values: TimeoutValues) -> None:
        """Put validated values in force (a checkpoint's timeouts); the floor still holds."""
        self.state.calculated.ranks.update(values.ranks)
        room = MAX_SECTION_NAMES - len(self.state.calculated.sections)
        for name, seconds in values.sections.items():
            if name in self.state.calculated.sections or room > 0:
                room -= name not in self.state.calculated.sections
                self.state.calculated.sections[name] = seconds


def _configured(cfg: FaultToleranceConfig) -> frozenset[str]:
    """Timeout keys the user gave explicitly (``none`` included), when config records it."""
    return frozenset(getattr(cfg, "configured", ()) or ())
