"""scripts/slurm/ft_sbatch.sh against a real Slurm 22.05 (two slurmd on this machine).

Each job runs the real wrapper, the real ft_launcher and a tiny training script
(slurm_train.py). A requeue costs about 6 s (cred_expire=5 is Slurm's floor), so each
test requeues at most once.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import TRAIN, WRAPPER, SlurmJobs

LAUNCH = ("--nproc-per-node", "1", "--max-restarts", "0")


def train(jobs: SlurmJobs, mode: str, *extra: str) -> tuple[str, ...]:
    """Launcher options + the training script for one mode."""
    return (*LAUNCH, str(TRAIN), mode, str(jobs.workdir), *extra)


def runs(jobs: SlurmJobs) -> list[tuple[str, str]]:
    """(node, SLURM_RESTART_COUNT) of every run of the training script."""
    path = jobs.workdir / "runs.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(line.split()) for line in lines]  # type: ignore[misc]


@pytest.mark.slurm
def test_exit_16_is_requeued_away_from_its_node_and_finishes_on_the_other(slurm_jobs):
    job = slurm_jobs.submit("--max-resubmissions", "2", "--", *train(slurm_jobs, "first-node-16"))
    f = slurm_jobs.wait_done(job, 45)
    out = slurm_jobs.output(job)
    first, second = runs(slurm_jobs)
    assert first[1] == "unset" and second[1] == "1", out
    assert first[0] != second[0], f"ran twice on {first[0]}:\n{out}"
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert f["ExcNodeList"] == first[0] and f["NodeList"] == second[0]
    assert f"requeue 1 of 2 excluding {first[0]}" in out
    assert "finished: training finished" in out
    # the second run's verdict is read, not the first run's (kept aside, not overwritten)
    run_dir = slurm_jobs.workdir / "runs" / job
    assert json.loads((run_dir / "summary.json").read_text())["exit_code"] == 0
    assert json.loads((run_dir / "summary.before-restart1.json").read_text())["exit_code"] == 16


@pytest.mark.slurm
def test_exit_17_without_diagnosis_stops_and_says_why(slurm_jobs):
    job = slurm_jobs.submit("--", *train(slurm_jobs, "exit", "--code", "17"))
    f = slurm_jobs.wait_done(job, 30)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("FAILED", "17:0", "0"), out
    assert "stop: " in out and "exit 17 without a diagnosis from the rank" in out
    assert "not requeued" in out and "requeue:" not in out
    assert len(runs(slurm_jobs)) == 1


@pytest.mark.slurm
def test_finished_job_is_not_requeued(slurm_jobs):
    job = slurm_jobs.submit("--", *train(slurm_jobs, "exit", "--code", "0"))
    f = slurm_jobs.wait_done(job, 30)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "0"), out
    assert "finished: training finished (every launcher exited 0)" in out
    assert runs(slurm_jobs) == [(f["NodeList"], "unset")]


@pytest.mark.slurm
def test_resubmission_bound_holds(slurm_jobs):
    # exit 3 with --max-restarts 0: the launcher gives up (exit 1) and asks for a requeue
    job = slurm_jobs.submit("--max-resubmissions", "1", "--",
                            *train(slurm_jobs, "exit", "--code", "3"))
    f = slurm_jobs.wait_done(job, 45)
    out = slurm_jobs.output(job)
    assert [r[1] for r in runs(slurm_jobs)] == ["unset", "1"], out
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("FAILED", "1:0", "1"), out
    assert f["ExcNodeList"] == "(null)"  # a plain failure does not blame the node
    assert "requeue 1 of 1" in out
    assert "resubmission budget spent (1 of 1 requeues done); not requeued" in out


@pytest.mark.slurm
def test_a_job_that_may_not_be_requeued_stops_and_says_so(slurm_jobs):
    job = slurm_jobs.submit("--", *train(slurm_jobs, "exit", "--code", "3"),
                            sbatch=("--no-requeue",))
    f = slurm_jobs.wait_done(job, 30)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("FAILED", "1:0", "0"), out
    assert "ft_sbatch: stop: scontrol requeue failed: " in out
    assert "disabled" in out  # Slurm's own words: "Requested operation is presently disabled"


@pytest.mark.slurm
def test_usr1_before_time_limit_checkpoints_and_requeues(slurm_jobs):
    # --signal=B:USR1@N would come 30-60 s early at Slurm's whim; send it on demand instead
    job = slurm_jobs.submit("--max-resubmissions", "2", "--", *train(slurm_jobs, "usr1"),
                            sbatch=("--signal=B:USR1@60",))
    slurm_jobs.wait_file(slurm_jobs.workdir / "ready", 30, job)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=15)
    f = slurm_jobs.wait_done(job, 45)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert "got USR1 (time limit near): passing it to the launcher" in out
    assert "USR1: checkpoint at step" in out
    assert "requeue: exit 0 after USR1: the training checkpointed" in out
    assert "resumed from step" in out
    assert (slurm_jobs.workdir / "ckpt").read_text().isdigit()
    assert [r[1] for r in runs(slurm_jobs)] == ["unset", "1"]


@pytest.mark.slurm
def test_scancel_is_not_undone_by_a_requeue(slurm_jobs):
    job = slurm_jobs.submit("--", *train(slurm_jobs, "hold"))
    slurm_jobs.wait_file(slurm_jobs.workdir / "ready", 30, job)
    subprocess.run(["scancel", job], check=True, timeout=15)
    slurm_jobs.wait_done(job, 30)
    # the wrapper may still be deciding once the job reads CANCELLED: wait until it is gone
    assert not slurm_jobs.wait_gone(15)
    f = slurm_jobs.wait_done(job, 1)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["Restarts"]) == ("CANCELLED", "0"), out
    assert "requeue:" not in out
    assert len(runs(slurm_jobs)) == 1


@pytest.mark.slurm
def test_two_node_job_maps_each_summary_to_its_slurm_node(slurm_jobs):
    # Both slurmd run on this host, so both launchers report the same hostname; the
    # wrapper must still blame node2 (its run directory), and excluding node2 leaves one
    # node for a two-node job: stop rather than queue forever.
    job = slurm_jobs.submit("--rdzv-port", str(29400 + os.getpid() % 500), "--",
                            *train(slurm_jobs, "exit-on", "--node", "node2", "--code", "16",
                                  "--linger", "2"),
                            sbatch=("-N", "2"))
    f = slurm_jobs.wait_done(job, 45)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("FAILED", "16:0", "0"), out
    assert "node2: exit 16" in out
    assert "excluding node2 would leave 1 node(s) for a 2-node job; not requeued" in out
    summary = json.loads((slurm_jobs.workdir / "runs" / job / "node2" / "summary.json")
                         .read_text())
    assert summary["next_action"]["exclude_nodes"] == [summary["host"]]
    assert sorted(r[0] for r in runs(slurm_jobs)) == ["node1", "node2"]


@pytest.mark.slurm
def test_two_node_usr1_reaches_both_launchers_through_srun(slurm_jobs):
    job = slurm_jobs.submit("--max-resubmissions", "1", "--rdzv-port",
                            str(29900 + os.getpid() % 90), "--",
                            *train(slurm_jobs, "usr1", "--linger", "2"),
                            sbatch=("-N", "2"))
    for node in ("node1", "node2"):  # both handlers installed before the signal
        slurm_jobs.wait_file(slurm_jobs.workdir / f"ready.{node}", 30, job)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=15)
    f = slurm_jobs.wait_done(job, 45)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert "passing it to the launchers through srun" in out
    assert out.count("USR1: checkpoint at step") == 2, out
    assert out.count("resumed from step") == 2, out
    assert sorted(runs(slurm_jobs)) == [("node1", "1"), ("node1", "unset"), ("node2", "1"),
                                        ("node2", "unset")]


def test_wrapper_outside_slurm_is_a_one_line_error(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(WRAPPER), "train.py"], capture_output=True, text=True,
                         timeout=30, env=env, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("ft_sbatch: error: SLURM_JOB_ID is not set: submit this "
                                  "script with sbatch")


def test_wrapper_rejects_a_bad_budget(tmp_path: Path):
    out = subprocess.run(["bash", str(WRAPPER), "--max-resubmissions", "-1", "train.py"],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("ft_sbatch: error: --max-resubmissions (or "
                                  "FT_MAX_RESUBMISSIONS) must be a non-negative integer, "
                                  "got '-1'")
