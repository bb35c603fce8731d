"""ft_agent.lightning: FaultToleranceCallback with a real Lightning Trainer under ft_launcher.

End to end: two ranks (DDP, gloo, CPU) run examples/train_lightning.py. A rank killed by the
callback's simulated fault and, in a second job, a rank hung by it are both recovered and
training finishes from the last checkpoint; the timeouts calculated at the end of the first
job are in force in the second; the finished flag appears only when training completed; an
exception is reported to the launcher before the rank dies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import EXAMPLES, ROOT, events, named, run_launcher, summary

pytestmark = pytest.mark.timeout(180)

TRAIN = str(EXAMPLES / "train_lightning.py")
FAST_STOP = ("--workers-stop-timeout", "2")
FLAG_ENV = "FAULT_TOL_FINISHED_FLAG_FILE"


def one(evs: list[dict], name: str, **match) -> dict:
    found = [e for e in named(evs, name) if all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one {name} {match}, got {found}"
    return found[0]


def steps_logged(run_dir: Path, cycle: int, rank: int, what: str) -> int:
    """The global step a rank printed at train_start / train_end in a cycle."""
    log = (run_dir / "logs" / f"cycle_{cycle}" / f"rank_{rank}.log").read_text()
    marker = f"rank {rank} cycle {cycle} {what} global_step "
    assert marker in log, f"{marker!r} not in the cycle {cycle} log of rank {rank}:\n{log[-2000:]}"
    return int(log.split(marker)[1].split()[0])


# -- in-process: parameters, victim agreement, optional import ---------------------------


def test_simulated_fault_params_accept_dataclass_or_mapping():
    from ft_agent.lightning import FaultToleranceCallback, SimulatedFaultParams

    params = SimulatedFaultParams("rank_hung", 2, rand_delay=1, rank_to_fail=1)
    assert FaultToleranceCallback(False, False, params).simulated_fault_params is params
    from_map = FaultToleranceCallback(False, False, {"fault_type": "random", "base_delay": 1.5})
    assert from_map.simulated_fault_params == SimulatedFaultParams("random", 1.5)
    with pytest.raises(ValueError, match="unknown field 'rank'"):
        FaultToleranceCallback(False, False, {"fault_type": "random", "base_delay": 1, "rank": 1})
    with pytest.raises(ValueError, match="missing field 'base_delay'"):
        SimulatedFaultParams.coerce({"fault_type": "rank_killed"})
    with pytest.raises(ValueError, match="fault_type: 'rank_exit' is not one of"):
        SimulatedFaultParams("rank_exit", 1)
    with pytest.raises(ValueError, match="base_delay: expected seconds >= 0"):
        SimulatedFaultParams("rank_killed", -1)
    with pytest.raises(ValueError, match="rank_to_fail: expected a rank >= 0"):
        SimulatedFaultParams("rank_killed", 1, rank_to_fail=-2)
    with pytest.raises(ValueError, match="expected SimulatedFaultParams or a mapping"):
        SimulatedFaultParams.coerce("rank_killed")


def test_every_rank_plans_the_same_fault_without_a_collective():
    from ft_agent.lightning import SimulatedFaultParams, plan_fault

    params = SimulatedFaultParams("random", base_delay=1.0, rand_delay=2.0)
    # What each of 8 ranks computes independently from the same run id and cycle.
    plans = {(p.rank, p.fault_type, p.delay)
             for p in (plan_fault(params, 8, "job-7", 0) for _rank in range(8))}
    assert len(plans) == 1
    (rank, fault_type, delay), = plans
    assert 0 <= rank < 8 and fault_type in ("rank_killed", "rank_hung") and 1.0 <= delay <= 3.0
    drawn = [plan_fault(params, 8, f"job-{i}", 0) for i in range(200)]
    assert {p.rank for p in drawn} == set(range(8))
    assert {p.fault_type for p in drawn} == {"rank_killed", "rank_hung"}
    # Armed in the first cycle only, unless asked to re-arm in every restarted process.
    assert plan_fault(params, 8, "job-7", 1) is None
    rearmed = SimulatedFaultParams("rank_killed", 1.0, rank_to_fail=3, rearm_in_every_cycle=True)
    assert plan_fault(rearmed, 8, "job-7", 2).rank == 3
    with pytest.raises(ValueError, match="rank 3 does not exist in a world of 2 ranks"):
        plan_fault(rearmed, 2, "job-7", 0)


def test_import_is_optional_and_lazy():
    code = ("import sys, ft_agent, ft_agent.client\n"
            "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') "
            "for m in sys.modules), 'import ft_agent imported lightning'\n"
            "sys.modules['lightning'] = None\n"
            "sys.modules['pytorch_lightning'] = None\n"
            "try:\n"
            "    import ft_agent.lightning\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'ft-launcher[lightning]'" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_plain_python_writes_the_flag_when_complete(tmp_path: Path):
    """Outside ft_launcher the heartbeats are no-ops; the finished flag still works.

    (A run that stops early leaves no flag: see the max_time cycle further down.)
    """
    flag = tmp_path / "finished"
    env = {**os.environ, FLAG_ENV: str(flag), "FT_RUN_DIR": str(tmp_path)}
    for var in ("FT_ENDPOINT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, TRAIN, "--max-steps", "3", "--step-time", "0",
                           "--autoresume", "--calculate-timeouts"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank 0 cycle 0 train_end global_step 3" in done.stdout
    assert flag.exists()
    assert not (tmp_path / "ft_state").exists(), "no launcher, nothing to calculate"


# -- end to end under ft_launcher ----------------------------------------------------------


def test_killed_then_hung_rank_recovered_with_calculated_timeouts(run_dir: Path, tmp_path: Path):
    exp = tmp_path / "exp"
    timeouts_file = exp / "ft_state" / "ft_timeouts.json"

    # Job 1: rank 1 kills itself 1.2 s into training; steps of 0.5 s, a checkpoint every 2.
    flag1 = tmp_path / "finished_1"
    # A floor of 1 s (default 60 s) lets the calculated timeout of 0.5 s steps be in force.
    proc = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP,
                        "--ft-min-learned-timeout", "1",
                        TRAIN, "--max-steps", "10", "--ckpt-every", "2", "--val-every", "4",
                        "--step-time", "0.5", "--fault", "rank_killed", "--fault-delay", "1.2",
                        "--fault-rank", "1", "--autoresume", "--calculate-timeouts",
                        "--exp-dir", str(exp), env={FLAG_ENV: str(flag1)}, timeout=150)
    assert proc.returncode == 0, proc.stdout[-4000:]
    evs = events(run_dir)
    report = one(evs, "rank_report", what="simulated_fault")
    assert (report["cycle"], report["rank"]) == (0, 1)
    assert json.loads(report["message"])["fault_type"] == "rank_killed"
    died = one(evs, "worker_exited", cycle=0, rank=1)
    assert died["signal"] == "SIGKILL" and 0 <= died["ts"] - report["ts"] < 2.0
    restart = one(evs, "restart")
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["cycles"]) == (0, 1, 2)
    resumed = steps_logged(run_dir, 1, 0, "train_start")
    assert resumed > 0 and resumed % 2 == 0, "cycle 1 resumes from a checkpoint of cycle 0"
    assert steps_logged(run_dir, 1, 1, "train_start") == resumed
    assert steps_logged(run_dir, 1, 0, "train_end") == 10
    # The callback reports steps and written checkpoints to the goodput ledger by itself.
    assert {e["rank"] for e in named(evs, "first_step") if e["cycle"] == 1} == {0, 1}
    saved_steps = {e["iteration"] for e in named(evs, "checkpoint_saved") if e["cycle"] == 0}
    assert resumed in saved_steps, (resumed, saved_steps)
    # The finished flag: written once training completed, in cycle 1, not before.
    assert flag1.exists() and flag1.stat().st_mtime > restart["ts"]
    # Timeouts: calculated at the end of the completed cycle only, then saved for job 2.
    calculated = one(evs, "timeouts_updated", what="hb")
    assert calculated["cycle"] == 1
    # Saved in NVRx's state-dict layout.
    saved = json.loads(timeouts_file.read_text())["current_timeouts"]["heartbeat"]
    assert saved["subsequent"] == calculated["timeouts"]["rank_heartbeat_timeout"]
    assert saved["initial"] == calculated["timeouts"]["initial_rank_heartbeat_timeout"]
    hb_timeout = saved["subsequent"]
    longest = max(e["max"] for e in named(evs, "interval_stats") if e["kind"] == "heartbeat")
    assert hb_timeout == pytest.approx(5.0 * longest, rel=0.01)  # default safety factor 5
    assert 2.0 < hb_timeout < 30.0, "the 0.5 s steps dominate the calculation"

    # Job 2, a new run dir: loads job 1's timeouts; rank 0 stops itself (SIGSTOP), only the
    # loaded heartbeat timeout (not the configured 60 s) can catch it in time. A configured
    # value is lowered by a loaded one only when the user says so.
    run2 = run_dir.with_name("run2")  # under the fixture's leftover-process check
    flag2 = tmp_path / "finished_2"
    proc = run_launcher(run2, "--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP,
                        "--ft-rank-heartbeat-timeout", "60", "--ft-min-learned-timeout", "1",
                        "--ft-learned-timeouts-override",
                        TRAIN, "--max-steps", "60", "--ckpt-every", "5", "--val-every", "20",
                        "--step-time", "0.05", "--fault", "rank_hung", "--fault-delay", "1.5",
                        "--fault-rank", "0", "--autoresume", "--calculate-timeouts",
                        "--exp-dir", str(exp), env={FLAG_ENV: str(flag2)}, timeout=150)
    assert proc.returncode == 0, proc.stdout[-4000:]
    evs2 = events(run2)
    loaded = [e for e in named(evs2, "timeouts_updated") if e["what"] == "loaded"]
    assert loaded and loaded[0]["cycle"] == 0
    in_force = loaded[0]["timeouts"]
    assert in_force["rank_heartbeat_timeout"] == hb_timeout
    assert in_force["initial_rank_heartbeat_timeout"] == saved["initial"]
    report = one(evs2, "rank_report", what="simulated_fault")
    assert (report["cycle"], report["rank"]) == (0, 0)
    assert json.loads(report["message"])["fault_type"] == "rank_hung"
    hang = one(evs2, "hang_detected")
    assert (hang["cycle"], hang["timeout_kind"], hang["timeout_s"]) == (0, "heartbeat",
                                                                        hb_timeout)
    assert hang["detected_at"] - report["ts"] < hb_timeout + 2.0
    s2 = summary(run2)
    assert (s2["exit_code"], s2["restarts"]) == (0, 1)
    resumed = steps_logged(run2, 1, 0, "train_start")
    assert resumed > 0 and resumed % 5 == 0
    assert steps_logged(run2, 1, 0, "train_end") == 60
    assert flag2.exists()


def test_exception_is_reported_and_an_early_end_leaves_no_flag(run_dir: Path, tmp_path: Path):
    # Cycle 0 raises at step 3 (reported, restarted); cycle 1 stops at max_time: not complete.
    flag = tmp_path / "finished"
    proc = run_launcher(run_dir, "--nproc-per-node", "1", "--max-restarts", "1", *FAST_STOP,
                        TRAIN, "--max-steps", "1000", "--step-time", "0.05", "--max-time", "2",
                        "--raise-at-step", "3", "--autoresume", env={FLAG_ENV: str(flag)},
                        timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    evs = events(run_dir)
    report = one(evs, "rank_report", what="exception")
    assert report["cycle"] == 0 and report["rank"] == 0
    assert report["message"].startswith("RuntimeError: deliberate failure at step 3 in rank 0")
    assert "Traceback" in report["message"] and "training_step" in report["message"]
    exited = one(evs, "worker_exited", cycle=0, rank=0)
    assert exited["exit_code"] == 1 and report["ts"] <= exited["ts"]
    assert summary(run_dir)["restarts"] == 1
    assert 0 < steps_logged(run_dir, 1, 0, "train_end") < 1000
    assert not flag.exists()
    assert "training not complete" in (run_dir / "logs" / "cycle_1" / "rank_0.log").read_text()
