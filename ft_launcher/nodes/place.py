"""Where a job's rendezvous lives: the store each node talks to, and who coordinates.

``C10dPlace`` (``--rdzv-backend c10d``): a c10d ``TCPStore`` at ``--rdzv-endpoint``, hosted
by the launcher on that machine that binds the port first (torchrun's rule; ``is_host`` in
``--rdzv-conf`` decides it explicitly); that launcher also runs the coordinator. Its loss is
the store's loss: the others end with ``RendezvousLost`` (requeue, no node blamed).

Every node uses a few clients of its own (a c10d client serves one thread): the main
thread's, the pulse's, and one for the services' per-round and per-job stores.
"""

from __future__ import annotations

import logging
import resource
from typing import Any

from ft_launcher.config import ConfigError
from ft_launcher.nodes.coordinator import CoordinatorLoop
from ft_launcher.nodes.kv import C10dKV, StoreUnreachable, connect, host_store, local_addresses
from ft_launcher.nodes.pulse import Pulse
from ft_launcher.nodes.records import CLOSED, START, STORE_LOST, Keys, Notice
from ft_launcher.nodes.rendezvous import (
    RendezvousError,
    RendezvousLost,
    RendezvousTimings,
    parse_endpoints,
)
from ft_launcher.nodes.rounds import CloseRule, CoordinatorCore, KeepAliveBook

log = logging.getLogger("ft_launcher")
REQUEST_TIMEOUT_S = 10.0  # see request_timeout

C10D_DEFAULT_PORT = 29400  # torchrun's
ROUND_KEY = "round"  # the latest round opened, for launchers that arrive later
END_KEY = "end"  # the job is over: records.CLOSED, or records.STORE_LOST (etcd)


def parse_bool(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}: expected true or false, got {text!r}")


