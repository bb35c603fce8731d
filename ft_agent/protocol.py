"""Wire format between the in-process agent and the launcher's monitor.

Every message is one ZeroMQ frame holding a UTF-8 JSON object with a protocol version
``v`` and a kind ``k``. JSON rather than pickle: a frame from a stranger can at worst be
rejected, never execute code. The DEALER socket's routing id identifies the sender, so a
heartbeat carries nothing but its kind and costs one pre-encoded frame.

Kinds (agent -> monitor unless noted):

=================  ==================================================================
``hello``          token, rank, local_rank, pid, host, cycle
``config``         monitor -> agent reply to hello: ``ok``, ``error``, ``timeouts``,
                   ``stack_signal`` (never a path: the agent writes only where its
                   environment says, so a fake monitor cannot aim it at a file)
``hb``             heartbeat, fire-and-forget; ``t``: the sender's monotonic clock;
                   ``folds``: true once the rank folds heartbeats (see below)
``sec_open``       ``name``: a section starts (and ``t``, as for hb)
``sec_close``      ``name``: a section ends (and ``t``); ``dev``: the device (GPU) time in
                   seconds of an earlier section of that name, timed with
                   ``device=True``, once its events completed
``sec_close_all``  every open section ends (and ``t``)
``calc``           ``req``, ``what`` ("hb" or "sections"), ``sections``,
                   ``out_of_section``, ``skip_if_not_ready``: calculate timeouts from what
                   the monitor observed and put them in force
``set_timeouts``   ``req``, ``timeouts``: put given timeouts in force (load_state_dict)
``ack``            monitor -> agent reply to a request: ``req``, ``ok``, ``error``, ``timeouts``
``control``        ``action``: "continue", "exclude_node" or "shutdown"; ``description``
``diagnosis``      a rerun state machine verdict: ``state``, ``diagnostic``, ``iteration``,
                   ``message``, ``exit_code``, ``fatal``, ``host``, ``device``,
                   ``suspicious_host``, ``suspicious_device``
``report``         ``what``, ``message``: something the rank wants on record (an exception)
``progress``       ``it``: the training finished step ``it``; ``ckpt``: true when a
                   checkpoint of step ``it`` was saved (and ``t``, as for hb)
``goodbye``        the rank stops monitoring
``fence``          ``req``, ``stopped_s``: this rank was stopped that long (SIGSTOP of its
                   node) and waits for the launcher's ``ack``: ``ok`` true when its
                   rendezvous round is still current, false (``error``: why) when the
                   node was dropped and the rank must exit before it writes anything
=================  ==================================================================

Decoding is total: any bytes are either a message whose every field was checked (type,
finite number, range, bounded length and size) or a ``ProtocolError``; nothing else is
raised. Fields a kind does not define are dropped, never passed on, so a sender cannot
smuggle ``event``, ``rank`` or ``ts`` into what the monitor records. Optional fields that
are absent stay absent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

VERSION = 1

HELLO = "hello"
CONFIG = "config"
HEARTBEAT = "hb"
SECTION_OPEN = "sec_open"
SECTION_CLOSE = "sec_close"
SECTION_CLOSE_ALL = "sec_close_all"
CALCULATE = "calc"
SET_TIMEOUTS = "set_timeouts"
ACK = "ack"
CONTROL = "control"
DIAGNOSIS = "diagnosis"
REPORT = "report"
PROGRESS = "progress"
GOODBYE = "goodbye"
FENCE = "fence"

CONTROL_ACTIONS = ("continue", "exclude_node", "shutdown")
CALCULATE_HB = "hb"
CALCULATE_SECTIONS = "sections"
CALCULATIONS = (CALCULATE_HB, CALCULATE_SECTIONS)

# Keys of a ``timeouts`` object (set_timeouts, config, ack); the names of NVRx's config.
TIMEOUT_KEYS = (
    "initial_rank_heartbeat_timeout",
    "rank_heartbeat_timeout",
    "rank_out_of_section_timeout",
)
SECTION_TIMEOUTS_KEY = "rank_section_timeouts"

MAX_FRAME_BYTES = 64 * 1024
MAX_NAME_CHARS = 256  # section names, hosts, states, report kinds, tokens
MAX_TEXT_CHARS = 16_000  # free text: a report's or a diagnosis' message
MAX_SECTIONS = 4096  # names in a calc request or a section-timeouts object
MAX_TIMEOUT_S = 1e9  # ~30 years: any real timeout fits; inf and NaN never do
MAX_INT = 2**63 - 1  # iterations, request ids
MAX_ID = 2**31 - 1  # ranks, pids, cycles


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


# -- field validators ----------------------------------------------------------------------
# Each takes the decoded JSON value and returns the value to keep, or raises _Bad. They are
# closures built once; decode runs them on the hot path (a heartbeat has one field).


class _Bad(Exception):
    """Internal: a field value is invalid (the message names the expected form)."""


Validator = Callable[[Any], Any]


def _integer(lo: int, hi: int) -> Validator:
    def check(value: Any) -> int:
        # bool is an int subclass; a rank of True is still wrong.
        if type(value) is not int or not lo <= value <= hi:
            raise _Bad(f"an integer in [{lo}, {hi}]")
        return value
    return check


def _number(lo: float, hi: float) -> Validator:
    def check(value: Any) -> float:
        if type(value) not in (int, float) or not lo <= value <= hi:  # NaN fails both
            raise _Bad(f"a finite number in [{lo:g}, {hi:g}]")
        return float(value)
    return check


def _boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise _Bad("true or false")
    return value


def _utf8(value: str) -> str:
    # JSON escapes can spell lone surrogates ("\ud800"): such a str cannot be written to
    # a UTF-8 log or console, so it is rejected here rather than failing a writer later.
    try:
        value.encode()
    except UnicodeEncodeError:
        raise _Bad("valid Unicode text (no lone surrogates)") from None
    return value


def _text(max_chars: int) -> Validator:
    def check(value: Any) -> str:
        if type(value) is not str or len(value) > max_chars:
            raise _Bad(f"a string of at most {max_chars} characters")
        return _utf8(value)
    return check


def _name(value: Any) -> str:
    """A short identifier-like string: printable, no control characters."""
    if type(value) is not str or not 0 < len(value) <= MAX_NAME_CHARS:
        raise _Bad(f"a string of 1 to {MAX_NAME_CHARS} characters")
    if not value.isprintable():  # C0/C1 controls, escapes, line breaks
        raise _Bad("printable characters only")
    return _utf8(value)


def _choice(options: tuple[str, ...]) -> Validator:
    def check(value: Any) -> str:
        if type(value) is not str or value not in options:
            raise _Bad(f"one of {', '.join(options)}")
        return value
    return check


def _nullable(inner: Validator) -> Validator:
    def check(value: Any) -> Any:
        return None if value is None else inner(value)
    return check


def _either(*options: Validator) -> Validator:
    def check(value: Any) -> Any:
        for option in options:
            try:
                return option(value)
            except _Bad:
                continue
        raise _Bad("a value of another type")
    return check


def _names(value: Any) -> list[str]:
    if type(value) is not list or len(value) > MAX_SECTIONS:
        raise _Bad(f"a list of at most {MAX_SECTIONS} names")
    return [_name(v) for v in value]


_timeout = _nullable(_number(0.0, MAX_TIMEOUT_S))


def _timeouts(value: Any) -> dict[str, Any]:
    """A timeouts object: known keys only (others dropped), each None or seconds."""
    if type(value) is not dict:
        raise _Bad("an object of timeouts")
    out: dict[str, Any] = {}
    for key in TIMEOUT_KEYS:
        if key in value:
            out[key] = _timeout(value[key])
    sections = value.get(SECTION_TIMEOUTS_KEY)
    if sections is not None:
        if type(sections) is not dict or len(sections) > MAX_SECTIONS:
            raise _Bad(f"{SECTION_TIMEOUTS_KEY}: an object of at most {MAX_SECTIONS} sections")
        out[SECTION_TIMEOUTS_KEY] = {_name(k): _timeout(v) for k, v in sections.items()}
    return out


_ID = _integer(0, MAX_ID)
_REQ = _integer(0, MAX_INT)
_ITERATION = _integer(-1, MAX_INT)
_STAMP_MAX = 1e12
_STAMP = _number(0.0, _STAMP_MAX)  # a monotonic clock reading, in seconds
_DEVICE_S = _number(0.0, 7 * 24 * 3600.0)  # a section's device time: a week is garbage
_EXIT_CODE = _nullable(_integer(-255, 255))
_OPT_NAME = _nullable(_name)
_DEVICE = _nullable(_either(_name, _integer(-1, MAX_ID)))

_STAMPED_KINDS = frozenset((HEARTBEAT, SECTION_OPEN, SECTION_CLOSE))  # see _decode_stamped

# Per kind: field -> (validator, required). Nothing else survives decoding.
_SCHEMA: dict[str, dict[str, tuple[Validator, bool]]] = {
    HELLO: {
        "token": (_text(MAX_NAME_CHARS), True),
        "rank": (_ID, True),
        "local_rank": (_ID, True),
        "pid": (_integer(1, MAX_ID), True),
        "host": (_name, True),
        "cycle": (_ID, True),
    },
    CONFIG: {
        "ok": (_boolean, True),
        "error": (_nullable(_text(MAX_TEXT_CHARS)), False),
        "timeouts": (_timeouts, False),
        "calculated": (_nullable(_names), False),
        "stack_signal": (_nullable(_integer(1, 64)), False),
    },
    HEARTBEAT: {"folds": (_boolean, False), "t": (_STAMP, False)},
    SECTION_OPEN: {"name": (_name, True), "t": (_STAMP, False)},
    SECTION_CLOSE: {"name": (_name, True), "t": (_STAMP, False), "dev": (_DEVICE_S, False)},
    SECTION_CLOSE_ALL: {"t": (_STAMP, False)},
    CALCULATE: {
        "req": (_REQ, True),
        "what": (_choice(CALCULATIONS), True),
        "sections": (_nullable(_names), False),
        "out_of_section": (_boolean, False),
        "skip_if_not_ready": (_boolean, False),
    },
    SET_TIMEOUTS: {"req": (_REQ, True), "timeouts": (_timeouts, True)},
    ACK: {
        "req": (_REQ, True),
        "ok": (_boolean, True),
        "error": (_nullable(_text(MAX_TEXT_CHARS)), False),
        "timeouts": (_timeouts, False),
        "calculated": (_nullable(_names), False),
    },
    CONTROL: {"action": (_choice(CONTROL_ACTIONS), True),
              "description": (_nullable(_text(MAX_TEXT_CHARS)), False)},
    DIAGNOSIS: {
        "state": (_name, True),
        "iteration": (_nullable(_ITERATION), True),
        "diagnostic": (_OPT_NAME, False),
        "message": (_nullable(_text(MAX_TEXT_CHARS)), False),
        "exit_code": (_EXIT_CODE, False),
        "fatal": (_boolean, False),
        "host": (_OPT_NAME, False),
        "device": (_DEVICE, False),
        "suspicious_host": (_OPT_NAME, False),
        "suspicious_device": (_DEVICE, False),
    },
    REPORT: {"what": (_name, True), "message": (_text(MAX_TEXT_CHARS), True)},
    PROGRESS: {"it": (_ITERATION, True), "ckpt": (_boolean, True), "t": (_STAMP, False)},
    GOODBYE: {},
    FENCE: {"req": (_REQ, True), "stopped_s": (_number(0.0, MAX_TIMEOUT_S), True)},
}


def fields_of(kind: str) -> frozenset[str]:
    """The fields a decoded message of ``kind`` may carry (besides ``v`` and ``k``)."""
    return frozenset(_SCHEMA[kind])


def encode(kind: str, **fields: Any) -> bytes:
    """Encode one message; raises ProtocolError for an unknown kind, a value JSON cannot
    hold, or a NaN/infinite number (the receiver would reject it anyway)."""
    if kind not in _SCHEMA:
        raise ProtocolError(f"unknown message kind {kind!r}")
    try:
        text = json.dumps({"v": VERSION, "k": kind, **fields}, separators=(",", ":"),
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{kind}: cannot encode: {exc}") from None
    return text.encode()


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"frame holds {name}, which is not a finite number")


# One decoder for every frame (json.loads with options would build one per call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def decode(frame: bytes) -> dict[str, Any]:
    """Decode and validate one frame; raises ProtocolError (only) naming what is wrong."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame is {type(frame).__name__}, not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return _decode_stamped(frame) or _decode_json(frame)


