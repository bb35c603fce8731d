"""The environment of one worker: torchrun's variables plus ft_launcher's. Pure.

``worker_env`` is a function of the launcher's own environment, the cycle and the local
rank, so the rules (device rotation, defaults that yield to the user's settings) are unit
tested without starting anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvDoc:
    """Variables the launcher sets in a worker's environment, with what they hold: a row of
    docs/reference/environment.md (``python -m scripts.docs.render``). Each module that sets
    variables keeps its rows next to the code that sets them; ``tests/test_docs.py`` runs a
    real launch and fails when a worker gets a variable no row names, or a row names one no
    worker gets."""

    names: tuple[str, ...]
    value: str  # Markdown; a link is relative to docs/reference/


# What worker_env sets that torchrun sets too, so scripts written for torchrun run unchanged.
TORCHRUN_ENV = (
    EnvDoc(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
           "the rank's place in the world and on its node (`LOCAL_RANK` is `0` with "
           "`--virtual-local-rank`)"),
    EnvDoc(("GROUP_RANK", "GROUP_WORLD_SIZE"), "the node's place among the nodes"),
    EnvDoc(("ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"),
           "as torchrun sets them (one role, `--role`)"),
    EnvDoc(("MASTER_ADDR", "MASTER_PORT"),
           "the workers' process-group store; on one node with warm restart or "
           "`--ft-agent-store`, the cycle store's port "
           "([warm restart](../warm-restart.md#cycle-store))"),
    EnvDoc(("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"),
           "restarts so far, `--max-restarts`, the run id"),
    EnvDoc(("TORCHELASTIC_USE_AGENT_STORE",),
           "`True` when the store is hosted outside the ranks (the cycle store), else `False`"),
    EnvDoc(("TORCHELASTIC_ERROR_FILE",),
           "`RUN_DIR/logs/cycle_<n>/rank_<r>_error.json`: where torch's `@record` writes the "
           "rank's uncaught exception"),
    EnvDoc(("OMP_NUM_THREADS",), "`1` when unset and the node has several local ranks"),
    EnvDoc(("PYTHONUNBUFFERED",), "`1` when unset, so logs are complete when a rank dies"),
    EnvDoc(("CUDA_VISIBLE_DEVICES",),
           "the node's GPUs, ordered so that `cuda:LOCAL_RANK` is the rank's device, when GPUs "
           "exist (rotated after an exit 16); the rank's one device with "
           "`--virtual-local-rank`"),
)

# What worker_env sets for ft_agent.
LAUNCHER_ENV = (
    EnvDoc(("FT_ENDPOINT", "FT_TOKEN"),
           "the monitor's socket, and this rank's token for this cycle (a new one per rank "
           "and cycle)"),
    EnvDoc(("FT_RUN_DIR",), "the run directory"),
    EnvDoc(("FT_CYCLE",), "the restart cycle, from 0"),
    EnvDoc(("FT_DEVICE_ID",),
           "the device this rank runs on (rotated after an exit 16; on CPU a node has as "
           "many \"devices\" as local ranks)"),
    EnvDoc(("FT_LOCAL_RANK",),
           "with `--virtual-local-rank`: the real local rank (`LOCAL_RANK` is `0`)"),
    EnvDoc(("FT_STACK_FILE",), "where the agent writes the rank's stacks when asked"),
    EnvDoc(("FT_SIMULATED_FAULT",),
           "the fault, for a `rank_exit` or `rank_slow` victim "
           "([simulated faults](../simulated-faults.md))"),
)


@dataclass(frozen=True)
class CycleEnv:
    """What every local rank of one cycle shares."""

    world_size: int
    nproc_per_node: int
    group_rank: int
    group_world_size: int
    role: str
    master_addr: str
    master_port: int
    restarts: int
    max_restarts: int
    run_id: str
    endpoint: str
    run_dir: str
    cycle: int
    device_map: Sequence[int]  # device id per local rank (policy.JobState.device_map)
    gpus: Sequence[str] = ()  # the node's visible GPUs, in CUDA_VISIBLE_DEVICES order
    # torchrun's --virtual-local-rank: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES one device.
    virtual_local_rank: bool = False


def listed_gpus(env: Mapping[str, str]) -> list[str] | None:
    """The devices CUDA_VISIBLE_DEVICES lists; None when it is unset.

    As CUDA reads it: an invalid entry (such as ``-1``) hides itself and every entry after it.
    """
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    listed = []
    for entry in (d.strip() for d in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        listed.append(entry)
    return listed


def visible_gpus(env: Mapping[str, str], count: int) -> list[str]:
    """The GPUs this node may use: CUDA_VISIBLE_DEVICES when set, else 0..count-1."""
    listed = listed_gpus(env)
    return listed if listed is not None else [str(i) for i in range(count)]


def rotated_gpus(gpus: Sequence[str], device_map: Sequence[int], local_rank: int) -> str:
    """CUDA_VISIBLE_DEVICES for a rank such that index LOCAL_RANK is device_map's device.

    A script that uses ``cuda:LOCAL_RANK`` then lands on the rotated device with no change.
    """
    order = list(gpus)
    target = gpus[device_map[local_rank] % len(gpus)]
    order.remove(target)
    order.insert(min(local_rank, len(order)), target)
    return ",".join(order)


def worker_env(base: Mapping[str, str], cycle: CycleEnv, local_rank: int, *, token: str,
               error_file: str, stack_file: str, simulated_fault: str | None = None
               ) -> dict[str, str]:
    """The full environment for one local rank (``base`` is the launcher's environment)."""
    rank = cycle.group_rank * cycle.nproc_per_node + local_rank
    env = dict(base)
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(cycle.world_size),
        "LOCAL_WORLD_SIZE": str(cycle.nproc_per_node),
        "GROUP_RANK": str(cycle.group_rank),
        "GROUP_WORLD_SIZE": str(cycle.group_world_size),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(cycle.world_size),
        "ROLE_NAME": cycle.role,
        "MASTER_ADDR": cycle.master_addr,
        "MASTER_PORT": str(cycle.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(cycle.restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(cycle.max_restarts),
        "TORCHELASTIC_RUN_ID": cycle.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "FT_ENDPOINT": cycle.endpoint,
        "FT_TOKEN": token,
        "FT_RUN_DIR": cycle.run_dir,
        "FT_CYCLE": str(cycle.cycle),
        "FT_DEVICE_ID": str(cycle.device_map[local_rank]),
        "FT_STACK_FILE": stack_file,
    })
    env.pop("FT_SIMULATED_FAULT", None)
    if simulated_fault is not None:
        env["FT_SIMULATED_FAULT"] = simulated_fault
    if cycle.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")  # output reaches the log as it happens
    if cycle.virtual_local_rank:
        _virtual_local_rank(env, base, cycle, local_rank)
    elif cycle.gpus:
        env["CUDA_VISIBLE_DEVICES"] = rotated_gpus(cycle.gpus, cycle.device_map, local_rank)
    return env


def _virtual_local_rank(env: dict[str, str], base: Mapping[str, str], cycle: CycleEnv,
                        local_rank: int) -> None:
    """Every rank is local rank 0 of its own one device: the device it is given
    (device_map, rotation included), as torchrun's --virtual-local-rank. FT_LOCAL_RANK
    keeps the real local rank for ft_agent's hello."""
    env["LOCAL_RANK"] = "0"
    env["FT_LOCAL_RANK"] = str(local_rank)
    device = cycle.device_map[local_rank]
    pool = list(cycle.gpus) or listed_gpus(base)
    if pool is None:  # nothing restricts the devices: index = device (as torchrun)
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    elif pool:
        env["CUDA_VISIBLE_DEVICES"] = pool[device % len(pool)]
    # an empty pool (every device hidden) stays as the launcher's environment has it
