"""How this node joins a round: its health checks, the first cycle's standbys, the
rendezvous. A sick node, a stop signal or a rendezvous that is gone or closed ends the
cycle before it starts (a ``CycleResult``); otherwise ``join`` returns the round."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from ft_launcher.config import LaunchConfig
from ft_launcher.nodes.health import count_gpus, run_health_checks
from ft_launcher.nodes.rendezvous import (
    RendezvousClosed,
    RendezvousLost,
    RoundInfo,
    StaticRendezvous,
)
from ft_launcher.policy import CycleResult, Outcome
from ft_launcher.signals import SignalBox
from ft_launcher.warm.standby_pool import await_first_cycle

# The first cycle waits this long at most for the warm-restart zygote's forks (its import
# of torch takes seconds); ranks without a ready standby then start cold.
FIRST_CYCLE_WAIT_S = 60.0
STANDBY_POLL_S = 0.01  # standbys say they are ready on a pump thread: polled while waiting


def make_rendezvous(cfg: LaunchConfig, events: Callable[..., Any]) -> Any:
    """The rendezvous of ``--rdzv-backend``: fixed addresses (one node, ``static``), the
    launcher's own (``c10d``, ``etcd``), or torch's (``torch-c10d``, ``etcd-v2``). Each is
    imported only when chosen: one node imports no torch."""
    if cfg.rdzv_backend in ("c10d", "etcd"):
        from ft_launcher.nodes.open import open_rendezvous

        return open_rendezvous(cfg, events)
    if cfg.rdzv_backend in ("torch-c10d", "etcd-v2"):
        from ft_launcher.nodes.torch_rendezvous import DynamicRendezvous

        # events: spare_waiting / spare_admitted, emitted while next_round() waits.
        return DynamicRendezvous(cfg.rdzv_endpoint, cfg.rdzv_id, cfg.min_nodes,
                                 cfg.max_nodes, cfg.rdzv_conf, cfg.master_port,
                                 backend=cfg.rdzv_backend, events=events,
                                 local_addr=cfg.local_addr)
    return StaticRendezvous(cfg.node_rank, cfg.max_nodes, cfg.master_addr, cfg.master_port)


class Joiner:
    """What this node brings to a round (its health, its GPUs) and how it gets one."""

    def __init__(self, cfg: LaunchConfig, rdzv: Any, standbys: Any, signals: SignalBox,
                 events: Callable[..., Any], run_dir: Any,
                 gpus: Callable[[], int] | None = None) -> None:
        self.cfg, self.rdzv, self.standbys = cfg, rdzv, standbys
        self.signals, self.events, self.run_dir = signals, events, run_dir
        self.gpus = (gpus or count_gpus)()

    def join(self, cycle: int) -> RoundInfo | CycleResult:
        ft = self.cfg.ft
        health = run_health_checks(ft.health_checks, ft.health_check_timeout, self.run_dir,
                                   ft.min_free_space)
        if not health.ok:  # a sick node does not join: a spare takes its place
            for failure in health.failures:
                self.events("health_check_failed", **failure.event_fields())
            return CycleResult(cycle, Outcome.UNHEALTHY, reason=health.summary())
        signum = self.await_standbys(cycle)
        if signum is not None:
            self.events("signal_received", signal=signal.Signals(signum).name)
            return CycleResult(cycle, Outcome.SIGNALED, signum=signum)
        try:
            with self.signals.interruptible():
                rnd = self.rdzv.next_round()
        except RendezvousLost as exc:
            return CycleResult(cycle, Outcome.RENDEZVOUS_LOST, reason=str(exc))
        except RendezvousClosed as exc:
            return CycleResult(cycle, Outcome.RENDEZVOUS_CLOSED, reason=str(exc),
                               was_spare=exc.was_spare)
        world = rnd.group_world_size * self.cfg.nproc_per_node
        self.events("rendezvous_done", group_rank=rnd.group_rank, round=rnd.round,
                    group_world_size=rnd.group_world_size, world_size=world,
                    master_addr=rnd.master_addr, master_port=rnd.master_port,
                    left=list(rnd.left))
        return rnd

    def await_standbys(self, cycle: int) -> int | None:
        """Before the first cycle with warm restart: wait until the zygote forked a ready
        standby per local rank (``StandbyPool.first_cycle_waits``), at most
        ``FIRST_CYCLE_WAIT_S``. Returns a terminating signal that arrived meanwhile."""
        def pause() -> None:
            self.signals.pause(STANDBY_POLL_S)
            self.standbys.tick(True)

        wait = await_first_cycle(self.standbys.first_cycle_waits, pause,
                                 self.signals.terminating, FIRST_CYCLE_WAIT_S)
        if wait.timed_out:  # a fallback like the others: said once, in an event
            self.events("standbys_not_ready", waited_s=FIRST_CYCLE_WAIT_S)
        return wait.signum
