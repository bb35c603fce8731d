"""What a cycle starts for each local rank of this node: its command, environment and log,
and the credentials its monitor connection must present. Nothing here starts anything."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ft_launcher.process.worker_env import CycleEnv, visible_gpus, worker_env
from ft_launcher.process.workers import WorkerSpec

if TYPE_CHECKING:
    from ft_launcher.config import LaunchConfig
    from ft_launcher.faults import ArmedFault
    from ft_launcher.nodes.rendezvous import RoundInfo
    from ft_launcher.policy import JobState
    from ft_launcher.rundir import RunDir

# (rank, its environment so far) -> the variables to add (peers and services).
ExtraEnv = Callable[[int, Mapping[str, str]], Mapping[str, str]]


@dataclass
class RankPlan:
    """What the cycle starts for one local rank: its spec, and its monitor credentials."""

    spec: WorkerSpec
    token: str
    stack_file: Path


def cycle_env(cfg: LaunchConfig, rundir: RunDir, job: JobState, endpoint: str, gpus: int,
              cycle: int, rnd: RoundInfo) -> CycleEnv:
    """What every local rank of this cycle shares in its environment."""
    return CycleEnv(
        world_size=rnd.group_world_size * cfg.nproc_per_node,
        nproc_per_node=cfg.nproc_per_node, group_rank=rnd.group_rank,
        group_world_size=rnd.group_world_size, role=cfg.role, master_addr=rnd.master_addr,
        master_port=rnd.master_port, restarts=job.restarts, max_restarts=cfg.max_restarts,
        run_id=cfg.run_id, endpoint=endpoint, run_dir=str(rundir.path),
        cycle=cycle, device_map=job.device_map(), virtual_local_rank=cfg.virtual_local_rank,
        gpus=visible_gpus(os.environ, gpus) if gpus else (),
    )


def plan_workers(cfg: LaunchConfig, rundir: RunDir, shared: CycleEnv,
                 armed: ArmedFault | None, extra_env: ExtraEnv) -> list[RankPlan]:
    """Each local rank's spec and credentials for this round (nothing is started)."""
    cycle = shared.cycle
    plans = []
    for local_rank in range(cfg.nproc_per_node):
        rank = shared.group_rank * cfg.nproc_per_node + local_rank
        # A token per rank and cycle: a hello can only claim the rank it was given to.
        token = secrets.token_hex(16)
        stack_file = rundir.private / f"stack_c{cycle}_r{rank}.raw"
        fault = armed.env_value() if armed is not None and armed.rank == rank \
            and armed.fault_type in ("rank_exit", "rank_slow") else None
        env = worker_env(
            os.environ, shared, local_rank, token=token, stack_file=str(stack_file),
            error_file=str(rundir.cycle_log_dir(cycle) / f"rank_{rank}_error.json"),
            simulated_fault=fault)
        env.update(extra_env(rank, env))
        echo = cfg.redirects.get(local_rank, 0) == 0 or cfg.tee.get(local_rank, 0) != 0
        if cfg.local_ranks_filter is not None and local_rank not in cfg.local_ranks_filter:
            echo = False
        spec = WorkerSpec(local_rank, rank, cfg.entrypoint + cfg.script_args, env,
                          rundir.rank_log(cycle, rank), echo)
        plans.append(RankPlan(spec, token, stack_file))
    return plans
