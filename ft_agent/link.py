"""The rank's connection to the launcher's monitor: one ZeroMQ DEALER socket.

Frames are sent without ever blocking (a full queue or a gone monitor drops them: the
training goes on); a request waits, at most ``REQUEST_TIMEOUT_S``, for its own answer.
Every call takes the link's lock, so the client may be used from several threads.
``zmq`` is imported when a link is made, not with this module.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ft_agent import protocol

log = logging.getLogger("ft_agent")

# How long a request (hello, timeout calculation) waits for the monitor before giving up.
REQUEST_TIMEOUT_S = 10.0
# Heartbeats queued while the monitor is unreachable; beyond this they are dropped.
SEND_HWM = 1000


class MonitorLink:
    """A connected DEALER socket; ``rank`` names this rank in log lines."""

    def __init__(self, sock: Any, rank: int) -> None:
        import zmq  # already imported by connect(): a dictionary lookup

        self.sock = sock
        self.rank = rank
        self.lock = threading.Lock()
        self._noblock = zmq.NOBLOCK
        self._zmq_error: type[Exception] = zmq.ZMQError
        self._req = 0

    @classmethod
    def connect(cls, endpoint: str, rank: int) -> MonitorLink:
        import zmq  # deferred so that importing ft_agent stays cheap

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.connect(endpoint)
        return cls(sock, rank)

    def send(self, frame: bytes) -> None:
        """Queue one frame. Never blocks, never raises."""
        with self.lock:
            self.send_locked(frame)

    def send_locked(self, frame: bytes) -> None:
        """``send`` for a caller that holds ``lock``."""
        try:
            self.sock.send(frame, self._noblock)
        except self._zmq_error:
            pass  # monitor gone or queue full: training must go on

    def hello(self, frame: bytes) -> dict[str, Any] | None:
        """Send the hello and wait for the monitor's config; None without an answer."""
        with self.lock:
            self.send_locked(frame)
            return self.wait_for({protocol.CONFIG}, None)

    def request(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """Send a request and wait for its ack; None when no answer came."""
        with self.lock:
            return self.request_locked(kind, **fields)

    def request_locked(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """``request`` for a caller that holds ``lock``."""
        self._req += 1
        req = self._req
        self.send_locked(protocol.encode(kind, req=req, **fields))
        return self.wait_for({protocol.ACK}, req)

    def wait_for(self, kinds: set[str], req: int | None) -> dict[str, Any] | None:
        """The next message of one of ``kinds`` (answering ``req`` when given), within
        ``REQUEST_TIMEOUT_S``; others and unreadable ones are skipped."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        remaining_ms = REQUEST_TIMEOUT_S * 1000
        while remaining_ms > 0:
            if not poller.poll(min(remaining_ms, 100)):
                remaining_ms -= 100
                continue
            try:
                msg = protocol.decode(self.sock.recv(zmq.NOBLOCK))
            except (zmq.ZMQError, protocol.ProtocolError) as exc:
                log.warning("rank %d: bad reply from monitor: %s", self.rank, exc)
                continue
            if msg["k"] in kinds and (req is None or msg.get("req") == req):
                return msg
        return None

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)


def ask_fence(link: MonitorLink, stopped_s: float) -> tuple[bool | None, str]:
    """The launcher's word after a stop of ``stopped_s``: (True, "") current, (False, why)
    stale, (None, why) no answer (see ``ft_agent.stop_fence``). Runs in the SIGCONT
    handler, on the main thread."""
    # The handler may have interrupted this very thread inside a request (holding the
    # lock): then there is no safe way to ask, and the rank exits as if stale (at worst
    # one restart of every node, never a stale write).
    if not link.lock.acquire(timeout=2.0):
        return None, "the agent's socket stayed busy"
    try:
        reply = link.request_locked(protocol.FENCE, stopped_s=round(stopped_s, 3))
    finally:
        link.lock.release()
    if reply is None:
        return None, f"the launcher did not answer within {REQUEST_TIMEOUT_S:.0f} s"
    return bool(reply["ok"]), reply.get("error") or ""
