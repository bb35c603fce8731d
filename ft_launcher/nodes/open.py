"""Opening the launcher's own rendezvous from the options (``--rdzv-backend c10d|etcd``):
the timings, the place of the store, this node's address, the node side."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from ft_launcher.config import ConfigError, LaunchConfig
from ft_launcher.nodes.kv import StoreUnreachable
from ft_launcher.nodes.member import RoundRendezvous, node_id
from ft_launcher.nodes.rendezvous import (
    RendezvousError,
    RendezvousTimings,
    reachable_address,
)


def open_rendezvous(cfg: LaunchConfig, events: Callable[..., Any]) -> RoundRendezvous:
    """This node's side of the job's rendezvous; raises ConfigError on a bad option and
    RendezvousError when the store cannot be reached."""
    if not cfg.rdzv_endpoint:
        raise ConfigError(f"--rdzv-endpoint: required with --rdzv-backend {cfg.rdzv_backend}")
    timings, extra = RendezvousTimings.from_conf(cfg.rdzv_conf)
    host = socket.gethostname()
    me = node_id(host)
    local_addr = cfg.local_addr or reachable_address(
        cfg.rdzv_endpoint.split(",")[0].strip("[]"))
    try:
        place = make_place(cfg, timings, dict(extra), me, local_addr)
    except StoreUnreachable as exc:
        raise RendezvousError(f"--rdzv-endpoint {cfg.rdzv_endpoint}: cannot reach the "
                              f"{cfg.rdzv_backend} store ({exc})") from None
    return RoundRendezvous(place, cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes, timings,
                           cfg.master_port, local_addr, host, events, me=me)


def make_place(cfg: LaunchConfig, timings: RendezvousTimings, extra: dict[str, str],
               me: str, local_addr: str) -> Any:
    if cfg.rdzv_backend == "etcd":
        from ft_launcher.nodes.etcd_place import EtcdPlace

        return EtcdPlace(cfg.rdzv_endpoint, cfg.rdzv_id, timings, cfg.min_nodes,
                         cfg.max_nodes, extra, me, local_addr)
    from ft_launcher.nodes.place import C10dPlace

    return C10dPlace(cfg.rdzv_endpoint, cfg.rdzv_id, timings, cfg.min_nodes, cfg.max_nodes,
                     extra, me)
