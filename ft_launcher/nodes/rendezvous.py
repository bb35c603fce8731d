"""Rendezvous: who this node is in the job, and where the workers' process group meets.

What every backend shares: the round a node gets (``RoundInfo``), what it learns while its
workers run (``RoundView``, ``Standing``), the errors (``RendezvousLost``: the service is
gone; ``RendezvousClosed``: the other nodes ended the job), the timings
(``RendezvousTimings``, overridable with ``--rdzv-conf`` under torch's names), the
endpoint's parsing, and the rendezvous of one node or of fixed addresses
(``StaticRendezvous``: no service, no torch import).

Several nodes meet through the launcher's own rendezvous (``nodes.member``: ``c10d``, a
store hosted by one launcher, or ``etcd``), or through torch's (``nodes.torch_rendezvous``:
``torch-c10d``, ``etcd-v2``). ``join.make_rendezvous`` picks one. Every cycle gets a fresh
master port for the workers' process group (unless the user fixed one), so a new cycle never
reads keys a previous cycle left in a store.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ft_launcher.config import ConfigError

log = logging.getLogger("ft_launcher")

EventSink = Callable[..., Any]  # events(name, **fields), e.g. Supervisor.event
# What recording an event may raise. Not Exception: the supervisor's signal handler raises
# its own exception inside a blocking rendezvous, and that one must get through.
OBSERVER_ERRORS = (OSError, ValueError, TypeError, KeyError, AttributeError)
ETCD_DEFAULT_PORT = 2379


class RendezvousError(RuntimeError):
    """The rendezvous could not be formed (bad endpoint, timeout, closed)."""


class RendezvousLost(RendezvousError):
    """The rendezvous service cannot be reached any more: the host of the c10d store is
    gone, or no etcd member answers. Nothing this node can do brings it back; the job
    must be requeued (this node is not to blame)."""

    def __init__(self, backend: str, endpoint: str, cause: BaseException | str) -> None:
        self.backend = backend
        self.endpoint = endpoint
        if isinstance(cause, BaseException):
            inner = cause.__cause__ or cause  # torch wraps the socket's error in a generic one
            cause = f"{type(inner).__name__}: {inner}"
        self.cause = cause
        what = "c10d store" if "c10d" in backend else "etcd cluster"
        super().__init__(f"rendezvous lost: the {what} at {endpoint} is unreachable "
                         f"({self.cause.splitlines()[0] if self.cause else 'no answer'})")


class RendezvousClosed(RendezvousError):
    """The other nodes closed the job's rendezvous: the job is over. ``was_spare`` tells
    that this node waited as a hot spare and was never needed (a clean exit)."""

    def __init__(self, message: str, was_spare: bool) -> None:
        super().__init__(message)
        self.was_spare = was_spare


@dataclass
class RoundInfo:
    """This node's place in one cycle."""

    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    round: int = 0
    spare_wait_s: float | None = None  # set when this node waited as a hot spare first
    left: tuple[str, ...] = ()  # nodes of this node's previous round not in this one


@dataclass(frozen=True)
class RoundView:
    """What this node knows about its round while it trains (no request needed)."""

    waiting: int = 0  # nodes waiting to join (a restart brings them in); spares not counted
    lost: tuple[str, ...] = ()  # nodes of this round the others dropped (keep-alive lapsed)
    dropped: str | None = None  # why this node itself is out of its round; None: it is in
    why: str = ""  # why the next round opened (``records.WHYS``), when it did
    verdict: dict[str, Any] | None = None  # a hang verdict every node answers (``why`` hang)
    last_seen_s: float | None = None  # dropped: its last keep-alive, on the observer's clock


@dataclass(frozen=True)
class Standing:
    """Whether this node still belongs to the round it joined (read after a stall)."""

    current: bool
    reason: str = ""  # why not current, or why it could not be told
    known: bool = True  # False: the rendezvous did not answer; judged from the stall alone


