"""Real training stacks under ft_launcher, each killed once mid-run and finishing with exit 0.

Scripts written for their stack, not for the launcher: a Hugging Face Trainer script
(examples/hf_trainer.py, unchanged and then with ft_agent's callback), a Lightning
``Trainer.fit`` with ft_agent.lightning's callback (examples/train_lightning.py), and a
torchrun DDP script that imports ft_agent only behind a flag it is not given, eager and
under torch.compile. The kill is the launcher's own ``--ft-simulated-fault``, except for the
compiled script, which the test kills once the zygote learned the compiler. Two CPU ranks
on gloo; the packages are the test extras' (transformers, accelerate, lightning).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from launch_helpers import (
    EXAMPLES,
    ROOT,
    events,
    finish,
    launcher_cmd,
    named,
    run_launcher,
    summary,
    wait_for,
)
from test_lightning import FAST_STOP, one, steps_logged
from test_lightning import TRAIN as LIGHTNING_SCRIPT
from torch_support import skip_below_torch_2_6

pytestmark = [pytest.mark.slow, pytest.mark.stacks, pytest.mark.timeout(180)]

HF_SCRIPT = str(EXAMPLES / "hf_trainer.py")
DDP_SCRIPT = str(Path(__file__).resolve().parent / "ddp_torchrun.py")
TWO_RANKS = ("--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP)
# 120 steps of at least 0.1 s (a sleep; about 0.15 s on 2 idle cores), a checkpoint every
# 10. The kill comes 10 s after the spawn or, once the callback said hello, after training
# started: past the imports (about 5 s here) and the first checkpoint, before the end even
# where a step costs nothing but its sleep.
HF_TRAINING = ("--max-steps", "120", "--save-steps", "10", "--step-time", "0.1")
KILL = "rank_killed:base_delay=10,rank=1"
# Steps a rank may redo after a kill, beyond the snapshot interval the ranks agreed on: the
# newest snapshot every rank has committed is the last grid point or the one before it; a
# busy machine delays the background commit, and a snapshot due during one is skipped.
MAX_REDONE = 5


def rank_log(run_dir: Path, cycle: int, rank: int) -> str:
    return (run_dir / "logs" / f"cycle_{cycle}" / f"rank_{rank}.log").read_text()


def hf_resumed_from(run_dir: Path, cycle: int, rank: int) -> str:
    """What examples/hf_trainer.py says it resumed from, once trained to the end."""
    found = re.search(r"trained to global_step (\d+) \(resumed from (.+)\)",
                      rank_log(run_dir, cycle, rank))
    assert found, rank_log(run_dir, cycle, rank)[-3000:]
    assert found.group(1) == "120"
    return found.group(2)


def killed_once(run_dir: Path, counted_from: str) -> dict:
    """The one fault: rank 1 SIGKILLed in cycle 0, one restart, exit 0."""
    evs = events(run_dir)
    fault = one(evs, "fault_injected")
    assert (fault["cycle"], fault["rank"], fault["fault_type"]) == (0, 1, "rank_killed")
    assert fault["counted_from"] == counted_from
    assert one(evs, "worker_exited", cycle=0, rank=1)["signal"] == "SIGKILL"
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["cycles"]) == (0, 1, 2)
    return fault


def test_hf_trainer_unchanged_resumes_from_its_disk_checkpoint(run_dir: Path):
    skip_below_torch_2_6("transformers")
    # The script never talks to the launcher: the fault counts from the spawn.
    proc = run_launcher(run_dir, *TWO_RANKS, "--ft-simulated-fault", KILL, HF_SCRIPT,
                        *HF_TRAINING, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:]
    killed_once(run_dir, "spawn")
    assert not named(events(run_dir), "rank_connected"), "nothing in the script says hello"
    resumed = {hf_resumed_from(run_dir, 1, rank) for rank in (0, 1)}
    assert len(resumed) == 1, resumed
    found = re.fullmatch(r".*/checkpoint-(\d+)", resumed.pop())
    assert found and int(found.group(1)) > 0 and int(found.group(1)) % 10 == 0


def test_hf_trainer_with_the_callback_resumes_from_a_snapshot(run_dir: Path):
    skip_below_torch_2_6("transformers")
    # Snapshots with the defaults: at the frequency the ranks agree on.
    proc = run_launcher(run_dir, *TWO_RANKS, "--ft-simulated-fault", KILL, HF_SCRIPT,
                        *HF_TRAINING, "--ft-callback", timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:]
    killed_once(run_dir, "training")
    evs = events(run_dir)
    picked = one(evs, "snapshot_picked", cycle=1)["iteration"]
    assert picked is not None, "the ranks held a common snapshot"
    saved = max(e["iteration"] for e in named(evs, "checkpoint_saved") if e["cycle"] == 0)
    # The newer of the two wins: a kill just after a checkpoint between two grid points
    # leaves the checkpoint newer, and then no rank reports the snapshot restored.
    step = max(picked, saved)
    restored = [e for e in named(evs, "snapshot_restored") if e["cycle"] == 1]
    assert {(e["rank"], e["iteration"]) for e in restored} == \
        ({(0, picked), (1, picked)} if picked > saved else set())
    last = max(e["iteration"] for e in named(evs, "last_progress") if e["cycle"] == 0)
    grid = [e for e in named(evs, "snapshot_frequency") if e["cycle"] == 0]
    assert grid, "the ranks agreed on a snapshot frequency"
    assert 0 <= last - picked <= grid[-1]["every"] + MAX_REDONE, (last, picked, grid)
    # Both ranks went on from that step, and the training ended where it should.
    firsts = [e for e in named(evs, "first_step") if e["cycle"] == 1]
    assert {(e["rank"], e["iteration"]) for e in firsts} == {(0, step + 1), (1, step + 1)}
    for rank in (0, 1):
        hf_resumed_from(run_dir, 1, rank)


def test_lightning_fit_with_the_callback_resumes_from_its_checkpoint(run_dir: Path):
    # As the HF runs: the callback's hello comes well before 10 s, and the kill 10 s after
    # training started, before the end of 120 steps of at least 0.1 s.
    proc = run_launcher(run_dir, *TWO_RANKS, "--ft-simulated-fault", KILL, LIGHTNING_SCRIPT,
                        "--max-steps", "120", "--ckpt-every", "10", "--val-every", "60",
                        "--step-time", "0.1", timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:]
    killed_once(run_dir, "training")
    resumed = steps_logged(run_dir, 1, 0, "train_start")
    assert resumed > 0 and resumed % 10 == 0
    assert steps_logged(run_dir, 1, 1, "train_start") == resumed
    assert steps_logged(run_dir, 1, 0, "train_end") == steps_logged(run_dir, 1, 1, "train_end") \
        == 120


def test_torchrun_script_with_ft_agent_behind_a_flag_is_killed_on_time(run_dir: Path):
    """The script's source imports ft_agent, behind --ft, which it is not given: nothing
    says hello, and the fault fires base_delay after the spawn, not after a wait for one."""
    proc = run_launcher(run_dir, *TWO_RANKS, "--ft-simulated-fault",
                        "rank_killed:base_delay=4,rank=1", DDP_SCRIPT, "--epochs", "16",
                        timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    fault = killed_once(run_dir, "spawn")
    evs = events(run_dir)
    spawned = one(evs, "workers_started", cycle=0)["ts"]
    assert 3.9 <= fault["at"] - spawned <= 5.5, fault["at"] - spawned
    assert not named(evs, "rank_connected")
    log = rank_log(run_dir, 1, 0)
    found = re.search(r"resuming from the checkpoint at epoch (\d+)", log)
    assert found and int(found.group(1)) > 0, log[-3000:]
    assert "trained 16 epochs" in log and "trained 16 epochs" in rank_log(run_dir, 1, 1)


@pytest.mark.timeout(480)  # a first compile on a busy machine: a minute or more
def test_a_compiled_torchrun_script_is_learned_killed_and_recovers(run_dir: Path):
    """The same torchrun script with its model under torch.compile (inductor, C++ kernels
    on CPU), the defaults otherwise. Rank 1 is SIGKILLed once the zygote learned what its
    workers imported for the compiler and did the compiler's first-use work (the CPU's
    vector instruction sets, the hash of torch's sources) and a checkpoint exists: the
    restart's workers are forks of that zygote, compile again from the compiler's caches,
    resume from the checkpoint and train to the end."""
    proc = subprocess.Popen(launcher_cmd(run_dir, *TWO_RANKS, DDP_SCRIPT, "--compile",
                                         "--epochs", "60"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    try:
        learned = wait_for(lambda: [e for e in named(events(run_dir), "preload_learned")
                                    if e["warmed"]], 150, "the compiler learned")[0]
        wait_for((run_dir / "ddp_checkpoint.pt").exists, 150, "the first checkpoint")
        victim = one(events(run_dir), "workers_started", cycle=0)["pids"][1]
        os.kill(victim, signal.SIGKILL)
        out = finish(proc, 150)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert learned["warmed"] == ["torch_key", "vector_isas"]
    assert "torch" in learned["modules"] and learned["count"] > 100
    assert one(events(run_dir), "worker_exited", cycle=0, rank=1)["signal"] == "SIGKILL"
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["cycles"]) == (0, 1, 2)
    assert one(events(run_dir), "workers_started", cycle=1)["warm"] == [True, True]
    log = rank_log(run_dir, 1, 0)
    found = re.search(r"resuming from the checkpoint at epoch (\d+)", log)
    assert found and int(found.group(1)) > 0, log[-3000:]
    assert "trained 60 epochs" in log and "trained 60 epochs" in rank_log(run_dir, 1, 1)
