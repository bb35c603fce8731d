"""The job's rendezvous with etcd v3 (``--rdzv-backend etcd``): no single point of failure.

etcd holds only what must outlive any one launcher, under ``/ft_launcher/<rdzv-id>/``: which
launcher coordinates the job and where its round store listens (``coordinator``, a key held
by that launcher's lease), the latest round (``round``) and the job's end (``end``), and the
snapshot replicas' token (``job/``). The rounds themselves (keep-alives, tickets, notices)
run on a c10d store that the coordinator hosts, as with ``--rdzv-backend c10d``: so etcd
serves one lease keep-alive per interval whatever the job's size, and every launcher reaches
it only at start, when the coordinator changes, and at the end.

When the coordinator's launcher dies or freezes, its lease lapses (the keep-alive expiry,
rounded up to etcd's whole seconds), the key goes, and the launchers that re-join elect the
next one, which opens a round after the last. A frozen coordinator that thaws finds its
lease gone and sends its own node to re-join. When etcd itself stops answering for the
keep-alive expiry, the coordinator tells every node the store is lost (they end with
``RendezvousLost``: requeue, no node blamed).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

from ft_launcher.nodes.coordinator import CoordinatorLoop
from ft_launcher.nodes.kv import C10dKV, StoreUnreachable, connect, host_store
from ft_launcher.nodes.place import (
    END_KEY,
    ROUND_KEY,
    coordinator_for,
    job_end,
    raise_file_limit,
    request_timeout,
    start_pulse,
)
from ft_launcher.nodes.pulse import Pulse
from ft_launcher.nodes.records import CLOSED, START, STORE_LOST, TAKEOVER, Keys, Notice
from ft_launcher.nodes.rendezvous import RendezvousError, RendezvousLost, RendezvousTimings

log = logging.getLogger("ft_launcher")

COORDINATOR_KEY = "coordinator"
MAX_COORDINATOR_BYTES = 1024


def parse_coordinator(data: bytes | None) -> tuple[str, str, int] | None:
    """(node, addr, port) of the coordinator's record (untrusted), None while it has no
    address yet or when malformed."""
    if data is None or len(data) > MAX_COORDINATOR_BYTES:
        return None
    try:
        d = json.loads(data)
        node, addr, port = d["node"], d["addr"], d["port"]
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None
    if not (isinstance(node, str) and isinstance(addr, str) and isinstance(port, int)
            and 0 < port < 65536 and 0 < len(addr) <= 255):
        return None
    return node, addr, port


class EtcdJobStore:
    """The job's store for the services, in etcd (what a torch ``Store`` offers that they
    use: the snapshot replicas' token by ``compare_set`` from empty)."""

    def __init__(self, etcd: Any) -> None:
        self.etcd = etcd

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if expected != "":
            raise NotImplementedError("the job store only creates keys")
        return self.etcd.create(f"job/{key}", desired.encode())

    def get(self, key: str) -> bytes:
        value = self.etcd.get(f"job/{key}")
        if value is None:
            raise KeyError(key)
        return value

    def set(self, key: str, value: str | bytes) -> None:
        self.etcd.set(f"job/{key}", value.encode() if isinstance(value, str) else value)