def raise_file_limit() -> None:
    """The store's host holds a few connections per node: lift the soft limit on open
    files to the hard one (a 1,000-node job needs about 3,000)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.debug("rendezvous: cannot raise the open-file limit: %s", exc)


def coordinator_for(timings: RendezvousTimings, min_nodes: int, max_nodes: int,
                    kv: C10dKV, first_round: int, why: str, me: str,
                    on_round: Any) -> CoordinatorLoop:
    """A coordinator that opens ``first_round`` (``why``) and runs from there."""
    kv.create(Keys.open(first_round), Notice(first_round, why, me).encode())
    on_round(first_round)
    core = CoordinatorCore(CloseRule(min_nodes, max_nodes, timings.last_call_timeout),
                           KeepAliveBook(timings.dead_after, timings.keep_alive_interval),
                           me, round=first_round)
    loop = CoordinatorLoop(kv, core, timings.keep_alive_interval, timings.poll_interval,
                           on_round)
    loop.start()
    return loop


class C10dPlace:
    """The job's rendezvous in one c10d store (see the module docstring)."""

    backend = "c10d"
    coordinator_replaceable = False
    lost_grace_s = 0.0  # a c10d client never reconnects: its first broken request is final
    epoch = 0  # the coordinator never changes

    def __init__(self, endpoint: str, run_id: str, timings: RendezvousTimings,
                 min_nodes: int, max_nodes: int, extra: dict[str, str], me: str) -> None:
        self.endpoint, self.timings = endpoint, timings
        self.prefix = f"ft_launcher/{run_id}"
        (self.host, self.port), *more = parse_endpoints(endpoint, C10D_DEFAULT_PORT)
        if more:
            raise ConfigError(f"--rdzv-endpoint {endpoint}: c10d takes one host:port")
        is_host = extra.pop("is_host", None)
        if extra:
            raise ConfigError(f"--rdzv-conf: unknown key(s) for c10d: {', '.join(sorted(extra))}")
        wants_host = parse_bool("is_host", is_host) if is_host is not None \
            else self.host in local_addresses()
        self.server = host_store(self.host, self.port, timings.dead_after) \
            if wants_host else None
        if wants_host and is_host is not None and self.server is None:
            raise RendezvousError(f"--rdzv-endpoint {endpoint}: is_host=true but port "
                                  f"{self.port} is taken")
        self._clients: list[Any] = []
        self._services: Any = None
        self.pulse: Pulse | None = None
        self.coordinator: CoordinatorLoop | None = None
        if self.server is not None:
            raise_file_limit()
            kv = C10dKV(self.client())
            first = self._latest(kv)
            self.coordinator = coordinator_for(
                timings, min_nodes, max_nodes, kv, first, START, f"coordinator-{me}",
                lambda g: kv.set(ROUND_KEY, str(g).encode()))
        self.main = self.round_kv()  # the main thread's client

    def client(self) -> Any:
        """A new client of the job's keys (one per thread that uses it): up to
        ``read_timeout`` (60 s) to connect, then ``request_timeout`` per request."""
        import torch.distributed as dist

        raw = connect(self.host, self.port, self.timings.read_timeout or 60.0)
        raw.set_timeout(_seconds(request_timeout(self.timings)))
        self._clients.append(raw)
        return dist.PrefixStore(self.prefix, raw)

    def round_kv(self) -> C10dKV:
        return C10dKV(self.client())

    def start_pulse(self, node: str) -> None:
        self.pulse = start_pulse(self.round_kv(), node, self.timings, self.endpoint)

    def refresh(self) -> None:
        pass  # the coordinator never changes

    def reconnect(self, cause: BaseException) -> None:
        raise RendezvousLost(self.backend, self.endpoint, cause)

    def _services_client(self) -> Any:
        if self._services is None:
            self._services = self.client()
        return self._services

    def services_store(self, prefix: str) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(prefix, self._services_client())

    def job_store(self) -> Any:
        return self.services_store("job")

    @staticmethod
    def _latest(kv: C10dKV) -> int:
        data = kv.get(ROUND_KEY)
        try:
            return int(data) if data is not None and len(data) < 20 else 0
        except ValueError:
            return 0

    def latest_round(self) -> int:
        return self._latest(self.main)

    def end(self) -> str | None:
        return job_end(self.main)

    def close_job(self) -> None:
        self.main.set(END_KEY, CLOSED.encode())

    def close(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
        self._clients.clear()


def job_end(kv: C10dKV) -> str | None:
    """How the job ended (``END_KEY``), None while it runs; junk reads as closed."""
    data = kv.get(END_KEY)
    if data is None:
        return None
    return STORE_LOST if data == STORE_LOST.encode() else CLOSED


def request_timeout(timings: RendezvousTimings) -> float:
    """How long a node waits for one answer of the store. A slow answer is a busy store (64
    launchers starting on 2 cores answer in seconds), not a lost one; a store whose host is
    gone fails at once, as its connections break; a frozen one is given up after this."""
    return max(timings.dead_after, REQUEST_TIMEOUT_S)


def start_pulse(kv: C10dKV, node: str, timings: RendezvousTimings, endpoint: str) -> Pulse:
    pulse = Pulse(kv, node, timings.keep_alive_interval)
    try:
        pulse.start()
    except StoreUnreachable as exc:
        raise RendezvousError(f"--rdzv-endpoint {endpoint}: the store does not answer "
                              f"({exc})") from None
    return pulse


def _seconds(s: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=s)


def serve_store(port: int, run_id: str, min_nodes: int, max_nodes: int,
                timings: RendezvousTimings | None = None) -> tuple[Any, CoordinatorLoop]:
    """Host the job's c10d store on ``port`` outside any launcher (every launcher then
    connects with ``is_host=false``), and coordinate its rounds from here: the store and
    the coordinator live as long as this process, whichever launcher leaves. Raises
    RendezvousError when the port is taken. Keep the returned objects alive."""
    import torch.distributed as dist

    timings = timings or RendezvousTimings()
    server = host_store("0.0.0.0", port, timings.dead_after)
    if server is None:
        raise RendezvousError(f"cannot host the store on port {port}: it is taken")
    raise_file_limit()
    client = connect("127.0.0.1", port, timings.read_timeout or 60.0)
    kv = C10dKV(dist.PrefixStore(f"ft_launcher/{run_id}", client))
    first = C10dPlace._latest(kv)
    loop = coordinator_for(timings, min_nodes, max_nodes, kv, first, START,
                           f"coordinator-store-{port}",
                           lambda g: kv.set(ROUND_KEY, str(g).encode()))
    return server, loop
