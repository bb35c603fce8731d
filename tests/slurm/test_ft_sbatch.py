"""scripts/slurm/ft_sbatch.sh against a real Slurm 22.05 (two slurmd on this machine).

Each job runs the real wrapper, the real ft_launcher and a tiny training script
(slurm_train.py). A requeue costs about 6 s (cred_expire=5 is Slurm's floor), so each
test requeues at most once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from launch_helpers import NO_PRELOADS

from .conftest import TRAIN, WRAPPER, SlurmJobs

# slurm_train.py imports no torch: the zygote preloads nothing.
LAUNCH = (*NO_PRELOADS, "--nproc-per-node", "1", "--max-restarts", "0")


def train(jobs: SlurmJobs, mode: str, *extra: str) -> tuple[str, ...]:
    """Launcher options + the training script for one mode."""
    return (*LAUNCH, str(TRAIN), mode, str(jobs.workdir), *extra)


def hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm node list such as ``node[2-3]``."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist],
                          capture_output=True, text=True, timeout=15).stdout.split()


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
    # node (node3 is excluded from the start) for a two-node job: stop rather than queue
    # forever.
    job = slurm_jobs.submit("--rdzv-port", str(29400 + os.getpid() % 500), "--",
                            *train(slurm_jobs, "exit-on", "--node", "node2", "--code", "16",
                                  "--linger", "2"),
                            sbatch=("-N", "2", "-x", "node3"))
    f = slurm_jobs.wait_done(job, 120)  # two launchers: 45 s at load 20 on 2 cores
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("FAILED", "16:0", "0"), out
    assert "node2: exit 16" in out
    assert "excluding node2,node3 would leave 1 node(s) for a 2-node job; not requeued" in out
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
    first = slurm_jobs.wait_state(job, {"RUNNING"}, 60)
    nodes = hostnames(first["NodeList"])
    for node in nodes:  # both handlers installed before the signal
        slurm_jobs.wait_file(slurm_jobs.workdir / f"ready.{node}", 90, job)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=15)
    f = slurm_jobs.wait_done(job, 120)  # two launches of two launchers: 45 s at load 20
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert "passing it to the launchers through srun" in out
    assert out.count("USR1: checkpoint at step") == 2, out
    assert out.count("resumed from step") == 2, out
    # a requeued job may land on other nodes; each of its two runs trained on two nodes
    assert sorted(r[1] for r in runs(slurm_jobs)) == ["1", "1", "unset", "unset"]
    assert sorted(n for n, count in runs(slurm_jobs) if count == "unset") == nodes


SICK_NODE = "node1"  # the batch node: it also hosts the rendezvous store, which must survive
SICK_CHECK = (f'if [ "$SLURMD_NODENAME" = {SICK_NODE} ]; then '
              'echo "GPU 3 fell off the bus (simulated)"; exit 1; fi')


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slurm
def test_a_node_failing_its_health_check_is_replaced_by_the_spare_and_reported(slurm_jobs):
    # three nodes for a 2:2 job: node1 fails its health check, does not join, and the
    # other two finish. The job is done, so it is not requeued; node1 is reported.
    job = slurm_jobs.submit("--max-resubmissions", "2", "--nnodes", "2:2", "--rdzv-port",
                            str(28400 + os.getpid() % 500), "--",
                            "--ft-health-check", SICK_CHECK,
                            *train(slurm_jobs, "exit", "--code", "0"),
                            sbatch=("-N", "3"))
    f = slurm_jobs.wait_done(job, 180)  # 30 to 54 s at load 10 to 20 on 2 cores
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "0"), out
    assert f["ExcNodeList"] == "(null)", out
    healthy = sorted({"node1", "node2", "node3"} - {SICK_NODE})
    assert sorted(r[0] for r in runs(slurm_jobs)) == healthy, out  # trained on the others
    run_dir = slurm_jobs.workdir / "runs" / job
    sick = events(run_dir / SICK_NODE / "events.jsonl")
    failed = [e for e in sick if e["event"] == "health_check_failed"]
    assert [(e["check"], e["exit_code"]) for e in failed] == [(SICK_CHECK, 1)], out
    assert "GPU 3 fell off the bus (simulated)" in failed[0]["output"]
    assert not [e for e in sick if e["event"] in ("rendezvous_done", "workers_started")]
    summary = json.loads((run_dir / SICK_NODE / "summary.json").read_text())
    assert (summary["exit_code"], summary["next_action"]["requeue"],
            summary["next_action"]["exclude_nodes"]) == (1, True, [summary["host"]])
    for node in healthy:
        assert json.loads((run_dir / node / "summary.json").read_text())["exit_code"] == 0
    assert f"{SICK_NODE}: the launcher exited 1; the node leaves the job (1 of 1 spare" in out
    assert ("finished: training finished (the nodes that trained exited 0); 1 node(s) left "
            f"the job: {SICK_NODE}") in out
    assert (f"node left the job: {SICK_NODE}: health check failed: {SICK_CHECK} (exit 1) "
            "GPU 3 fell off the bus (simulated)") in out
    assert f"check these nodes before they run jobs again: {SICK_NODE} " in out
    assert "requeue:" not in out
    verdict = events(run_dir / "verdicts.jsonl")
    assert [(v["action"], v["check_nodes"]) for v in verdict] == [("finished", [SICK_NODE])]


def launcher_of(jobs: SlurmJobs, job: str, node: str) -> psutil.Process:
    """The ft_launcher process of ``node`` in ``job`` (its --ft-run-dir names the node)."""
    run_dir = str(jobs.workdir / "runs" / job / node)
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(a.endswith("ft_launcher") for a in cmd[:2]) and run_dir in cmd:
            return p
    pytest.fail(f"no launcher with --ft-run-dir {run_dir}:\n{jobs.output(job)[-3000:]}")


@pytest.mark.slurm
def test_a_dead_node_without_a_spare_is_excluded_when_the_job_is_requeued(slurm_jobs):
    # two nodes for a 2-node job (no spare): SIGKILL one launcher (a node that dies
    # leaves no summary); the job is requeued without that node and finishes on two others
    job = slurm_jobs.submit("--max-resubmissions", "1", "--rdzv-port",
                            str(27400 + os.getpid() % 500), "--",
                            *train(slurm_jobs, "hold-first-run"), sbatch=("-N", "2"))
    first = slurm_jobs.wait_state(job, {"RUNNING"}, 60)
    nodes = hostnames(first["NodeList"])
    victim = next(n for n in nodes if n != first["BatchHost"])  # the batch node holds the job
    for node in nodes:  # both launchers are up, and their workers run
        slurm_jobs.wait_file(slurm_jobs.workdir / f"ready.{node}", 90, job)
    launcher_of(slurm_jobs, job, victim).send_signal(signal.SIGKILL)
    f = slurm_jobs.wait_done(job, 240)  # a requeue and a second launch: 98 s at load 20
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert f["ExcNodeList"] == victim, out
    second = hostnames(f["NodeList"])
    assert len(second) == 2 and victim not in second, out
    assert f"no {slurm_jobs.workdir}/runs/{job}/{victim}/summary.json" in out
    assert "excluded: it died while others wrote theirs" in out
    assert f"requeue 1 of 1 excluding {victim}" in out and f"ExcNodeList={victim}" in out
    assert "finished: training finished (every launcher exited 0)" in out
    run_dir = slurm_jobs.workdir / "runs" / job
    dead = events(run_dir / victim / "events.jsonl")  # the first run's, never finished
    assert dead[0]["event"] == "launcher_started"
    assert not [e for e in dead if e["event"] == "launcher_exited"]
    assert sorted(runs(slurm_jobs)) == sorted([(n, "unset") for n in nodes]
                                              + [(n, "1") for n in second])


@pytest.mark.slurm
def test_a_waiting_spare_is_admitted_when_a_node_dies_mid_run(slurm_jobs):
    # three healthy nodes for a 2:2 job: two train, the third waits as a spare. SIGKILL of a
    # training node's launcher mid-run: the spare is admitted to the next round, the job
    # finishes on the survivor and the spare, and is not requeued for the node that died.
    job = slurm_jobs.submit("--max-resubmissions", "1", "--nnodes", "2:2", "--rdzv-port",
                            str(26400 + os.getpid() % 500), "--",
                            *train(slurm_jobs, "hold-until-killed", "--linger", "3"),
                            sbatch=("-N", "3"))
    first = slurm_jobs.wait_state(job, {"RUNNING"}, 60)
    nodes = hostnames(first["NodeList"])
    run_dir = slurm_jobs.workdir / "runs" / job

    def spare() -> str | None:
        for node in nodes:
            path = run_dir / node / "events.jsonl"
            if path.exists() and any(e["event"] == "spare_waiting" for e in events(path)):
                return node
        return None

    waiting = slurm_jobs.wait_for(spare, 120, job, "a launcher waiting as a spare")
    training = [n for n in nodes if n != waiting]
    for node in training:
        slurm_jobs.wait_file(slurm_jobs.workdir / f"ready.{node}", 90, job)
    victim, survivor = training
    (slurm_jobs.workdir / "killed").touch()
    launcher_of(slurm_jobs, job, victim).send_signal(signal.SIGKILL)
    f = slurm_jobs.wait_done(job, 240)
    out = slurm_jobs.output(job)
    assert (f["JobState"], f["ExitCode"], f["Restarts"]) == ("COMPLETED", "0:0", "0"), out
    spare_events = [e["event"] for e in events(run_dir / waiting / "events.jsonl")]
    assert spare_events.index("spare_waiting") < spare_events.index("spare_admitted") \
        < spare_events.index("workers_started"), spare_events
    survivor_events = events(run_dir / survivor / "events.jsonl")
    assert [e["cycle"] for e in survivor_events if e["event"] == "workers_started"] == [0, 1]
    for node in (survivor, waiting):
        assert json.loads((run_dir / node / "summary.json").read_text())["exit_code"] == 0
    assert sorted(runs(slurm_jobs)) == sorted(
        [(victim, "unset"), (survivor, "unset"), (survivor, "unset"), (waiting, "unset")]), out
    assert "requeue:" not in out, out


def test_wrapper_outside_slurm_is_a_one_line_error(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(WRAPPER), "train.py"], capture_output=True, text=True,
                         timeout=30, env=env, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("ft_sbatch: error: SLURM_JOB_ID is not set: submit this "
                                  "script with sbatch")


@pytest.mark.parametrize("nnodes, message", [
    ("2-3", "--nnodes (or FT_NNODES) must be N or MIN:MAX, got '2-3'"),
    ("3:2", "--nnodes: expected 1 <= MIN <= MAX, got '3:2'"),
    ("3:3", "--nnodes 3:3 needs at least 3 nodes; the job has 2 (sbatch --nodes)"),
])
def test_wrapper_rejects_nnodes_the_allocation_cannot_hold(tmp_path: Path, nnodes, message):
    # Slurm's variables set by hand: the checks run before anything is started
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2",
           "FT_LAUNCHER": "true", "FT_PYTHON": "true"}
    out = subprocess.run(["bash", str(WRAPPER), "--nnodes", nnodes, "train.py"],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path, env=env)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.strip() == f"ft_sbatch: error: {message}"
    assert not (tmp_path / "ft_runs").exists()  # nothing was run


def test_wrapper_rejects_a_bad_budget(tmp_path: Path):
    out = subprocess.run(["bash", str(WRAPPER), "--max-resubmissions", "-1", "train.py"],
                         capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("ft_sbatch: error: --max-resubmissions (or "
                                  "FT_MAX_RESUBMISSIONS) must be a non-negative integer, "
                                  "got '-1'")
