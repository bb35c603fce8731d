"""Rendezvous: who this node is in the job, and where the workers' process group meets.

One node needs no rendezvous service and no torch import. Several nodes either use fixed
addresses (``static``) or torch's own c10d rendezvous, imported only then.

Every cycle gets a fresh master port for the workers' process group (unless the user fixed
one), so a new cycle never reads keys a previous cycle left in a store.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger("ft_launcher")


class RendezvousError(RuntimeError):
    """The rendezvous could not be formed (bad endpoint, timeout, closed)."""


@dataclass
class RoundInfo:
    """This node's place in one cycle."""

    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int


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

    def exit_barrier(self, wait: bool, timeout: float = 300.0) -> None:
        pass

    def shutdown(self) -> None:
        pass


class C10dRendezvous:
    """torch's dynamic c10d rendezvous (TCPStore) for several nodes."""

    MASTER_KEY = "ft_launcher/master"

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        conf: dict[str, str],
        fixed_port: int | None,
    ) -> None:
        if not endpoint:
            raise RendezvousError("--rdzv-endpoint: required with --rdzv-backend c10d")
        # The workers form their own store per cycle; the agent's shared one is not wanted.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        self.endpoint = endpoint
        self.fixed_port = fixed_port
        self._round: tuple[object, int] | None = None  # (store, group world size)
        self.local_addr = reachable_address(endpoint)
        try:
            params = RendezvousParameters(
                backend="c10d",
                endpoint=endpoint,
                run_id=run_id,
                min_nodes=min_nodes,
                max_nodes=max_nodes,
                local_addr=self.local_addr,
                **conf,
            )
            self.handler = get_rendezvous_handler(params)
        except (ValueError, RuntimeError, OSError) as exc:
            raise RendezvousError(f"--rdzv-endpoint {endpoint}: {exc}") from None

    def next_round(self) -> RoundInfo:
        try:
            info = self.handler.next_rendezvous()
        except Exception as exc:  # torch raises many kinds here; all mean "no round"
            raise RendezvousError(
                f"rendezvous at {self.endpoint} failed: {type(exc).__name__} {exc}"
            ) from None
        store = info.store  # prefixed per round by torch: no stale keys from a past round
        self._round = (store, info.world_size)
        if info.rank == 0:
            port = self.fixed_port or free_port("0.0.0.0")
            store.set(self.MASTER_KEY, f"{self.local_addr}:{port}")
        else:
            store.set_timeout(timedelta(seconds=300))
            value = store.get(self.MASTER_KEY).decode()
        if info.rank == 0:
            addr = self.local_addr
        else:
            addr, _, port_text = value.rpartition(":")
            port = int(port_text)
        return RoundInfo(info.rank, info.world_size, addr, port)

    def num_nodes_waiting(self) -> int:
        try:
            return self.handler.num_nodes_waiting()
        except Exception as exc:  # a vanished store must not crash the supervisor
            log.warning("rendezvous: cannot read waiting nodes: %s", exc)
            return 0

    def exit_barrier(self, wait: bool, timeout: float = 300.0) -> None:
        """Say this node is leaving; with ``wait``, also wait until every node of the round
        left, so a finished node does not close the rendezvous while another is still in
        it (that node's next_rendezvous would fail). A node that gives up only says so."""
        if self._round is None:
            return
        store, nodes = self._round
        key = "ft_launcher/exited"
        deadline = time.monotonic() + timeout
        try:
            done = store.add(key, 1)
            while wait and done < nodes and time.monotonic() < deadline:
                time.sleep(0.05)
                done = store.add(key, 0)
        except Exception as exc:  # the store's host may already be gone: nothing to wait for
            log.debug("exit barrier: %s", exc)
            return
        if wait and done < nodes:
            log.warning("exit barrier: %d of %d nodes finished after %.0f s", done, nodes,
                        timeout)

    def shutdown(self) -> None:
        try:
            self.handler.shutdown()
        except Exception as exc:  # best effort at exit
            log.debug("rendezvous shutdown: %s", exc)
