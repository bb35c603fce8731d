"""Replicas of the ranks' snapshots on another node: a server each launcher runs, and the
client calls that push a local rank directory to a buddy and fetch it back.

``ReplicaServer(root, "tcp://host:port", token).start()`` serves a ZeroMQ ROUTER socket
from a background thread. A pushed slot is written into ``<root>/rank_<r>/`` in the store's
own format (``ft_agent.snapshot``): into a slot the world's plan does not keep
(``ReplicaServer.plan``, ``ft_agent.snapshot_retention``), whose memory is claimed first
in a background thread (the push is answered "busy: claiming memory" until then, and asks
again), its bytes first and its commit record last (write + rename), and only after every
byte passed the CRC32s of the sender's commit record; so a transfer cut at any point
leaves every kept replica whole and nothing unchecked is ever committed. A fetch streams
the newest copy (or a given iteration) back, checked again on the way out, and a copy that
fails is not offered again.

``push`` and ``fetch`` (client side) return a ``TransferResult``; they raise nothing: a
failure is a ``reason`` whose first word says what happened (timeout, refused, local,
checksum, mismatch, format, error). ``ReplicaSender`` runs pushes in a background thread
from a bounded queue so a launcher's loop never waits on the network.

Flow control is by credit: the receiver acknowledges each chunk and the sender keeps at
most ``window`` chunks unacknowledged, so neither side holds more than a few chunks; a
transfer that makes no progress for ``stall_timeout`` seconds is dropped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from ft_agent.snapshot import available_iterations, commit_file, open_dir
from ft_agent.snapshot_format import SnapshotError
from ft_agent.snapshot_retention import SLOTS, Plan
from ft_launcher.snapshots.replica_disk import (
    SlotReader,
    SlotWriter,
    claim,
    next_slot,
    rank_dir_name,
)
from ft_launcher.snapshots.replica_wire import (
    MAX_FRAME,
    MAX_HEADER,
    MAX_SLOT_BYTES,
    Message,
    SlotVerifier,
    WireError,
    decode,
    encode,
    finite_seconds,
)

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 8 * 2**20
DEFAULT_WINDOW = 4
DEFAULT_STALL_S = 10.0
MAX_TRANSFERS = 64
_TICK_MS = 50
# A push the server answers with this (it claims a fresh slot's memory first) is asked
# again after CLAIM_POLL_S, doubling up to half a second, within the push's timeout.
CLAIMING = "refused: busy: claiming memory"
CLAIM_POLL_S = 0.05

__all__ = ["Held", "ReplicaSender", "ReplicaServer", "TransferResult", "fetch", "held", "push"]


@dataclass(frozen=True)
class TransferResult:
    """How one push or fetch ended. ``skipped``: the buddy already held that iteration.
    ``reason`` (when not ``ok``) starts with one word: timeout, refused, local, checksum,
    mismatch, format, token, order or error."""

    op: str
    rank: int
    endpoint: str
    ok: bool
    iteration: int | None = None
    bytes: int = 0
    seconds: float = 0.0
    skipped: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class Held:
    """The iterations a replica server holds for a rank (checked headers), or why not known."""

    iterations: tuple[int, ...]
    reason: str | None = None


def _socket(ctx: zmq.Context, kind: int, window: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME + MAX_HEADER)
    sock.setsockopt(zmq.RCVHWM, 2 * window + 8)
    sock.setsockopt(zmq.SNDHWM, 2 * window + 8)
    return sock


# -- the server -------------------------------------------------------------------------------


@dataclass
class _Inbound:
    """A push being received."""

    rank: int
    iteration: int
    writer: SlotWriter
    verifier: SlotVerifier
    last: float


@dataclass
class _Outbound:
    """A fetch being sent."""

    rank: int
    reader: SlotReader
    verifier: SlotVerifier
    last: float
    sent: int = 0
    unacked: int = 0


class _PeerGone(Exception):
    """The peer's connection is gone (or full): drop its transfer without a reply."""