# The hot frames (heartbeats, section opens and closes, several per step of every rank) are
# a fixed prefix and a stamp. The prefixes of such frames that once decoded in full are
# kept, in the encoder's canonical form, with the message they start; a frame that is such
# a prefix, a plain JSON number and "}" is that message with that stamp, checked as the
# full decoder would check it, without the JSON decoder (a third of its cost). Anything
# else, a device time included, takes the full path.
_STAMP_KEY = b'"t":'
_JSON_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_STAMPED: dict[bytes, dict[str, Any]] = {}
MAX_STAMPED = 256  # prefixes kept (one per section name and kind); then they start again


def _stamped_prefix(kind: str, **fields: Any) -> bytes:
    """The canonical frame of a message up to its stamp's value."""
    return encode(kind, **fields)[:-1] + b"," + _STAMP_KEY


def _decode_stamped(frame: bytes) -> dict[str, Any] | None:
    """The message of a known prefix and a valid stamp, or None (then decode in full)."""
    frame = bytes(frame)  # no copy for bytes; a memoryview has no rfind
    at = frame.rfind(_STAMP_KEY)
    if at < 0 or not frame.endswith(b"}"):
        return None
    at += len(_STAMP_KEY)
    message = _STAMPED.get(frame[:at])
    if message is None or not _JSON_NUMBER.fullmatch(frame, at, len(frame) - 1):
        return None
    stamp = float(frame[at:-1])
    if not 0.0 <= stamp <= _STAMP_MAX:
        return None  # the full decoder names the fault
    return {**message, "t": stamp}


