"""The on-disk format of a rank's snapshot: pure encoding and bounded, validated decoding.

A slot file is a fixed prefix, a JSON header and the tensors' raw bytes:

    prefix  "FTSNAP\\r\\n", u16 version, u16 flags (0), u32 header length, u64 payload length
    header  UTF-8 JSON: iteration, byte order, the state's structure with tensor placeholders,
            and per tensor its dtype, shape, offset (from the file's start) and byte count
    payload each tensor's bytes, C order, at a 64-byte aligned offset, in header order

The commit record (JSON, a file of its own, written last and renamed into place) holds what
is only known after the bytes are written: the per-tensor CRC32 and "had non-finite" flag,
the header's CRC32, the slot file's size and a write sequence number.

Everything read back is untrusted (a writer killed mid-write, another job, a stale run):
the decoders here check every field against fixed bounds and the file's real size, accept
dtypes from an allow-list only, and raise nothing but ``SnapshotError``. No pickle: the
structure is JSON with tagged objects (see ``encode_tree``).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# zlib's CRC32, computed several times faster (SIMD; it releases the GIL like zlib): a
# snapshot's checksums are a pass over the whole state on the step's CPU.
from zlib_ng.zlib_ng import crc32  # noqa: F401 - this module's export

from ft_agent.snapshot_retention import SLOTS

if TYPE_CHECKING:
    import torch

MAGIC = b"FTSNAP\r\n"
VERSION = 1
PREFIX = struct.Struct("<8sHHIQ")
ALIGN = 64
COMMIT_KIND = "ft-snapshot-commit"

MAX_HEADER_BYTES = 64 * 2**20
HEADER_STEP = 4096
MAX_COMMIT_BYTES = 64 * 2**20
MAX_DEPTH = 64
MAX_TENSORS = 1_000_000
MAX_NDIM = 32
MAX_INT = 2**63 - 1

# The allowed dtypes and their element sizes, without importing torch: the launcher checks
# snapshots (``ft_agent.snapshot.verify``) in a process that never imports it.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (name -> torch dtype) and ``DTYPE_NAMES`` (its inverse), built on first
    use: importing this module does not import torch."""
    if name not in ("DTYPES", "DTYPE_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch  # noqa: PLC0415 - only where tensors are handled

    dtypes = {n: getattr(torch, n) for n in DTYPE_SIZES}
    globals().update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
    return globals()[name]

# One key per tagged node of the structure; lists are plain JSON lists and scalars are
# themselves, so no user value can be mistaken for a placeholder.
TAG_TENSOR, TAG_NDARRAY, TAG_BYTES, TAG_DICT, TAG_TUPLE, TAG_FLOAT = "t", "n", "b", "d", "u", "f"
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class SnapshotError(Exception):
    """A snapshot that cannot be written or must not be loaded; ``reason`` is one word
    (format, truncated, checksum, nonfinite, mismatch, missing, none, iteration, owner,
    mode, symlink, not_a_directory, not_a_file, io, unsupported)."""

    def __init__(self, reason: str, detail: str = "",
                 rejected: list[tuple[str, str]] | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.rejected = list(rejected or [])


@dataclass(frozen=True)
class Header:
    """A slot file's decoded header: the state's structure and where each tensor is."""

    iteration: int
    tree: Any
    tensors: tuple[TensorSpec, ...]
    header_len: int
    file_bytes: int


@dataclass(frozen=True)
class Commit:
    """The record that makes a slot loadable: written only after all its bytes are."""

    slot: str
    seq: int
    iteration: int
    file_bytes: int
    header_crc: int
    tensor_bytes: int
    crcs: tuple[int, ...]
    nonfinite: tuple[bool, ...]
    created: float


# -- encoding (the writer's side; inputs are the caller's own state) -------------------


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor's bytes are in the slot file, and how to read them back."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def encode_tree(value: Any, tensors: list[Any], path: str = "state", depth: int = 0) -> Any:
    """The JSON form of ``value``; tensors (and numpy arrays) are appended to ``tensors`` and
    replaced by their index. Raises ``SnapshotError('unsupported')`` naming the path."""
    if depth > MAX_DEPTH:
        raise SnapshotError("unsupported", f"{path}: nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -MAX_INT <= value <= MAX_INT:
            raise SnapshotError("unsupported", f"{path}: int out of the 64-bit range")
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {TAG_FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {TAG_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        tensors.append(value)
        return {TAG_TENSOR: len(tensors) - 1}
    if _is_ndarray(value):
        tensors.append(value)
        return {TAG_NDARRAY: len(tensors) - 1}
    if isinstance(value, list):
        return [encode_tree(v, tensors, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG_TUPLE: [encode_tree(v, tensors, f"{path}[{i}]", depth + 1)
                            for i, v in enumerate(value)]}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (str, int, float))) or (
                    isinstance(k, float) and not math.isfinite(k)):
                raise SnapshotError("unsupported", f"{path}: key {k!r} is not str/int/float/None")
            items.append([k, encode_tree(v, tensors, f"{path}[{k!r}]", depth + 1)])
        return {TAG_DICT: items}
    raise SnapshotError("unsupported", f"{path}: {type(value).__name__} (tensors, numpy arrays, "
                        "dict, list, tuple, str, int, float, bool, None and bytes only)")


def _is_ndarray(value: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def header_room(n: int) -> int:
    """The header's length once padded: ``n`` rounded up to a step of at least 4 KiB and
    an eighth of ``n``. The values beside the tensors (a step count, a growing log) change
    the header's length from one snapshot to the next; padded, the file's size stays the
    same, so the slot's memory, claimed at that size, is reused instead of claimed again
    (a snapshot skipped) each time."""
    step = max(HEADER_STEP, 1 << max(n.bit_length() - 3, 0))
    return -(-n // step) * step


def layout(iteration: int, tree: Any, specs: list[tuple[str, tuple[int, ...], int]]
           ) -> tuple[bytes, list[TensorSpec], int]:
    """The prefix + header bytes (the JSON padded with spaces to ``header_room``), each
    tensor's place and the file's total size, for tensors given as (dtype name, shape,
    nbytes)."""
    # The offsets depend on the header's length, which depends on the offsets' digits:
    # lay out again until the header's length settles (two passes, rarely three).
    header_len, placed, total = 0, [], 0
    for _ in range(8):
        start = align(PREFIX.size + header_len)
        placed, pos = [], start
        for dtype, shape, nbytes in specs:
            placed.append(TensorSpec(dtype, shape, pos, nbytes))
            pos = align(pos + nbytes)
        total = placed[-1].offset + placed[-1].nbytes if placed else start
        body = json.dumps({
            "iteration": iteration, "byteorder": "little", "tree": tree,
            "tensors": [[s.dtype, list(s.shape), s.offset, s.nbytes] for s in placed],
        }, separators=(",", ":"), allow_nan=False).encode()
        body += b" " * (header_room(len(body)) - len(body))
        if align(PREFIX.size + len(body)) == start:
            prefix = PREFIX.pack(MAGIC, VERSION, 0, len(body), total - PREFIX.size - len(body))
            return prefix + body, placed, total
        header_len = len(body)
    raise AssertionError("header layout did not settle")  # pragma: no cover


def encode_commit(c: Commit) -> bytes:
    return json.dumps({
        "kind": COMMIT_KIND, "version": VERSION, "slot": c.slot, "seq": c.seq,
        "iteration": c.iteration, "file_bytes": c.file_bytes, "header_crc": c.header_crc,
        "tensor_bytes": c.tensor_bytes,
        "tensors": [[crc, nf] for crc, nf in zip(c.crcs, c.nonfinite, strict=True)],
        "created": c.created,
    }, separators=(",", ":"), allow_nan=False).encode()


# -- decoding (untrusted input) -------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise SnapshotError("format", f"non-finite number {name} in JSON")


def parse_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except SnapshotError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SnapshotError("format", f"{what} is not valid JSON ({type(e).__name__})") from None


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise SnapshotError("format", f"{what} is not an integer in [{lo}, {hi}]")
    return value


def parse_commit(data: bytes) -> Commit:
    """A commit record's fields, each checked; raises ``SnapshotError`` only."""
    if len(data) > MAX_COMMIT_BYTES:
        raise SnapshotError("format", "commit record too large")
    obj = parse_json(data, "commit record")
    if not isinstance(obj, dict) or obj.get("kind") != COMMIT_KIND:
        raise SnapshotError("format", "not a snapshot commit record")
    if obj.get("version") != VERSION:
        raise SnapshotError("format", f"commit record version {obj.get('version')!r}")
    slot = obj.get("slot")
    if slot not in SLOTS:
        raise SnapshotError("format", f"commit record names no slot {'/'.join(SLOTS)}")
    rows = obj.get("tensors")
    if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
        raise SnapshotError("format", "commit record tensors is not a bounded list")
    crcs, nonfinite = [], []
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[1], bool)):
            raise SnapshotError("format", f"commit record tensor {i} is not [crc, flag]")
        crcs.append(_int(row[0], f"commit crc {i}", 0, 2**32 - 1))
        nonfinite.append(row[1])
    created = obj.get("created")
    if type(created) not in (int, float) or not math.isfinite(created):
        raise SnapshotError("format", "commit record created is not a finite number")
    return Commit(
        slot=slot, seq=_int(obj.get("seq"), "seq"),
        iteration=_int(obj.get("iteration"), "iteration", -MAX_INT),
        file_bytes=_int(obj.get("file_bytes"), "file_bytes"),
        header_crc=_int(obj.get("header_crc"), "header_crc", 0, 2**32 - 1),
        tensor_bytes=_int(obj.get("tensor_bytes"), "tensor_bytes"),
        crcs=tuple(crcs), nonfinite=tuple(nonfinite), created=float(created))


def parse_prefix(data: bytes, file_bytes: int) -> int:
    """The header's length, after checking magic, version and sizes against the file."""
    if len(data) < PREFIX.size:
        raise SnapshotError("truncated", f"{len(data)} bytes, shorter than the prefix")
    magic, version, flags, header_len, payload_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("format", "bad magic: not a snapshot slot file")
    if version != VERSION or flags != 0:
        raise SnapshotError("format", f"unsupported version {version} flags {flags}")
    if header_len > MAX_HEADER_BYTES:
        raise SnapshotError("format", f"header of {header_len} bytes is over the bound")
    if PREFIX.size + header_len + payload_len != file_bytes:
        raise SnapshotError("truncated", f"sizes in the prefix ({PREFIX.size}+{header_len}+"
                            f"{payload_len}) do not add up to the file's {file_bytes} bytes")
    return header_len


def parse_header(data: bytes, file_bytes: int) -> Header:
    """The header's fields, each tensor's place checked to lie in order inside the file."""
    obj = parse_json(data, "header")
    if not isinstance(obj, dict) or set(obj) != {"iteration", "byteorder", "tree", "tensors"}:
        raise SnapshotError("format", "header fields are not iteration/byteorder/tree/tensors")
    if obj["byteorder"] != sys.byteorder:
        raise SnapshotError("format", f"byte order {obj['byteorder']!r} is not this host's")
    rows = obj["tensors"]
    if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
        raise SnapshotError("format", "header tensors is not a bounded list")
    specs, pos = [], align(PREFIX.size + len(data))
    for i, row in enumerate(rows):
        specs.append(_tensor_spec(row, i, pos, file_bytes))
        pos = align(specs[-1].offset + specs[-1].nbytes)
    end = specs[-1].offset + specs[-1].nbytes if specs else align(PREFIX.size + len(data))
    if end != file_bytes:
        raise SnapshotError("truncated", f"tensors end at {end}, the file at {file_bytes}")
    tree = obj["tree"]
    _check_tree(tree, len(specs), [0] * len(specs), 0)
    return Header(_int(obj["iteration"], "iteration", -MAX_INT), tree, tuple(specs),
                  len(data), file_bytes)


def _tensor_spec(row: Any, i: int, pos: int, file_bytes: int) -> TensorSpec:
    if not (isinstance(row, list) and len(row) == 4):
        raise SnapshotError("format", f"tensor {i} is not [dtype, shape, offset, nbytes]")
    dtype, shape, offset, nbytes = row
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SnapshotError("format", f"tensor {i}: dtype {str(dtype)[:40]!r} not allowed")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise SnapshotError("format", f"tensor {i}: shape is not a list of <= {MAX_NDIM} dims")
    dims = tuple(_int(d, f"tensor {i} dim") for d in shape)
    offset = _int(offset, f"tensor {i} offset")
    nbytes = _int(nbytes, f"tensor {i} nbytes")
    if offset != pos:
        raise SnapshotError("format", f"tensor {i} at offset {offset}, expected {pos}")
    if offset + nbytes > file_bytes:
        raise SnapshotError("truncated", f"tensor {i} runs past the end of the file")
    numel = math.prod(dims)
    if numel * DTYPE_SIZES[dtype] != nbytes:
        raise SnapshotError("format", f"tensor {i}: {nbytes} bytes do not match its shape")
    return TensorSpec(dtype, dims, offset, nbytes)


def _check_tree(node: Any, n_tensors: int, used: list[int], depth: int) -> None:
    # The same count as encode_tree's: one level per list, tuple or dict.
    if depth > MAX_DEPTH:
        raise SnapshotError("format", "structure nested too deep")
    if node is None or isinstance(node, (bool, int, float, str)):
        return
    if isinstance(node, list):
        for v in node:
            _check_tree(v, n_tensors, used, depth + 1)
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise SnapshotError("format", "structure node is not a one-key tagged object")
    (tag, v), = node.items()
    if tag in (TAG_TENSOR, TAG_NDARRAY):
        idx = _int(v, "tensor reference", 0, n_tensors - 1)
        if used[idx]:
            raise SnapshotError("format", f"tensor {idx} referenced twice")
        used[idx] = 1
    elif tag == TAG_BYTES:
        if not isinstance(v, str):
            raise SnapshotError("format", "bytes node is not a string")
    elif tag == TAG_FLOAT:
        if not isinstance(v, str) or v not in _FLOATS:
            raise SnapshotError("format", "float node is not nan/inf/-inf")
    elif tag == TAG_TUPLE:
        if not isinstance(v, list):
            raise SnapshotError("format", "tuple node is not a list")
        for x in v:
            _check_tree(x, n_tensors, used, depth + 1)
    elif tag == TAG_DICT:
        if not isinstance(v, list):
            raise SnapshotError("format", "dict node is not a list of pairs")
        for pair in v:
            if not (isinstance(pair, list) and len(pair) == 2 and (
                    pair[0] is None or isinstance(pair[0], (str, int, float)))):
                raise SnapshotError("format", "dict entry is not [scalar key, value]")
            _check_tree(pair[1], n_tensors, used, depth + 1)
    else:
        raise SnapshotError("format", f"unknown structure tag {str(tag)[:20]!r}")


def decode_tree(node: Any, tensors: list[torch.Tensor]) -> Any:
    """The state from a structure already passed by ``parse_header``."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [decode_tree(v, tensors) for v in node]
    (tag, v), = node.items()
    if tag == TAG_TENSOR:
        return tensors[v]
    if tag == TAG_NDARRAY:
        return tensors[v].numpy()
    if tag == TAG_BYTES:
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise SnapshotError("format", "bytes node is not base64") from None
    if tag == TAG_FLOAT:
        return _FLOATS[v]
    if tag == TAG_TUPLE:
        return tuple(decode_tree(x, tensors) for x in v)
    return {k: decode_tree(x, tensors) for k, x in v}
