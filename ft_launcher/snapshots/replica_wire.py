"""The wire format of snapshot replicas between launchers (pure; no pickle, no I/O).

A message is one or two ZeroMQ frames: a JSON header (at most ``MAX_HEADER`` bytes) and, for
``data`` and ``commit``, a payload frame. Every header carries the wire version, the
operation, the job's token (hex, compared in constant time) and the rank; the other fields
depend on the operation (``FIELDS``). A transfer is the slot file's raw bytes in ``data``
chunks, in order, then the commit record (the store's own JSON) as the last message; the
receiver grants credit by acknowledging each chunk, so neither side buffers more than a
few chunks.

    push side: push -> ready | have | error;  data* (each -> ack);  commit -> done | error
    fetch side: fetch -> send | error;  data* (each acked by the fetcher);  commit
    list: list -> held

``decode`` checks every field against fixed bounds and raises nothing but ``WireError``;
``SlotVerifier`` checks a slot's bytes as they stream past against the header they start
with and the commit record they end with, so a receiver commits nothing it has not checked.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ft_agent.snapshot_format import (
    MAX_INT,
    PREFIX,
    Commit,
    Header,
    SnapshotError,
    crc32,
    parse_commit,
    parse_header,
    parse_prefix,
)
from ft_agent.snapshot_retention import SLOTS

WIRE_VERSION = 1
MAX_HEADER = 4096
MAX_TOKEN = 256
MAX_REASON = 300
MAX_RANK = 2**20
MAX_CHUNK = 16 * 2**20
MAX_COMMIT = 16 * 2**20  # a commit record of ~700k tensors
MAX_FRAME = max(MAX_CHUNK, MAX_COMMIT, MAX_HEADER)
MAX_SLOT_BYTES = 2**40
MAX_HELD = 16

# op -> the header fields it carries besides v, op, token and rank; and whether a payload
# frame follows.
FIELDS: dict[str, tuple[frozenset[str], bool]] = {
    "push": (frozenset({"iteration", "slot", "size"}), False),
    "fetch": (frozenset({"iteration"}), False),
    "list": (frozenset(), False),
    "abort": (frozenset(), False),
    "ready": (frozenset(), False),
    "have": (frozenset({"iteration"}), False),
    "send": (frozenset({"iteration", "slot", "size"}), False),
    "data": (frozenset({"offset"}), True),
    "ack": (frozenset({"offset"}), False),
    "commit": (frozenset(), True),
    "done": (frozenset({"iteration"}), False),
    "error": (frozenset({"reason"}), False),
    "held": (frozenset({"iterations"}), False),
}


class WireError(Exception):
    """A message or transfer that must be dropped; ``reason`` is one word (format, token,
    bounds, order, checksum, mismatch, truncated)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Message:
    """One decoded message; fields an operation does not carry are None."""

    op: str
    rank: int
    iteration: int | None = None
    slot: str | None = None
    size: int | None = None
    offset: int | None = None
    reason: str | None = None
    iterations: tuple[int, ...] = ()
    payload: Any = field(default=None, compare=False)


# -- encoding ------------------------------------------------------------------------------


def encode(msg: Message, token: str) -> list[Any]:
    """The frames of ``msg`` (the payload frame as given: bytes or a memoryview)."""
    fields, has_payload = FIELDS[msg.op]
    head: dict[str, Any] = {"v": WIRE_VERSION, "op": msg.op, "token": token, "rank": msg.rank}
    for name in fields:
        value = getattr(msg, name)
        head[name] = list(value) if name == "iterations" else value
    frames: list[Any] = [json.dumps(head, separators=(",", ":"), allow_nan=False).encode()]
    if has_payload:
        frames.append(msg.payload)
    return frames


# -- decoding (untrusted input) -------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise WireError("format", f"non-finite number {name}")


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise WireError("bounds", f"{what} is not an integer in [{lo}, {hi}]")
    return value


def _check_field(name: str, value: Any, max_size: int) -> Any:
    if name == "iteration":
        return None if value is None else _int(value, "iteration", -MAX_INT, MAX_INT)
    if name == "slot":
        if value not in SLOTS:
            raise WireError("format", "slot is not a or b")
        return value
    if name == "size":
        return _int(value, "size", PREFIX.size, max_size)
    if name == "offset":
        return _int(value, "offset", 0, max_size)
    if name == "reason":
        if not isinstance(value, str) or len(value) > MAX_REASON:
            raise WireError("format", "reason is not a short string")
        return value
    if not isinstance(value, list) or len(value) > MAX_HELD:  # iterations
        raise WireError("format", "iterations is not a short list")
    return tuple(_int(v, "iteration", -MAX_INT, MAX_INT) for v in value)


def _payload(frames: Sequence[Any], has_payload: bool, op: str) -> Any:
    if not has_payload:
        if len(frames) != 1:
            raise WireError("format", f"{op} carries no payload")
        return None
    if len(frames) != 2:
        raise WireError("format", f"{op} needs one payload frame")
    payload = memoryview(frames[1])
    bound = MAX_CHUNK if op == "data" else MAX_COMMIT
    if payload.nbytes > bound or (op == "data" and payload.nbytes == 0):
        raise WireError("bounds", f"{op} payload of {payload.nbytes} bytes")
    return payload.cast("B") if payload.ndim != 1 or payload.format != "B" else payload