class ReplicaServer:
    """Holds other nodes' rank snapshots under ``root`` (created 0700; refused if it is not
    this uid's, not 0700, or a symlink) and serves them on ``bind`` (a ZeroMQ TCP endpoint;
    port 0 picks a free one, see ``endpoint``). ``token`` is the job's shared secret:
    messages without it are dropped."""

    def __init__(self, root: str | os.PathLike[str], bind: str, token: str, *,
                 stall_timeout: float = DEFAULT_STALL_S, chunk_bytes: int = DEFAULT_CHUNK,
                 window: int = DEFAULT_WINDOW, max_slot_bytes: int = MAX_SLOT_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not token:
            raise ValueError("a replica server needs a non-empty token")
        self.root = Path(root)
        os.close(open_dir(self.root, create=True))
        self.token = token
        self.stall_timeout = finite_seconds(stall_timeout, "stall_timeout")
        self.chunk_bytes, self.window, self.max_slot_bytes = chunk_bytes, window, max_slot_bytes
        self.clock = clock
        self.stats: Counter[str] = Counter()
        # The world's plan: which hosted copies a push must not overwrite (None: only the
        # newest). Set from the launcher's loop, read by the server's thread.
        self.plan: Plan | None = None
        self._claims: dict[tuple[int, str], threading.Thread] = {}  # (rank, slot) being claimed
        self._xfers: dict[bytes, _Inbound | _Outbound] = {}
        self._bad: set[tuple[int, str, int]] = set()  # (rank, slot, seq) that failed a check
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context(io_threads=1)
        self._sock = _socket(self._ctx, zmq.ROUTER, window)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._sock.bind(bind[:-2] + ":*" if bind.endswith(":0") else bind)
        except zmq.ZMQError:
            self._sock.close(0)
            self._ctx.term()
            raise
        self.endpoint: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def start(self) -> ReplicaServer:
        """Serve from a background thread (daemon, named ft-replica-server)."""
        self._thread = threading.Thread(target=self._run, name="ft-replica-server",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, drop the transfers in flight (their slots stay uncommitted) and
        release the socket, its context and every file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("replica server thread did not stop within %.1fs", timeout)
                return
        for ident in list(self._xfers):
            self._drop(ident, "server closing", reply=False)
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> ReplicaServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sock.poll(_TICK_MS, zmq.POLLIN):
                    for _ in range(64):  # then look at the clock again
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                self._expire()
            except Exception:  # noqa: BLE001 - the server outlives any one message
                log.exception("replica server: unexpected error; continuing")
                self.stats["internal_error"] += 1

    def _on_frames(self, frames: list[Any]) -> None:
        ident = frames[0].bytes
        try:
            msg = decode(frames[1:], self.token, self.max_slot_bytes)
        except WireError as e:
            self.stats[f"hostile_{e.reason}"] += 1
            log.debug("replica server: dropped a message: %s", e)
            if ident in self._xfers:
                self._drop(ident, f"{e.reason}: {e.detail}")
            return
        try:
            self._dispatch(ident, msg)
        except _PeerGone:
            self._drop(ident, "peer gone", reply=False)
        except (SnapshotError, WireError) as e:
            self._fail(ident, msg.rank, str(e)[:250])
        except OSError as e:
            self._fail(ident, msg.rank, f"io: {e}"[:250])
        except Exception as e:  # noqa: BLE001 - a bug here ends one transfer, not the server
            log.exception("replica server: unexpected error on rank %d's %s", msg.rank, msg.op)
            self.stats["internal_error"] += 1
            self._fail(ident, msg.rank, f"error: {type(e).__name__}"[:250])

    def _dispatch(self, ident: bytes, msg: Message) -> None:
        if msg.op == "push":
            self._begin_push(ident, msg)
        elif msg.op == "fetch":
            self._begin_fetch(ident, msg)
        elif msg.op == "list":
            iterations = self._held(msg.rank)
            self._send(ident, Message("held", msg.rank, iterations=tuple(iterations[-16:])))
        elif msg.op == "abort":
            self._drop(ident, "aborted by the peer", reply=False)
        elif msg.op in ("data", "commit", "ack"):
            xfer = self._xfers.get(ident)
            if xfer is None or xfer.rank != msg.rank:
                if msg.op != "ack":  # late acks of a finished fetch are normal
                    self._send(ident, Message("error", msg.rank, reason="order: no transfer"))
                return
            xfer.last = self.clock()
            self._step(ident, xfer, msg)
        else:
            self._send(ident, Message("error", msg.rank, reason=f"order: {msg.op} from a client"))

    def _step(self, ident: bytes, xfer: _Inbound | _Outbound, msg: Message) -> None:
        if isinstance(xfer, _Outbound):
            if msg.op != "ack":
                raise WireError("order", f"{msg.op} during a fetch")
            xfer.unacked = max(0, xfer.unacked - 1)
            self._pump(ident, xfer)
        elif msg.op == "data":
            if msg.offset != xfer.verifier.received:
                raise WireError("order", f"chunk at {msg.offset}, expected "
                                f"{xfer.verifier.received}")
            # credit first: the sender's next chunk travels while this one is checked
            self._send(ident, Message("ack", msg.rank, offset=msg.offset))
            xfer.verifier.feed(msg.payload)
            xfer.writer.write(msg.offset, msg.payload)
        elif msg.op == "commit":
            commit = xfer.writer.commit(xfer.verifier.finish(msg.payload))
            del self._xfers[ident]
            xfer.writer.close()
            self._claim_another(msg.rank, commit)
            self.stats["received"] += 1
            log.info("replica of rank %d iteration %d received (%d bytes, slot %s)",
                     msg.rank, commit.iteration, commit.file_bytes, commit.slot)
            self._send(ident, Message("done", msg.rank, iteration=commit.iteration))
        else:
            raise WireError("order", "ack during a push")

    # pushes into this server -----------------------------------------------------------

    def _rank_dir(self, rank: int) -> Path:
        return self.root / rank_dir_name(rank)

    def _held(self, rank: int) -> list[int]:
        return available_iterations(self._rank_dir(rank))

    def _claim(self, rank: int, slot: str, size: int) -> None:
        """Claim ``slot``'s memory for ``rank`` in a background thread (one at a time per
        slot)."""
        key = (rank, slot)
        running = self._claims.get(key)
        if running is not None and running.is_alive():
            return

        def run() -> None:
            try:
                claim(self._rank_dir(rank), slot, size)
            except (OSError, SnapshotError) as e:
                log.warning("replica of rank %d: cannot claim slot %s: %s", rank, slot, e)
        thread = threading.Thread(target=run, name=f"ft-replica-claim-{rank}{slot}",
                                  daemon=True)
        self._claims[key] = thread
        thread.start()

    def _claim_another(self, rank: int, commit: Any) -> None:
        """After a rank's first replica, a second slot's memory too (the next push would
        otherwise claim it, as the local store claims its second slot after its first
        commit)."""
        try:
            _, claimed = next_slot(self._rank_dir(rank), frozenset(), self.plan)
        except (OSError, SnapshotError):
            return
        ready = [s for s, n in claimed.items() if n >= commit.file_bytes]
        spare = [s for s in SLOTS if s not in ready and s != commit.slot]
        if len(ready) < 2 and spare:
            self._claim(rank, spare[0], commit.file_bytes)

    def _begin_push(self, ident: bytes, msg: Message) -> None:
        if ident in self._xfers:
            self._drop(ident, "the peer started over", reply=False)
        assert msg.iteration is not None and msg.size is not None
        if any(isinstance(x, _Inbound) and x.rank == msg.rank for x in self._xfers.values()):
            raise SnapshotError("busy", f"rank {msg.rank} is already being received")
        if len(self._xfers) >= MAX_TRANSFERS:
            raise SnapshotError("busy", f"{MAX_TRANSFERS} transfers in flight")
        if msg.iteration in self._held(msg.rank):
            self._send(ident, Message("have", msg.rank, iteration=msg.iteration))
            return
        reading = frozenset(x.reader.commit.slot for x in self._xfers.values()
                            if isinstance(x, _Outbound) and x.rank == msg.rank)
        slot, claimed = next_slot(self._rank_dir(msg.rank), reading, self.plan)
        if slot is not None and claimed.get(slot, 0) < msg.size:
            # Fresh memory first, in the background: this thread never waits for a claim,
            # and the transfer later writes into pages it already has.
            self._claim(msg.rank, slot, msg.size)
            raise SnapshotError("busy", f"claiming memory: {msg.size} bytes for rank "
                                f"{msg.rank}'s replica, first")
        writer = SlotWriter(self._rank_dir(msg.rank), reading, self.plan)
        self._xfers[ident] = _Inbound(msg.rank, msg.iteration, writer,
                                      SlotVerifier(msg.size, msg.iteration), self.clock())
        self._send(ident, Message("ready", msg.rank))

    # fetches from this server ----------------------------------------------------------

    def _begin_fetch(self, ident: bytes, msg: Message) -> None:
        if ident in self._xfers:
            self._drop(ident, "the peer started over", reply=False)
        if len(self._xfers) >= MAX_TRANSFERS:
            raise SnapshotError("busy", f"{MAX_TRANSFERS} transfers in flight")
        skip = frozenset((s, q) for r, s, q in self._bad if r == msg.rank)
        try:
            reader = SlotReader(self._rank_dir(msg.rank), msg.iteration, skip)
        except SnapshotError as e:
            if e.reason != "missing":
                raise
            raise SnapshotError("none", f"no replica of rank {msg.rank} here") from None
        c = reader.commit
        xfer = _Outbound(msg.rank, reader, SlotVerifier(reader.size, c.iteration), self.clock())
        self._xfers[ident] = xfer
        self._send(ident, Message("send", msg.rank, iteration=c.iteration, slot=c.slot,
                                  size=reader.size))
        self._pump(ident, xfer)

    def _pump(self, ident: bytes, xfer: _Outbound) -> None:
        """Send chunks while the fetcher has credit; after the last, the commit record if
        every byte matched it, else drop the copy from what this server offers."""
        size = xfer.reader.size
        while xfer.sent < size and xfer.unacked < self.window:
            data = xfer.reader.read(xfer.sent, self.chunk_bytes)
            xfer.verifier.feed(memoryview(data))
            self._send(ident, Message("data", xfer.rank, offset=xfer.sent, payload=data))
            xfer.sent += len(data)
            xfer.unacked += 1
        if xfer.sent < size:
            return
        c = xfer.reader.commit
        try:
            xfer.verifier.finish(xfer.reader.commit_bytes)
        except WireError as e:
            self._bad.add((xfer.rank, c.slot, c.seq))
            log.warning("replica of rank %d iteration %d (slot %s) failed its check: %s; "
                        "uncommitted", xfer.rank, c.iteration, c.slot, e)
            self._uncommit(xfer.rank, c.slot)
            raise WireError("checksum", f"replica of iteration {c.iteration} is corrupt "
                            f"({e.reason}); not offered again") from None
        self._send(ident, Message("commit", xfer.rank, payload=xfer.reader.commit_bytes))
        del self._xfers[ident]
        xfer.reader.close()
        self.stats["sent"] += 1

    def _uncommit(self, rank: int, slot: str) -> None:
        """Remove a corrupt slot's commit record: it is neither offered nor counted as held
        again, and the next push may overwrite it."""
        try:
            dir_fd = open_dir(self._rank_dir(rank))
        except SnapshotError:
            return
        try:
            os.unlink(commit_file(slot), dir_fd=dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)

    # transfers that end badly ------------------------------------------------------------

    def _send(self, ident: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([ident, *encode(msg, self.token)], zmq.NOBLOCK,
                                      copy=True)
        except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
            raise _PeerGone(str(e)) from None

    def _fail(self, ident: bytes, rank: int, reason: str) -> None:
        self._drop(ident, reason, reply=False)
        self.stats["refused"] += 1
        try:
            self._send(ident, Message("error", rank, reason=reason))
        except _PeerGone:
            pass

    def _drop(self, ident: bytes, reason: str, reply: bool = True) -> None:
        xfer = self._xfers.pop(ident, None)
        if xfer is None:
            return
        if isinstance(xfer, _Inbound):
            xfer.writer.close()
        else:
            xfer.reader.close()
        self.stats["dropped"] += 1
        log.warning("replica %s of rank %d dropped: %s",
                    "push" if isinstance(xfer, _Inbound) else "fetch", xfer.rank, reason)
        if reply:
            try:
                self._send(ident, Message("error", xfer.rank, reason=reason[:250]))
            except _PeerGone:
                pass

    def _expire(self) -> None:
        now = self.clock()
        for ident, xfer in list(self._xfers.items()):
            if now - xfer.last > self.stall_timeout:
                self.stats["stalled"] += 1
                self._drop(ident, f"stalled: no progress for {self.stall_timeout:g}s")


# -- the client ------------------------------------------------------------------------------


class _Fail(Exception):
    """A transfer that cannot go on; its message is the result's reason."""


class _Peer:
    """A DEALER socket to one server for one transfer, every wait bounded by ``timeout``."""

    def __init__(self, ctx: zmq.Context, endpoint: str, token: str, timeout: float,
                 window: int) -> None:
        self.endpoint, self.token = endpoint, token
        self.timeout_ms = int(finite_seconds(timeout, "timeout") * 1000)
        self.sock = _socket(ctx, zmq.DEALER, window)
        self.sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        if not self.sock.poll(self.timeout_ms, zmq.POLLOUT):
            raise _Fail(f"timeout: {self.endpoint} took nothing for "
                        f"{self.timeout_ms / 1000:g}s")
        self.sock.send_multipart(encode(msg, self.token), zmq.NOBLOCK,
                                 copy=True)

    def recv(self, rank: int, *ops: str) -> Message:
        if not self.sock.poll(self.timeout_ms, zmq.POLLIN):
            raise _Fail(f"timeout: no reply from {self.endpoint} in "
                        f"{self.timeout_ms / 1000:g}s")
        frames = self.sock.recv_multipart(copy=False)
        try:
            msg = decode(frames, self.token)
        except WireError as e:
            raise _Fail(f"{e.reason}: bad reply from {self.endpoint}: {e.detail}") from None
        if msg.op == "error":
            raise _Fail(f"refused: {msg.reason}")
        if msg.rank != rank or msg.op not in ops:
            raise _Fail(f"order: {msg.op} for rank {msg.rank} from {self.endpoint}, expected "
                        f"{'/'.join(ops)} for rank {rank}")
        return msg

    def close(self, abort_rank: int | None = None) -> None:
        if abort_rank is not None:
            try:  # best effort: spares the server its stall timeout
                self.sock.send_multipart(encode(Message("abort", abort_rank), self.token),
                                         zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.sock.close(0)


def _run(op: str, rank: int, endpoint: str, context: zmq.Context | None,
         body: Callable[[zmq.Context], TransferResult]) -> TransferResult:
    """``body`` with a context (the caller's, or one of its own), every failure as a
    result."""
    start = time.perf_counter()
    ctx = context or zmq.Context(io_threads=1)
    try:
        result = body(ctx)
    except _Fail as e:
        result = TransferResult(op, rank, endpoint, False, reason=str(e))
    except (SnapshotError, WireError) as e:
        result = TransferResult(op, rank, endpoint, False, reason=str(e))
    except OSError as e:
        result = TransferResult(op, rank, endpoint, False, reason=f"local: {e}")
    except Exception as e:  # noqa: BLE001 - a result, never an exception, for the caller
        log.exception("replica %s of rank %d: unexpected error", op, rank)
        result = TransferResult(op, rank, endpoint, False,
                                reason=f"error: {type(e).__name__}: {e}")
    finally:
        if context is None:
            ctx.term()
    seconds = time.perf_counter() - start
    return TransferResult(result.op, rank, endpoint, result.ok, result.iteration,
                          result.bytes, seconds, result.skipped, result.reason)


def push(rank_dir: str | os.PathLike[str], rank: int, endpoint: str, token: str, *,
         timeout: float = DEFAULT_STALL_S, chunk_bytes: int = DEFAULT_CHUNK,
         window: int = DEFAULT_WINDOW, context: zmq.Context | None = None) -> TransferResult:
    """Send the newest committed slot of ``rank_dir`` (a store directory) to the replica
    server at ``endpoint`` as rank ``rank``'s replica; skipped (ok) when the server already
    holds that iteration. When the server first claims the memory for it (a fresh slot), it
    is asked again until then. Blocks until done or until no progress for ``timeout``
    seconds; raises nothing."""
    deadline = time.monotonic() + timeout
    pause = CLAIM_POLL_S
    while True:
        result = _push_once(rank_dir, rank, endpoint, token, timeout, chunk_bytes, window,
                            context)
        if not (result.reason or "").startswith(CLAIMING) or time.monotonic() > deadline:
            return result
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


def _push_once(rank_dir: str | os.PathLike[str], rank: int, endpoint: str, token: str,
               timeout: float, chunk_bytes: int, window: int,
               context: zmq.Context | None) -> TransferResult:
    def body(ctx: zmq.Context) -> TransferResult:
        try:
            reader = SlotReader(rank_dir)
        except SnapshotError as e:
            raise _Fail(f"local: {e}") from None
        peer = _Peer(ctx, endpoint, token, timeout, window)
        ok = False
        try:
            result = _push(peer, reader, rank, chunk_bytes, window)
            ok = True
            return result
        finally:
            reader.close()
            peer.close(None if ok else rank)
    return _run("push", rank, endpoint, context, body)


def _push(peer: _Peer, reader: SlotReader, rank: int, chunk_bytes: int,
          window: int) -> TransferResult:
    c, size = reader.commit, reader.size
    peer.send(Message("push", rank, iteration=c.iteration, slot=c.slot, size=size))
    if peer.recv(rank, "ready", "have").op == "have":
        return TransferResult("push", rank, peer.endpoint, True, c.iteration, skipped=True)
    sent, unacked = 0, deque[int]()
    while sent < size or unacked:
        while sent < size and len(unacked) < window:
            data = reader.read(sent, chunk_bytes)
            peer.send(Message("data", rank, offset=sent, payload=data))
            unacked.append(sent)
            sent += len(data)
        ack = peer.recv(rank, "ack")
        if ack.offset != unacked.popleft():
            raise _Fail(f"order: ack of offset {ack.offset} out of turn")
    peer.send(Message("commit", rank, payload=reader.commit_bytes))
    done = peer.recv(rank, "done")
    return TransferResult("push", rank, peer.endpoint, True, done.iteration, size)


def fetch(endpoint: str, rank: int, dest_dir: str | os.PathLike[str], token: str,
          iteration: int | None = None, *, timeout: float = DEFAULT_STALL_S,
          window: int = DEFAULT_WINDOW, context: zmq.Context | None = None) -> TransferResult:
    """Get rank ``rank``'s newest replica (or ``iteration``'s) from the server at
    ``endpoint`` into the store directory ``dest_dir`` (created 0700), checked chunk by
    chunk against its commit record, which is written last; ``ft_agent.snapshot.load
    (dest_dir, result.iteration)`` then loads it. When the server finds its newest copy
    corrupt, the next older one is asked for once. Raises nothing."""
    def once(ctx: zmq.Context) -> TransferResult:
        peer = _Peer(ctx, endpoint, token, timeout, window)
        ok = False
        try:
            result = _fetch(peer, rank, dest_dir, iteration)
            ok = True
            return result
        finally:
            peer.close(None if ok else rank)
    result = _run("fetch", rank, endpoint, context, once)
    if not result.ok and iteration is None and (result.reason or "").startswith(
            "refused: checksum"):
        retry = _run("fetch", rank, endpoint, context, once)
        return TransferResult("fetch", rank, endpoint, retry.ok, retry.iteration, retry.bytes,
                              result.seconds + retry.seconds, False,
                              retry.reason if not retry.ok else None)
    return result


def _fetch(peer: _Peer, rank: int, dest_dir: str | os.PathLike[str],
           iteration: int | None) -> TransferResult:
    peer.send(Message("fetch", rank, iteration=iteration))
    head = peer.recv(rank, "send")
    assert head.iteration is not None and head.size is not None
    if iteration is not None and head.iteration != iteration:
        raise _Fail(f"mismatch: asked for iteration {iteration}, got {head.iteration}")
    verifier = SlotVerifier(head.size, head.iteration)
    writer = SlotWriter(dest_dir)
    try:
        while verifier.received < head.size:
            chunk = peer.recv(rank, "data")
            if chunk.offset != verifier.received:
                raise _Fail(f"order: chunk at {chunk.offset}, expected {verifier.received}")
            if verifier.received + len(chunk.payload) < head.size:
                peer.send(Message("ack", rank, offset=chunk.offset))  # credit first
            verifier.feed(chunk.payload)
            writer.write(chunk.offset, chunk.payload)
        commit = verifier.finish(peer.recv(rank, "commit").payload)
        writer.commit(commit)
    finally:
        writer.close()
    return TransferResult("fetch", rank, peer.endpoint, True, head.iteration, head.size)


def held(endpoint: str, rank: int, token: str, *, timeout: float = DEFAULT_STALL_S,
         context: zmq.Context | None = None) -> Held:
    """The iterations the server at ``endpoint`` holds for ``rank``; raises nothing."""
    out: list[Held] = []

    def body(ctx: zmq.Context) -> TransferResult:
        peer = _Peer(ctx, endpoint, token, timeout, 1)
        try:
            peer.send(Message("list", rank))
            out.append(Held(peer.recv(rank, "held").iterations))
        finally:
            peer.close()
        return TransferResult("list", rank, endpoint, True)
    result = _run("list", rank, endpoint, context, body)
    return out[0] if out else Held((), result.reason)


# -- pushing in the background -------------------------------------------------------------


class ReplicaSender:
    """Pushes rank directories to their buddies from one background thread, so the
    launcher's loop never waits on the network. ``submit`` never blocks: a rank already
    waiting has its request replaced by the newer one (one transfer per rank at a time),
    and at most ``max_pending`` ranks wait. Finished transfers are collected by ``results``
    (or passed to ``on_result`` from the sender's thread)."""

    def __init__(self, token: str, *, timeout: float = DEFAULT_STALL_S,
                 chunk_bytes: int = DEFAULT_CHUNK, window: int = DEFAULT_WINDOW,
                 max_pending: int = 64,
                 on_result: Callable[[TransferResult], None] | None = None) -> None:
        self.token, self.timeout = token, finite_seconds(timeout, "timeout")
        self.chunk_bytes, self.window, self.max_pending = chunk_bytes, window, max_pending
        self.on_result = on_result
        self._pending: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._busy: int | None = None
        self._done: deque[TransferResult] = deque(maxlen=1024)
        self._cond = threading.Condition()
        self._stop = False
        self._ctx = zmq.Context(io_threads=1)
        self._thread = threading.Thread(target=self._run, name="ft-replica-sender",
                                         daemon=True)
        self._thread.start()

    def submit(self, rank_dir: str | os.PathLike[str], rank: int, endpoint: str) -> bool:
        """Queue a push of ``rank_dir``'s newest slot; False when the queue is full or the
        sender is closed."""
        with self._cond:
            if self._stop or (rank not in self._pending and
                              len(self._pending) >= self.max_pending):
                return False
            self._pending[rank] = (os.fspath(rank_dir), endpoint)
            self._cond.notify()
            return True

    def results(self) -> list[TransferResult]:
        """The transfers finished since the last call, oldest first."""
        with self._cond:
            out = list(self._done)
            self._done.clear()
            return out

    def wait_idle(self, timeout: float) -> bool:
        """Whether every queued push finished within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and self._busy is None,
                                       timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Drop what is still queued, let the transfer in flight end (bounded by its own
        stall timeout), and release the thread and its sockets."""
        with self._cond:
            self._stop = True
            self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.term()

    def __enter__(self) -> ReplicaSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or bool(self._pending))
                if self._stop:
                    return
                rank, (rank_dir, endpoint) = self._pending.popitem(last=False)
                self._busy = rank
            result = push(rank_dir, rank, endpoint, self.token, timeout=self.timeout,
                          chunk_bytes=self.chunk_bytes, window=self.window, context=self._ctx)
            if result.ok:
                log.info("replica of rank %d iteration %s %s %s (%.2fs)", rank,
                         result.iteration, "already on" if result.skipped else "pushed to",
                         endpoint, result.seconds)
            else:
                log.warning("replica push of rank %d to %s failed: %s", rank, endpoint,
                            result.reason)
            with self._cond:
                self._done.append(result)
                self._busy = None
                self._cond.notify_all()
            if self.on_result is not None:
                try:
                    self.on_result(result)
                except Exception:  # noqa: BLE001 - a caller's callback must not end us
                    log.exception("replica sender: on_result raised")