def _remember_stamped(msg: dict[str, Any]) -> None:
    if "dev" in msg or "t" not in msg:
        return
    if len(_STAMPED) >= MAX_STAMPED:  # names made up per step: the hot ones come back at once
        _STAMPED.clear()
    fields = {k: v for k, v in msg.items() if k not in ("v", "k", "t")}
    _STAMPED[_stamped_prefix(msg["k"], **fields)] = {"v": VERSION, "k": msg["k"], **fields}


def _decode_json(frame: bytes) -> dict[str, Any]:
    try:
        # Strict UTF-8 first: json.loads would also guess UTF-16 and UTF-32.
        msg = _DECODER.decode(bytes(frame).decode())
    except ProtocolError:
        raise
    except RecursionError:  # deeply nested brackets: the C scanner's depth guard
        raise ProtocolError("frame nests too deeply") from None
    except ValueError as exc:  # not UTF-8, not JSON, an integer of thousands of digits
        raise ProtocolError(f"frame is not JSON: {str(exc)[:200]}") from None
    if type(msg) is not dict:
        raise ProtocolError("frame is not a JSON object")
    version = msg.get("v")
    if type(version) is not int or version != VERSION:
        raise ProtocolError(f"protocol version {_short(version)}, expected {VERSION}")
    kind = msg.get("k")
    schema = _SCHEMA.get(kind) if type(kind) is str else None
    if schema is None:
        raise ProtocolError(f"unknown message kind {_short(kind)}")
    out: dict[str, Any] = {"v": VERSION, "k": kind}
    for field, (check, required) in schema.items():
        if field not in msg:
            if required:
                raise ProtocolError(f"{kind}: field {field!r} missing")
            continue
        try:
            out[field] = check(msg[field])
        except _Bad as exc:
            raise ProtocolError(f"{kind}: field {field!r} must be {exc}") from None
    if kind in _STAMPED_KINDS:
        _remember_stamped(out)
    return out