def decode(frames: Sequence[Any], token: str, max_size: int = MAX_SLOT_BYTES) -> Message:
    """The message in ``frames`` after checking every field; raises ``WireError`` only (a
    wrong token is reason "token"). ``max_size`` bounds a slot's size and offsets."""
    try:
        return _decode(frames, token, max_size)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - the decoder's contract: one exception type
        raise WireError("format", f"undecodable ({type(e).__name__})") from None


def _decode(frames: Sequence[Any], token: str, max_size: int) -> Message:
    if not 1 <= len(frames) <= 2:
        raise WireError("format", f"{len(frames)} frames")
    head_bytes = bytes(memoryview(frames[0]))
    if len(head_bytes) > MAX_HEADER:
        raise WireError("bounds", f"header of {len(head_bytes)} bytes")
    try:
        head = json.loads(head_bytes.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("format", "header is not JSON") from None
    if not isinstance(head, dict) or head.get("v") != WIRE_VERSION:
        raise WireError("format", "not a version 1 replica message")
    op = head.get("op")
    if not isinstance(op, str) or op not in FIELDS:
        raise WireError("format", "unknown op")
    fields, has_payload = FIELDS[op]
    if set(head) != fields | {"v", "op", "token", "rank"}:
        raise WireError("format", f"{op}: fields are not {sorted(fields)}")
    given = head["token"]
    if not isinstance(given, str) or len(given) > MAX_TOKEN or not hmac.compare_digest(
            given.encode("utf-8", "replace"), token.encode()):
        raise WireError("token", "wrong job token")
    values = {name: _check_field(name, head[name], max_size) for name in fields}
    return Message(op=op, rank=_int(head["rank"], "rank", 0, MAX_RANK), **values,
                   payload=_payload(frames, has_payload, op))


# -- checking a slot as it streams past ---------------------------------------------------------


class SlotVerifier:
    """Checks a slot file's bytes, fed in order: the prefix and header as they complete,
    each tensor's CRC32 as its bytes pass, and, at ``finish``, all of it against the commit
    record. Raises ``WireError`` only."""

    def __init__(self, size: int, iteration: int) -> None:
        self.size = size
        self.iteration = iteration
        self.received = 0
        self._head = bytearray()
        self._head_len: int | None = None
        self._header: Header | None = None
        self._header_crc = 0
        self._crcs: list[int] = []
        self._next = 0  # the first tensor not wholly passed yet

    def feed(self, chunk: memoryview) -> None:
        """The next ``len(chunk)`` bytes of the slot file."""
        if self.received + len(chunk) > self.size:
            raise WireError("bounds", "more bytes than the slot's size")
        start = self.received
        self.received += len(chunk)
        if self._header is None:
            chunk, start = self._feed_head(chunk, start)
        if self._header is not None and len(chunk):
            self._feed_tensors(chunk, start)

    def _feed_head(self, chunk: memoryview, start: int) -> tuple[memoryview, int]:
        want = PREFIX.size if self._head_len is None else PREFIX.size + self._head_len
        take = min(len(chunk), want - len(self._head))
        self._head += chunk[:take]
        chunk, start = chunk[take:], start + take
        try:
            if self._head_len is None and len(self._head) == PREFIX.size:
                self._head_len = parse_prefix(bytes(self._head), self.size)
                return self._feed_head(chunk, start)
            if self._head_len is not None and len(self._head) == want:
                body = bytes(self._head[PREFIX.size:])
                self._header = parse_header(body, self.size)
                self._header_crc = crc32(body)
                self._crcs = [0] * len(self._header.tensors)
                self._head = bytearray()
        except SnapshotError as e:
            raise WireError(e.reason, e.detail) from None
        if self._header is not None and self._header.iteration != self.iteration:
            raise WireError("mismatch", f"slot holds iteration {self._header.iteration}, "
                            f"sent as {self.iteration}")
        return chunk, start

    def _feed_tensors(self, chunk: memoryview, start: int) -> None:
        assert self._header is not None
        specs, end = self._header.tensors, start + len(chunk)
        i = self._next
        while i < len(specs) and specs[i].offset < end:
            a = max(specs[i].offset, start)
            b = min(specs[i].offset + specs[i].nbytes, end)
            if b > a:
                self._crcs[i] = crc32(chunk[a - start:b - start], self._crcs[i])
            if specs[i].offset + specs[i].nbytes > end:
                break
            i += 1
        self._next = i

    def finish(self, commit_bytes: Any) -> Commit:
        """The commit record, once every byte has passed and it matches them all."""
        try:
            commit = parse_commit(bytes(commit_bytes))
        except SnapshotError as e:
            raise WireError("format", str(e)) from None
        except Exception as e:  # noqa: BLE001 - the decoder's contract: one exception type
            raise WireError("format", f"undecodable commit ({type(e).__name__})") from None
        if self.received != self.size or self._header is None:
            raise WireError("truncated", f"{self.received} of {self.size} bytes")
        h = self._header
        if (commit.file_bytes, commit.iteration) != (self.size, h.iteration) or len(
                commit.crcs) != len(h.tensors) or commit.tensor_bytes != sum(
                t.nbytes for t in h.tensors):
            raise WireError("mismatch", "commit record does not describe these bytes")
        if commit.header_crc != self._header_crc or tuple(self._crcs) != commit.crcs:
            raise WireError("checksum", "bytes do not match the commit record's CRC32s")
        return commit


def finite_seconds(value: float, what: str) -> float:
    """A positive, finite duration (for the timeouts callers pass in)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")
    return float(value)