@dataclass(frozen=True)
class RendezvousTimings:
    """Timings of the rendezvous (ours and torch's handler), chosen for fast failure
    detection.

    torch's defaults (keep-alive 5 s x 3, last call 30 s, a 1 s state poll) take 15 s to
    notice a dead node and 30 s more to close a round below the maximum size. Here a node
    is dead after ``keep_alive_interval x keep_alive_max_attempt`` = 2 s without a
    keep-alive, a round that reached its minimum closes after 1 s, and the coordinator looks
    at the keep-alives every ``poll_interval``. The price: a node that stalls longer than
    2 s (swapping, a stopped process) is dropped and rejoins. Ours judges a keep-alive on
    the coordinator's own monotonic clock; torch's handler compares wall-clock timestamps
    across nodes, so with it node clocks must agree to well under a second.
    """

    join_timeout: float = 600.0
    last_call_timeout: float = 1.0
    close_timeout: float = 5.0
    keep_alive_interval: float = 0.5
    keep_alive_max_attempt: int = 4
    heartbeat_timeout: float = 2.0
    read_timeout: float | None = None  # c10d: 60 s to connect; etcd: dead_after per request
    poll_interval: float = 0.1  # ft_launcher's own key: torch polls every 1 s

    @property
    def dead_after(self) -> float:
        """Seconds without a keep-alive after which the other nodes drop a node."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def stop_fence_s(self) -> float:
        """A stop of a node's processes this long may have cost it its place: its last
        keep-alive can be up to two intervals old when the stop began. Shorter stops (the
        rank_slow throttle stops a rank for milliseconds) cannot, and are not questioned."""
        return max(self.keep_alive_interval, self.dead_after - 2 * self.keep_alive_interval)

    @classmethod
    def from_conf(cls, conf: dict[str, str]) -> tuple[RendezvousTimings, dict[str, str]]:
        """Split ``--rdzv-conf`` into timings (validated) and the backend's other keys."""
        values: dict[str, Any] = {}
        rest = dict(conf)
        for f in dataclasses.fields(cls):
            if f.name not in rest:
                continue
            text = rest.pop(f.name)
            if f.name == "keep_alive_max_attempt":
                values[f.name] = _conf_int(f.name, text, minimum=3)
            else:
                values[f.name] = _conf_seconds(f.name, text)
        return cls(**values), rest


def _conf_seconds(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}: expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--rdzv-conf {key}: must be a positive number, got {text!r}")
    return value


def _conf_int(key: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}: expected an integer, got {text!r}") from None
    if value < minimum:
        # A keep-alive is sent when the last one is at least one interval old, so two can
        # be up to two intervals apart: fewer than 3 attempts drops live nodes.
        raise ConfigError(f"--rdzv-conf {key}: must be at least {minimum}, got {text!r}")
    return value


def parse_endpoints(endpoint: str, default_port: int) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` (``[v6]:port`` too) -> [(host, port)]; errors name the
    option."""
    out = []
    for part in endpoint.split(","):
        part = part.strip()
        host, port = part, default_port
        if part.startswith("["):
            host, _, tail = part[1:].partition("]")
            if tail:
                port = _endpoint_port(part, tail.removeprefix(":"))
        elif part.count(":") == 1:
            host, _, port_text = part.partition(":")
            port = _endpoint_port(part, port_text)
        if not host:
            raise ConfigError(f"--rdzv-endpoint: expected host:port[,host:port...], "
                              f"got {endpoint!r}")
        out.append((host, port))
    return out


def _endpoint_port(part: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"--rdzv-endpoint: bad port in {part!r}")
    return int(text)


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr != "localhost" else "127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(addr: str, port: int) -> None:
    """Raise RendezvousError naming the port when something listens on it already."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1" if addr in ("localhost", "127.0.0.1") else "", port))
    except OSError as exc:
        raise RendezvousError(f"--master-port {port}: port in use ({exc.strerror})") from None


def reachable_address(towards: str) -> str:
    """The local address that peers use to reach this node (the route towards a host)."""
    host = towards.split(":")[0] or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class StaticRendezvous:
    """One node (standalone), or several with fixed ranks and a fixed master."""

    def __init__(self, node_rank: int, nnodes: int, master_addr: str, master_port: int | None):
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.master_addr = master_addr
        self.master_port = master_port
        if master_port is not None and node_rank == 0:
            check_port_free(master_addr, master_port)

    def next_round(self) -> RoundInfo:
        port = self.master_port if self.master_port is not None else free_port(self.master_addr)
        return RoundInfo(self.node_rank, self.nnodes, self.master_addr, port)

    def num_nodes_waiting(self) -> int:
        return 0

    # Fixed ranks: no node is ever dropped, so no rank needs a stop fence, and nothing
    # about the other nodes needs polling while the workers run. No shared store: the
    # services that exchange facts between nodes (snapshots, stragglers) stay on the node.
    stop_fence_s: float | None = None
    polls_peers = False
    round_store: Any = None
    job_store: Any = None
    local_addr = "127.0.0.1"
    node_name = ""

    def poll_round(self) -> RoundView:
        return RoundView()

    def standing(self, stalled_s: float) -> Standing:
        return Standing(True)

    def mark_dropped(self) -> None:
        pass

    def verdict_channel(self, rnd: RoundInfo) -> None:
        return None  # no shared store: each node's verdict is its own

    def exit_barrier(self, wait: bool, timeout: float = 300.0) -> None:
        pass

    def shutdown(self, close: bool = True) -> None:
        pass