def _short(value: Any) -> str:
    """A bounded description of a value for an error message (never a huge repr)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge int"
    elif isinstance(value, str):
        text = repr(value[:40]) + ("..." if len(value) > 40 else "")
    else:
        text = type(value).__name__ if value is not None else "None"
    return text


# The monitor shares the node's monotonic clock (CLOCK_MONOTONIC is system-wide), so an
# activity message carries the time it happened: the monitor may then drain its socket in
# batches without skewing intervals or deadlines.
HEARTBEAT_FRAME = encode(HEARTBEAT)
_HEARTBEAT_PREFIX = _stamped_prefix(HEARTBEAT)
_FOLDING_PREFIX = _stamped_prefix(HEARTBEAT, folds=True)

# A training loop may heartbeat hundreds of times a second; each message costs the launcher
# a wake-up of its socket thread and a decode. So a rank folds a heartbeat that comes less
# than HEARTBEAT_FOLD_S after the last one it sent into that one, but only once it said so:
# the first such heartbeat is sent, with ``folds`` true, and so is every later one. The
# monitor then allows a folded, unseen last heartbeat for: a heartbeat deadline is
# HEARTBEAT_FOLD_S later for a rank whose last heartbeat said ``folds``. A rank that never
# beats that fast is judged exactly as before, and no verdict ever comes early.
HEARTBEAT_FOLD_S = 0.04


def heartbeat_frame(t: float, folds: bool = False) -> bytes:
    """A heartbeat stamped with monotonic time ``t`` (the hot path: no JSON encoder)."""
    return (_FOLDING_PREFIX if folds else _HEARTBEAT_PREFIX) + repr(t).encode() + b"}"


# Sections take the heartbeat's path: their frames are built once per name and kind, and
# each call only appends the stamp (the JSON encoder cost ~5x a heartbeat per section).


class SectionFrames:
    """Pre-encoded open and close frames of one section name (build with ``section_frames``)."""

    __slots__ = ("name", "_open", "_close")

    def __init__(self, name: str) -> None:
        self.name = name
        self._open = _stamped_prefix(SECTION_OPEN, name=name)
        self._close = _stamped_prefix(SECTION_CLOSE, name=name)

    def open(self, t: float) -> bytes:
        """``sec_open`` of this name at monotonic time ``t``."""
        return self._open + repr(t).encode() + b"}"

    def close(self, t: float, device_s: float | None = None) -> bytes:
        """``sec_close`` of this name at ``t``; ``device_s``: an earlier section's device
        time (left out when None, or when not a finite number the decoder would accept)."""
        if device_s is None or not 0.0 <= device_s <= 7 * 24 * 3600.0:  # NaN fails too
            return self._close + repr(t).encode() + b"}"
        return self._close + repr(t).encode() + b',"dev":' + repr(float(device_s)).encode() \
            + b"}"


def section_frames(name: str) -> SectionFrames:
    """The frames of section ``name``; raises ProtocolError when ``name`` is not a name the
    decoder accepts (so a bad name fails in the training's code, once, not silently)."""
    try:
        _name(name)
    except _Bad as exc:
        raise ProtocolError(f"section name {_short(name)} must be {exc}") from None
    return SectionFrames(name)
