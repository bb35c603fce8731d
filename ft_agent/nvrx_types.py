"""NVRx's public value types for the client, and the state-dict layout of its checkpoints.

NVRx code reads ``client.hb_timeouts`` / ``client.section_timeouts``, builds a
``WorkloadControlRequest`` and stores ``client.state_dict()`` in its checkpoints. The same
names, fields and layout here let such code, and its checkpoints, move over unchanged:

    {"current_timeouts": {
        "heartbeat": {"initial": s, "subsequent": s, "were_calculated": true},
        "section": {"section": {name: s}, "out_of_section": s,
                    "calculated_sections": [names], "is_out_of_section_calculated": bool}}}

Only calculated timeouts are stored (as NVRx does), so a checkpoint never pins a value the
user configured. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

CURRENT_TIMEOUTS_STATE_KEY = "current_timeouts"
# The layout this package wrote before it followed NVRx's; still read.
LEGACY_STATE_KEY = "timeouts"
MAX_STATE_SECONDS = 30 * 24 * 3600.0
MAX_STATE_SECTIONS = 256

# Keys of the timeouts dict the monitor sends in its config reply and acks.
INITIAL_KEY = "initial_rank_heartbeat_timeout"
HEARTBEAT_KEY = "rank_heartbeat_timeout"
SECTIONS_KEY = "rank_section_timeouts"
OUT_OF_SECTION_KEY = "rank_out_of_section_timeout"


def _fmt(seconds: float | None) -> str:
    return "off" if seconds is None else f"{seconds:.2f}s"


@dataclass
class HeartbeatTimeouts:
    """The heartbeat timeouts in force: ``initial`` (spawn to first heartbeat) and
    ``subsequent`` (between heartbeats); None = not in force. ``were_calculated``: they
    come from ``calculate_and_set_hb_timeouts`` or a loaded state, not the configuration."""

    initial: float | None = None
    subsequent: float | None = None
    were_calculated: bool | None = None

    @property
    def are_valid(self) -> bool:
        """Both timeouts are in force."""
        return self.initial is not None and self.subsequent is not None

    def __str__(self) -> str:
        return (f"HeartbeatTimeouts(initial={_fmt(self.initial)}, "
                f"subsequent={_fmt(self.subsequent)}, were_calculated={self.were_calculated})")


@dataclass
class SectionTimeouts:
    """The section timeouts in force: ``section`` (name -> seconds or None) and
    ``out_of_section`` (while no section is open); which of them were calculated."""

    section: dict[str, float | None] = field(default_factory=dict)
    out_of_section: float | None = None
    calculated_sections: set[str] = field(default_factory=set)
    is_out_of_section_calculated: bool = False

    def __post_init__(self) -> None:
        self.section = dict(self.section)
        self.calculated_sections = set(self.calculated_sections)

    @property
    def were_calculated(self) -> bool:
        """Every section timeout and the out-of-section one were calculated."""
        return self.calculated_sections == set(self.section) and \
            self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        """Every section and the out-of-section time have a timeout in force."""
        return self.out_of_section is not None and \
            all(v is not None for v in self.section.values())

    def __str__(self) -> str:
        def mark(name: str) -> str:
            return "*" if name in self.calculated_sections else ""

        sections = ", ".join(f"{n}={_fmt(v)}{mark(n)}" for n, v in sorted(self.section.items()))
        oos = "*" if self.is_out_of_section_calculated else ""
        return (f"SectionTimeouts(sections=[{sections}], "
                f"out_of_section={_fmt(self.out_of_section)}{oos}; *=calculated)")


class WorkloadAction(Enum):
    """What a rank may ask the launcher to do with the job (NVRx's names and values)."""

    Continue = 0
    ExcludeThisNode = 1
    ShutdownWorkload = 2

    @property
    def wire(self) -> str:
        """The action's name in the protocol's ``control`` message."""
        return _WIRE[self]


_WIRE = {WorkloadAction.Continue: "continue", WorkloadAction.ExcludeThisNode: "exclude_node",
         WorkloadAction.ShutdownWorkload: "shutdown"}


class WorkloadControlRequest:
    """A request for the launcher: an action and a free-text description."""

    def __init__(self, action: WorkloadAction, description: str = "<not set>") -> None:
        self.action = action
        self.description = description

    def __str__(self) -> str:
        return f"WorkloadControlRequest(action={self.action}, description={self.description})"


# -- conversions ---------------------------------------------------------------------------


@dataclass
class CalculatedMarks:
    """Which of the timeouts in force this client calculated or loaded."""

    heartbeat: bool = False
    sections: set[str] = field(default_factory=set)
    out_of_section: bool = False


def marks_from_kinds(kinds: list[str]) -> CalculatedMarks:
    """Marks from the monitor's list of calculated timeout kinds ("initial", "heartbeat",
    "out_of_section", "section:<name>")."""
    return CalculatedMarks(heartbeat="heartbeat" in kinds,
                           sections={k[len("section:"):] for k in kinds
                                     if k.startswith("section:")},
                           out_of_section="out_of_section" in kinds)


def mark_sections_calculated(marks: CalculatedMarks, in_force: SectionTimeouts,
                             wanted: list[str] | None, out_of_section: bool) -> None:
    """After a section calculation the monitor accepted: the reply says which timeouts are
    in force, not which were observed, so a selected section (every one, for ``wanted``
    None) with a timeout now counts as calculated; the out-of-section one too when asked."""
    names = set(in_force.section) if wanted is None else set(wanted)
    marks.sections |= {n for n in names if in_force.section.get(n) is not None}
    if out_of_section and in_force.out_of_section is not None:
        marks.out_of_section = True


def absorb_reply(reply: Mapping[str, Any], timeouts: dict[str, Any],
                 marks: CalculatedMarks) -> tuple[dict[str, Any], CalculatedMarks]:
    """The timeouts and marks after a config reply or an ack: its ``timeouts`` when it has
    them, and its ``calculated`` kinds when it says (else the ones given)."""
    if isinstance(reply.get("timeouts"), dict):
        timeouts = dict(reply["timeouts"])
    kinds = reply.get("calculated")
    if isinstance(kinds, list) and all(isinstance(k, str) for k in kinds):
        marks = marks_from_kinds(kinds)
    return timeouts, marks


def heartbeat_timeouts(timeouts: Mapping[str, Any], marks: CalculatedMarks) -> HeartbeatTimeouts:
    """The heartbeat view of the monitor's timeouts dict."""
    return HeartbeatTimeouts(_seconds_or_none(timeouts.get(INITIAL_KEY)),
                             _seconds_or_none(timeouts.get(HEARTBEAT_KEY)), marks.heartbeat)


def section_timeouts(timeouts: Mapping[str, Any], marks: CalculatedMarks) -> SectionTimeouts:
    """The section view of the monitor's timeouts dict."""
    raw = timeouts.get(SECTIONS_KEY)
    sections = {str(k): _seconds_or_none(v) for k, v in raw.items()} \
        if isinstance(raw, Mapping) else {}
    return SectionTimeouts(sections, _seconds_or_none(timeouts.get(OUT_OF_SECTION_KEY)),
                           marks.sections & set(sections), marks.out_of_section)


def _seconds_or_none(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def state_dict_of(hb: HeartbeatTimeouts, sec: SectionTimeouts) -> dict[str, Any]:
    """NVRx's checkpoint layout: only calculated timeouts, JSON-serialisable."""
    current: dict[str, Any] = {}
    if hb.are_valid and hb.were_calculated:
        current["heartbeat"] = {"initial": hb.initial, "subsequent": hb.subsequent,
                                "were_calculated": True}
    if sec.calculated_sections or sec.is_out_of_section_calculated:
        current["section"] = {
            "section": dict(sec.section),
            "out_of_section": sec.out_of_section,
            "calculated_sections": sorted(sec.calculated_sections),
            "is_out_of_section_calculated": bool(sec.is_out_of_section_calculated),
        }
    return {CURRENT_TIMEOUTS_STATE_KEY: current}


class StateDictError(ValueError):
    """A state dict that is not a RankMonitorClient state; the message says why."""


def _state_seconds(where: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StateDictError(f"{where}: expected seconds or None, got {value!r}")
    if not math.isfinite(value) or not 0 < value <= MAX_STATE_SECONDS:
        raise StateDictError(f"{where}: {value!r} is not a positive finite number of seconds "
                             f"up to {MAX_STATE_SECONDS:.0f}")
    return float(value)


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StateDictError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def timeouts_from_state(state: Any) -> tuple[dict[str, Any], CalculatedMarks]:
    """What a state dict (NVRx's layout, or this package's earlier one) puts in force:
    a timeouts dict for the monitor's ``set_timeouts`` and the marks of what was calculated.
    Raises StateDictError naming the offending entry."""
    state = _mapping("RankMonitorClient state", state)
    if CURRENT_TIMEOUTS_STATE_KEY in state:
        return _from_nvrx(_mapping(CURRENT_TIMEOUTS_STATE_KEY, state[CURRENT_TIMEOUTS_STATE_KEY]))
    if LEGACY_STATE_KEY in state:
        return _from_legacy(_mapping(LEGACY_STATE_KEY, state[LEGACY_STATE_KEY]))
    raise StateDictError(f"RankMonitorClient state: no '{CURRENT_TIMEOUTS_STATE_KEY}' entry "
                         f"(keys: {sorted(map(str, state))[:10]}); pass the dict that "
                         "state_dict() returned")


def _from_nvrx(current: Mapping[str, Any]) -> tuple[dict[str, Any], CalculatedMarks]:
    timeouts: dict[str, Any] = {}
    marks = CalculatedMarks()
    where = CURRENT_TIMEOUTS_STATE_KEY
    if current.get("heartbeat") is not None:
        hb = _mapping(f"{where}.heartbeat", current["heartbeat"])
        _only(f"{where}.heartbeat", hb, {"initial", "subsequent", "were_calculated"})
        for name, key in (("initial", INITIAL_KEY), ("subsequent", HEARTBEAT_KEY)):
            value = _state_seconds(f"{where}.heartbeat.{name}", hb.get(name))
            if value is not None:
                timeouts[key] = value
        marks.heartbeat = True
    if current.get("section") is not None:
        sec = _mapping(f"{where}.section", current["section"])
        _only(f"{where}.section", sec, {"section", "out_of_section", "calculated_sections",
                                        "is_out_of_section_calculated"})
        values = _mapping(f"{where}.section.section", sec.get("section") or {})
        if len(values) > MAX_STATE_SECTIONS:
            raise StateDictError(f"{where}.section.section: {len(values)} sections, more than "
                                 f"{MAX_STATE_SECTIONS}")
        calculated = sec.get("calculated_sections") or []
        if not isinstance(calculated, (list, tuple, set, frozenset)) or \
                not all(isinstance(n, str) for n in calculated):
            raise StateDictError(f"{where}.section.calculated_sections: expected a list of "
                                 f"names, got {calculated!r}")
        # Only what was calculated is put in force: configured values stay configured.
        chosen = {}
        for name in calculated:
            value = _state_seconds(f"{where}.section.section[{name}]", values.get(name))
            if value is not None:
                chosen[name] = value
        if chosen:
            timeouts[SECTIONS_KEY] = chosen
        marks.sections = set(chosen)
        if sec.get("is_out_of_section_calculated"):
            oos = _state_seconds(f"{where}.section.out_of_section", sec.get("out_of_section"))
            if oos is not None:
                timeouts[OUT_OF_SECTION_KEY] = oos
                marks.out_of_section = True
    return timeouts, marks


def _only(where: str, entry: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(map(str, entry)) - allowed
    if unknown:
        raise StateDictError(f"{where}: unknown field(s) {sorted(unknown)}; expected "
                             f"{sorted(allowed)}")


def _from_legacy(old: Mapping[str, Any]) -> tuple[dict[str, Any], CalculatedMarks]:
    timeouts: dict[str, Any] = {}
    marks = CalculatedMarks()
    for key in (INITIAL_KEY, HEARTBEAT_KEY, OUT_OF_SECTION_KEY):
        value = _state_seconds(f"{LEGACY_STATE_KEY}.{key}", old.get(key))
        if value is not None:
            timeouts[key] = value
    raw = old.get(SECTIONS_KEY) or {}
    sections = {str(n): _state_seconds(f"{LEGACY_STATE_KEY}.{SECTIONS_KEY}[{n}]", v)
                for n, v in _mapping(f"{LEGACY_STATE_KEY}.{SECTIONS_KEY}", raw).items()}
    sections = {n: v for n, v in sections.items() if v is not None}
    if sections:
        timeouts[SECTIONS_KEY] = sections
    marks.heartbeat = HEARTBEAT_KEY in timeouts
    marks.sections = set(sections)
    marks.out_of_section = OUT_OF_SECTION_KEY in timeouts
    return timeouts, marks
