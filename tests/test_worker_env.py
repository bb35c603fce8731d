"""The worker environment as a pure function, device rotation included."""

from __future__ import annotations

import pytest

from ft_launcher.policy import JobState
from ft_launcher.process.worker_env import (
    CycleEnv,
    listed_gpus,
    rotated_gpus,
    visible_gpus,
    worker_env,
)


def _cycle(**kw) -> CycleEnv:
    base = dict(world_size=4, nproc_per_node=2, group_rank=1, group_world_size=2, role="default",
                master_addr="10.0.0.1", master_port=29500, restarts=3, max_restarts=5,
                run_id="job7", endpoint="ipc:///r/ipc/monitor.sock", run_dir="/r", cycle=4,
                device_map=(0, 1))
    return CycleEnv(**{**base, **kw})


def _env(base=None, cycle=None, local_rank=1, **kw):
    return worker_env(base or {"PATH": "/bin"}, cycle or _cycle(), local_rank, token="t" * 32,
                      error_file="/r/logs/e.json", stack_file="/r/ipc/s.raw", **kw)


def test_torchrun_variables_and_ours():
    env = _env()
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                                "TORCHELASTIC_RUN_ID", "FT_CYCLE", "FT_DEVICE_ID")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_RUN_ID": "job7",
        "FT_CYCLE": "4", "FT_DEVICE_ID": "1"}
    assert env["FT_TOKEN"] == "t" * 32 and env["FT_STACK_FILE"] == "/r/ipc/s.raw"
    assert env["PATH"] == "/bin" and "CUDA_VISIBLE_DEVICES" not in env


def test_user_settings_win_over_defaults_and_a_stale_fault_is_dropped():
    env = _env(base={"OMP_NUM_THREADS": "8", "PYTHONUNBUFFERED": "0",
                     "FT_SIMULATED_FAULT": "rank_exit:code=1,at=0"})
    assert env["OMP_NUM_THREADS"] == "8" and env["PYTHONUNBUFFERED"] == "0"
    assert "FT_SIMULATED_FAULT" not in env
    assert _env()["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in _env(cycle=_cycle(nproc_per_node=1), local_rank=0)
    assert _env(simulated_fault="rank_exit:code=16,at=5.0")["FT_SIMULATED_FAULT"] == \
        "rank_exit:code=16,at=5.0"


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_rotation_lands_every_rank_on_the_policy_device(gpus):
    """After each exit-16 rotation, cuda:LOCAL_RANK is the device the policy chose, every
    rank's visible list is a permutation of the node's GPUs, and no two ranks share one."""
    job = JobState(max_restarts=9, num_devices=gpus, nproc=gpus, host="n")
    names = [f"GPU-{i}" for i in range(gpus)]
    seen_maps = set()
    for _ in range(gpus):
        device_map = job.device_map()
        seen_maps.add(tuple(device_map))
        cycle = _cycle(nproc_per_node=gpus, group_rank=0, device_map=device_map, gpus=names)
        chosen = []
        for local_rank in range(gpus):
            visible = _env(cycle=cycle, local_rank=local_rank)["CUDA_VISIBLE_DEVICES"].split(",")
            assert sorted(visible) == sorted(names)
            chosen.append(visible[local_rank])
            assert visible[local_rank] == names[device_map[local_rank]]
        assert len(set(chosen)) == gpus
        job.rotation += 1
    assert len(seen_maps) == gpus  # every rotation moved each rank to another device


def test_rotation_keeps_the_users_gpu_names_and_uses_spare_devices():
    names = ["3", "5", "7", "9"]
    assert rotated_gpus(names, [2, 3], 0) == "7,3,5,9"
    assert rotated_gpus(names, [2, 3], 1) == "3,9,5,7"
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}, 8) == ["3", "5"]
    assert visible_gpus({}, 2) == ["0", "1"]
    # As CUDA reads the variable: an invalid entry hides itself and what follows.
    assert listed_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,3"}) == ["2"]
    assert listed_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert listed_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert listed_gpus({}) is None


def test_virtual_local_rank_gives_each_rank_its_own_device_as_device_0():
    """torchrun's --virtual-local-rank: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES the one device
    the rank is given (rotation kept); FT_LOCAL_RANK keeps the real one for ft_agent."""
    gpus = ("4", "5", "6", "7")
    cycle = _cycle(nproc_per_node=4, device_map=(1, 2, 3, 0), gpus=gpus, virtual_local_rank=True)
    envs = [_env(cycle=cycle, local_rank=r) for r in range(4)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0"] * 4
    assert [e["FT_LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["5", "6", "7", "4"]
    assert [e["FT_DEVICE_ID"] for e in envs] == ["1", "2", "3", "0"]
    assert envs[2]["RANK"] == str(1 * 4 + 2)  # global ranks unchanged


def test_virtual_local_rank_without_known_gpus_follows_torchrun():
    cycle = _cycle(virtual_local_rank=True)
    assert _env(cycle=cycle, local_rank=1)["CUDA_VISIBLE_DEVICES"] == "1"  # nothing restricts
    assert _env(base={"CUDA_VISIBLE_DEVICES": "2,3"}, cycle=cycle,
                local_rank=1)["CUDA_VISIBLE_DEVICES"] == "3"
    assert _env(base={"CUDA_VISIBLE_DEVICES": "-1"}, cycle=cycle,
                local_rank=1)["CUDA_VISIBLE_DEVICES"] == "-1"  # hidden stays hidden
    plain = _env()
    assert plain["LOCAL_RANK"] == "1" and "FT_LOCAL_RANK" not in plain
