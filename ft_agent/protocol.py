"""Wire format between the in-process agent and the launcher's monitor.

Every message is one ZeroMQ frame holding a UTF-8 JSON object with a protocol version
``v`` and a kind ``k``. JSON rather than pickle: a frame from a stranger can at worst be
rejected, never execute code. The DEALER socket's routing id identifies the sender, so a
heartbeat carries nothing but its kind and costs one pre-encoded frame.

Kinds (agent -> monitor unless noted):

=================  ==================================================================
``hello``          token, rank, local_rank, pid, host, cycle, stack_signal
``config``         monitor -> agent reply to hello: ``ok``, ``error``, ``timeouts``
``hb``             heartbeat, fire-and-forget; ``t``: the sender's monotonic clock
``sec_open``       ``name``: a section starts (and ``t``, as for hb)
``sec_close``      ``name``: a section ends (and ``t``)
``sec_close_all``  every open section ends (and ``t``)
``calc``           ``req``, ``what`` ("hb" or "sections"), ``sections``: calculate timeouts
                   from what the monitor observed and put them in force
``set_timeouts``   ``req``, ``timeouts``: put given timeouts in force (load_state_dict)
``ack``            monitor -> agent reply to a request: ``req``, ``ok``, ``error``, ``timeouts``
``control``        ``action``: "continue", "exclude_node" or "shutdown"
``diagnosis``      a rerun state machine verdict: ``state``, ``diagnostic``, ``iteration``,
                   ``message``, ``exit_code`` and free extra fields
``report``         ``what``, ``message``: something the rank wants on record (an exception)
``progress``       ``it``: the training finished step ``it``; ``ckpt``: true when a
                   checkpoint of step ``it`` was saved (and ``t``, as for hb)
``goodbye``        the rank stops monitoring
=================  ==================================================================
"""

from __future__ import annotations

import json
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

CONTROL_ACTIONS = ("continue", "exclude_node", "shutdown")

# Required fields and their types per kind; extra fields are allowed (forward compatible).
_SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    HELLO: {
        "token": (str,),
        "rank": (int,),
        "local_rank": (int,),
        "pid": (int,),
        "host": (str,),
        "cycle": (int,),
    },
    CONFIG: {"ok": (bool,)},
    HEARTBEAT: {},
    SECTION_OPEN: {"name": (str,)},
    SECTION_CLOSE: {"name": (str,)},
    SECTION_CLOSE_ALL: {},
    CALCULATE: {"req": (int,), "what": (str,)},
    SET_TIMEOUTS: {"req": (int,), "timeouts": (dict,)},
    ACK: {"req": (int,), "ok": (bool,)},
    CONTROL: {"action": (str,)},
    DIAGNOSIS: {"state": (str,), "iteration": (int, type(None))},
    REPORT: {"what": (str,), "message": (str,)},
    PROGRESS: {"it": (int,), "ckpt": (bool,)},
    GOODBYE: {},
}

KINDS = frozenset(_SCHEMA)
MAX_FRAME_BYTES = 64 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def encode(kind: str, **fields: Any) -> bytes:
    """Encode one message; raises ProtocolError for an unknown kind."""
    if kind not in _SCHEMA:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return json.dumps({"v": VERSION, "k": kind, **fields}, separators=(",", ":")).encode()


def decode(frame: bytes) -> dict[str, Any]:
    """Decode and validate one frame; raises ProtocolError naming what is wrong."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r}, expected {VERSION}")
    kind = msg.get("k")
    schema = _SCHEMA.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    for field, types in schema.items():
        value = msg.get(field)
        # bool is an int subclass; a rank of True is still wrong.
        if field not in msg or not isinstance(value, types) or (
            isinstance(value, bool) and bool not in types
        ):
            raise ProtocolError(f"{kind}: field {field!r} missing or of wrong type")
    return msg


# The monitor shares the node's monotonic clock (CLOCK_MONOTONIC is system-wide), so an
# activity message carries the time it happened: the monitor may then drain its socket in
# batches without skewing intervals or deadlines.
HEARTBEAT_FRAME = encode(HEARTBEAT)
_HEARTBEAT_PREFIX = HEARTBEAT_FRAME[:-1] + b',"t":'


def heartbeat_frame(t: float) -> bytes:
    """A heartbeat stamped with monotonic time ``t`` (the hot path: no JSON encoder)."""
    return _HEARTBEAT_PREFIX + repr(t).encode() + b"}"