class EtcdPlace:
    """Where the job's rounds run with etcd (see the module docstring)."""

    backend = "etcd"
    coordinator_replaceable = True

    def __init__(self, endpoint: str, run_id: str, timings: RendezvousTimings,
                 min_nodes: int, max_nodes: int, extra: dict[str, str], me: str,
                 local_addr: str = "127.0.0.1") -> None:
        import torch.distributed  # noqa: F401 - seconds to import: not while a lease runs

        from ft_launcher.nodes.kv_etcd import EtcdKV

        self.endpoint, self.timings, self.me = endpoint, timings, me
        self.min_nodes, self.max_nodes, self.local_addr = min_nodes, max_nodes, local_addr
        self.lost_grace_s = timings.dead_after
        self.etcd = EtcdKV.from_endpoint(endpoint, f"/ft_launcher/{run_id}/",
                                         max(5.0, 2 * timings.dead_after), extra)
        if extra:
            from ft_launcher.config import ConfigError

            raise ConfigError(f"--rdzv-conf: unknown key(s) for etcd: {', '.join(sorted(extra))}")
        self.epoch = 0
        self.stepped_down = False  # we coordinated, and no longer do: re-join elsewhere
        self.server: Any = None  # our round store, while we coordinate
        self.coordinator: CoordinatorLoop | None = None
        self._lease_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.pulse: Pulse | None = None
        self.main: C10dKV | None = None
        self._node: str | None = None
        self._services: Any = None
        self._store_addr: tuple[str, int] | None = None
        try:
            self._resolve()
        except StoreUnreachable as exc:
            raise RendezvousError(f"--rdzv-endpoint {endpoint}: no etcd member answers "
                                  f"({exc})") from None

    # -- finding the coordinator ---------------------------------------------------------

    def _resolve(self) -> None:
        """Connect to the coordinator's round store, electing this launcher when there is
        none; StoreUnreachable when etcd does not answer."""
        deadline = time.monotonic() + self.timings.join_timeout
        while time.monotonic() < deadline:
            if self._stop.is_set():
                raise StoreUnreachable("closed")
            held = self.etcd.get(COORDINATOR_KEY)
            if held is None:
                mine = json.dumps({"node": self.me, "addr": None, "port": None}).encode()
                won = self.etcd.campaign(COORDINATOR_KEY, mine, self.timings.dead_after) == mine
                if won and self._coordinate():
                    return
                continue
            place = parse_coordinator(held)
            if place is not None and self._connect(place[1], place[2]):
                return
            time.sleep(self.timings.keep_alive_interval)  # its lease lapses, or it publishes
        raise RendezvousError(f"no coordinator answered at {self.endpoint} within "
                              f"join_timeout {self.timings.join_timeout:g} s")

    def _connect(self, addr: str, port: int) -> bool:
        try:
            self._open_clients(addr, port)
        except StoreUnreachable as exc:
            log.info("rendezvous: the coordinator's store at %s:%d does not answer (%s)",
                     addr, port, exc)
            return False
        return True

    def _open_clients(self, addr: str, port: int) -> None:
        self._store_addr = (addr, port)
        self._services = None
        self.main = C10dKV(self._client())
        self.epoch += 1
        if self._node is not None:
            self._restart_pulse()

    def _client(self, connect_s: float | None = None) -> Any:
        """A client of the coordinator's round store: within ``connect_s`` to connect
        (default: the keep-alive expiry, past which a dead coordinator's lease lapses), each
        request within ``request_timeout``."""
        import torch.distributed as dist

        addr, port = self._store_addr  # type: ignore[misc]
        raw = connect(addr, port, connect_s or self.timings.dead_after)
        raw.set_timeout(timedelta(seconds=request_timeout(self.timings)))
        return dist.PrefixStore("ft_launcher", raw)

    def _coordinate(self) -> bool:
        """This launcher won the election: host the round store, open the round after the
        last one any coordinator opened, then publish where the store is (a launcher that
        finds it finds that round open). False when the lease lapsed before it was
        published (the election runs again)."""
        self.server = host_store(self.local_addr, 0, self.timings.dead_after)
        if self.server is None:
            self.etcd.resign()
            raise RendezvousError("cannot host the round store on this node")
        raise_file_limit()
        port = self.server.port
        self._store_addr = (self.local_addr, port)
        last = self.etcd.get(ROUND_KEY)
        first = 0 if last is None else _int(last) + 1
        kv = C10dKV(self._client(connect_s=request_timeout(self.timings)))  # our own store
        if self.etcd.get(END_KEY) is not None:
            kv.set(END_KEY, CLOSED.encode())
        coordinator = coordinator_for(
            self.timings, self.min_nodes, self.max_nodes, kv, first,
            START if last is None else TAKEOVER, f"coordinator-{self.me}",
            lambda g: self._on_round(kv, g))
        record = json.dumps({"node": self.me, "addr": self.local_addr, "port": port}).encode()
        if not (self.etcd.refresh() and self.etcd.set_held(COORDINATOR_KEY, record)):
            log.warning("rendezvous: the coordinator's lease lapsed before it was published")
            coordinator.stop()
            self.server = None
            return False
        self.coordinator = coordinator
        # The lease is kept from here: reconnecting this node's own clients may wait on its
        # old pulse for longer than the lease lives.
        self._lease_thread = threading.Thread(target=self._keep_lease, args=(kv,),
                                              name="ft-rdzv-lease", daemon=True)
        self._lease_thread.start()
        self._open_clients(self.local_addr, port)
        log.info("rendezvous: this launcher coordinates the job (round store %s:%d, from "
                 "round %d)", self.local_addr, port, first)
        return True

    def _on_round(self, kv: C10dKV, g: int) -> None:
        kv.set(ROUND_KEY, str(g).encode())
        try:
            self.etcd.set(ROUND_KEY, str(g).encode())
        except StoreUnreachable as exc:  # the lease thread decides whether etcd is gone
            log.warning("rendezvous: cannot record round %d in etcd: %s", g, exc)

    def _keep_lease(self, kv: C10dKV) -> None:
        """Refresh the coordinator's lease every interval. Lost (this launcher was stopped
        past it): step down, and the round's nodes re-join under the next coordinator.
        Every etcd member refusing connections for the keep-alive expiry, or none answering
        for the request timeout (room for an election: a new leader renews every lease):
        the job's store is lost for every node."""
        ok_at = time.monotonic()
        gone_s, silent_s = self.timings.dead_after, self.etcd.request_timeout_s
        while not self._stop.wait(self.timings.keep_alive_interval):
            # Given what is left of the expiry: the nodes must hear within the keep-alive
            # bound that the cluster is gone, not a whole request timeout later.
            left_s = max(self.timings.keep_alive_interval, ok_at + gone_s - time.monotonic())
            try:
                if self.etcd.refresh(left_s):
                    ok_at = time.monotonic()
                    continue
                self._step_down(kv, TAKEOVER, "its lease lapsed")
                return
            except StoreUnreachable as exc:
                quiet_s = time.monotonic() - ok_at
                if quiet_s >= (gone_s if exc.refused else silent_s):
                    self._step_down(kv, STORE_LOST, f"etcd does not answer ({exc})")
                    return

    def _step_down(self, kv: C10dKV, why: str, reason: str) -> None:
        log.warning("rendezvous: this launcher stops coordinating: %s", reason)
        coordinator, self.coordinator = self.coordinator, None
        self.stepped_down = True
        if coordinator is not None:
            coordinator.stop()
        try:
            if why == STORE_LOST:
                kv.set(END_KEY, STORE_LOST.encode())
            g = coordinator.core.round if coordinator is not None else 0
            kv.create(Keys.open(g + 1), Notice(g + 1, why, f"coordinator-{self.me}").encode())
        except StoreUnreachable as exc:
            log.warning("rendezvous: cannot tell the nodes: %s", exc)

    # -- what the node side uses ---------------------------------------------------------

    def start_pulse(self, node: str) -> None:
        self._node = node
        self._restart_pulse()

    def _restart_pulse(self) -> None:
        if self.pulse is not None:
            self.pulse.stop()
        self.pulse = start_pulse(C10dKV(self._client()), self._node, self.timings,
                                 self.endpoint)

    def refresh(self) -> None:
        """Before a join: a launcher that stopped coordinating finds the next coordinator."""
        if self.stepped_down:
            self.stepped_down = False
            self.reconnect(RuntimeError("stopped coordinating"))

    def reconnect(self, cause: BaseException) -> None:
        """The coordinator's store stopped answering: find (or become) the next one."""
        log.warning("rendezvous: the coordinator's store does not answer (%s); looking for "
                    "the next coordinator", cause)
        if self.coordinator is not None:  # ours: our own store failing is not recoverable
            raise RendezvousLost(self.backend, self.endpoint, cause)
        try:
            self._resolve()
        except StoreUnreachable as exc:
            raise RendezvousLost(self.backend, self.endpoint, exc) from None

    def services_store(self, prefix: str) -> Any:
        import torch.distributed as dist

        if self._services is None:
            self._services = self._client()
        return dist.PrefixStore(prefix, self._services)

    def job_store(self) -> EtcdJobStore:
        return EtcdJobStore(self.etcd)

    def latest_round(self) -> int:
        data = self.main.get(ROUND_KEY)
        return 0 if data is None else _int(data)

    def end(self) -> str | None:
        return job_end(self.main)

    def close_job(self) -> None:
        self.etcd.set(END_KEY, CLOSED.encode())
        self.main.set(END_KEY, CLOSED.encode())

    def close(self) -> None:
        self._stop.set()
        if self.pulse is not None:
            self.pulse.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
            try:  # the next coordinator need not wait for our lease to lapse
                self.etcd.resign()
            except StoreUnreachable:
                pass
        self.etcd.close()


def _int(data: bytes) -> int:
    try:
        return max(0, int(data)) if len(data) < 20 else 0
    except ValueError:
        return 0
