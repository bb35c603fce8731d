"""Hang detection, stack capture, sections and learned timeouts, end to end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import (
    EXAMPLES,
    NO_PRELOADS,
    ROOT,
    SCRIPTS,
    events,
    finish,
    launcher_cmd,
    named,
    run_launcher,
    summary,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)
CASES = str(SCRIPTS / "monitor_cases.py")
# The console script installed beside this interpreter, whether or not its folder is on PATH.
FT_REPORT = str(Path(sys.executable).parent / "ft_report")


def _stack(run_dir, rank, cycle=0) -> str:
    return (run_dir / "stacks" / f"cycle_{cycle}_rank_{rank}.txt").read_text()


def test_sigstopped_rank_is_detected_dumped_killed_and_job_finishes(run_dir):
    proc = subprocess.Popen(
        launcher_cmd(run_dir, "--nproc-per-node", "2", "--max-restarts", "1",
                     "--ft-rank-heartbeat-timeout", "1.5", str(EXAMPLES / "train_ddp.py"),
                     "--steps", "40", "--step-time", "0.03", "--ckpt-every", "5"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        # Heartbeats have begun once the first checkpoint is written.
        wait_for((run_dir / "ckpt" / "iteration").exists, 60, "the first steps")
        pid = named(events(run_dir), "workers_started")[0]["pids"][1]
        t_stop = time.time()
        os.kill(pid, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    evs = events(run_dir)
    hang = named(evs, "hang_detected")[0]
    assert hang["timeout_kind"] == "heartbeat" and hang["timeout_s"] == 1.5
    # Deadline-driven: the verdict lands right after the timeout, not at a poll tick
    # (scripts/bench measures how soon; the bound here only allows for a loaded machine).
    # The deadline is the expired rank's; the blamed rank may have been heard from a little
    # later (then its own silence is under 1.5 s).
    assert 1.5 <= hang["expired_silence_s"] < 1.8, hang
    assert hang["silence_s"] < 1.8
    assert hang["detected_at"] - t_stop < 1.5 + 1.0
    # Both ranks go silent (rank 0 waits in the collective); the stopped one is blamed.
    assert hang["rank"] == 1 and hang["blame"] == "stopped"
    killed = named(evs, "rank_killed")[0]
    assert killed["pid"] == pid and killed["signal"] == "SIGKILL"
    dumped = named(evs, "stacks_dumped")[0]["ranks"]
    # py-spy (a test extra) reads the stopped process's stack; rank 0 answers by itself.
    assert set(dumped) == {0, 1}, "py-spy missing? it is in the test extra"
    assert "train_ddp.py" in _stack(run_dir, 1)
    assert summary(run_dir)["restarts"] == 1


def test_python_sleep_hang_stack_names_the_function(run_dir):
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--ft-rank-heartbeat-timeout", "1.5", str(EXAMPLES / "train_ddp.py"),
                       "--steps", "30", "--step-time", "0.02", "--hang-at-step", "5")
    assert res.returncode == 0, res.stdout
    hang = named(events(run_dir), "hang_detected")[0]
    assert hang["cycle"] == 0
    stacks = _stack(run_dir, 1)
    assert "in hang_forever" in stacks  # faulthandler, armed by the agent
    # The other rank is blocked in the collective that waits for the hung one.
    assert "hang_forever" not in _stack(run_dir, 0)
    assert named(events(run_dir), "restart")


# stuck_at_exit: the script never shuts monitoring down, and its interpreter's exit never
# ends (a teardown stuck after the exit handlers ran: the agent's says goodbye).
@pytest.mark.parametrize("mode", ["stuck_after_goodbye", "stuck_at_exit"])
def test_a_rank_stuck_after_its_goodbye_is_dumped_and_ended_and_the_job_succeeds(run_dir,
                                                                                  mode):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2",
                       "--workers-exit-timeout", "3", CASES, mode)
    assert res.returncode == 0, res.stdout
    evs = events(run_dir)
    assert [e["ranks"] for e in named(evs, "exit_stuck")] == [[1]]
    assert "in stuck_in_teardown" in _stack(run_dir, 1)  # py-spy, after the agent shut down
    exits = {e["rank"]: e for e in named(evs, "worker_exited")}
    assert exits[0]["exit_code"] == 0 and exits[1]["signal"] == "SIGKILL"
    gone, stuck = exits[0]["ts"], named(evs, "exit_stuck")[0]["ts"]
    assert 3.0 <= stuck - gone < 3.0 + 10.0
    assert summary(run_dir)["restarts"] == 0


def test_hang_before_first_heartbeat_is_caught_by_initial_timeout(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--ft-initial-rank-heartbeat-timeout", "4", CASES, "sleep_before_init")
    assert res.returncode == 0, res.stdout
    hang = named(events(run_dir), "hang_detected")[0]
    assert hang["rank"] == 1 and hang["timeout_kind"] == "initial"
    assert 4.0 <= hang["expired_silence_s"] < 4.5  # counted from spawn, not from connecting
    missing = named(events(run_dir), "stacks_dumped")[0]
    if 1 in missing["ranks"]:  # py-spy reads a rank that never connected
        assert "stuck_in_imports" in _stack(run_dir, 1)


def test_section_overrun_is_caught_while_other_sections_are_fine(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--ft-rank-section-timeouts", "fast:5,slow:1.5", CASES, "section_overrun")
    assert res.returncode == 0, res.stdout
    hangs = named(events(run_dir), "hang_detected")
    assert len(hangs) == 1
    assert hangs[0]["rank"] == 0 and hangs[0]["timeout_kind"] == "section:slow"
    assert "slow_section_work" in _stack(run_dir, 0)


def test_calculated_timeouts_survive_a_restart_and_a_new_job(tmp_path, run_dir):
    state = tmp_path / "shared_state.json"
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--ft-state-path", str(state), "--ft-safety-factor", "4",
                       "--ft-min-learned-timeout", "1", CASES, "calc")
    assert res.returncode == 0, res.stdout
    saved = json.loads(state.read_text())["calculated"]
    hb = saved["rank_heartbeat_timeout"]
    assert 4 * 0.03 <= hb < 4 * 1.0
    # Sections and out-of-section gaps last milliseconds: saved as calculated, and the
    # floor (--ft-min-learned-timeout) applies to what is in force.
    assert saved["rank_section_timeouts"]["step"] < 1.0
    assert saved["rank_out_of_section_timeout"] < 1.0
    assert saved["initial_rank_heartbeat_timeout"] > 0
    # Cycle 1 starts with what cycle 0 calculated.
    at_hello = json.loads((run_dir / "hello_timeouts_cycle_1_rank_0.json").read_text())
    assert at_hello["rank_heartbeat_timeout"] >= max(hb, 1.0) * 0.999
    assert at_hello["rank_section_timeouts"]["step"] == 1.0
    # A later job pointed at the same state file starts with them too.
    run2 = tmp_path / "run2"
    res = run_launcher(run2, *NO_PRELOADS, "--nproc-per-node", "1", "--ft-state-path",
                       str(state), CASES, "plain")
    assert res.returncode == 0, res.stdout
    at_hello = json.loads((run2 / "hello_timeouts_cycle_0_rank_0.json").read_text())
    # With the default floor (60 s) a few fast steps never give a timeout that kills.
    assert at_hello["rank_heartbeat_timeout"] == 60.0
    assert at_hello["rank_section_timeouts"]["step"] == 60.0


def test_malformed_and_unauthenticated_messages_change_nothing(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2",
                       "--ft-rank-heartbeat-timeout", "2", CASES, "bad_messages")
    assert res.returncode == 0, res.stdout
    s = summary(run_dir)
    errors = s["protocol_errors"]
    assert errors["malformed"] >= 2 * 7 and errors["unauthenticated"] >= 2
    assert errors["rejected_hello"] == 2 and errors["close_unopened"] == 2
    assert errors["unknown_section"] == 2 and errors["unknown_section_names"] == ["unconfigured"]
    reply = json.loads((run_dir / "bad_hello_reply_cycle_0_rank_0.json").read_text())
    assert reply["ok"] is False and reply["error"] == "wrong token for this rank"
    assert not named(events(run_dir), "hang_detected") and s["restarts"] == 0
    counted = [k for k, v in errors.items() if isinstance(v, int)]
    assert res.stdout.count("monitor ignored a message") == len(counted)  # logged once each


def test_no_false_verdict_in_a_long_clean_run(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2",
                       "--ft-rank-heartbeat-timeout", "1", "--ft-rank-section-timeouts", "step:1",
                       "--ft-rank-out-of-section-timeout", "1",
                       "--ft-initial-rank-heartbeat-timeout", "30", CASES, "clean_long")
    assert res.returncode == 0, res.stdout
    assert not named(events(run_dir), "hang_detected")
    stats = {(e["rank"], e["kind"]): e for e in named(events(run_dir), "interval_stats")}
    # 150 heartbeats 0.04 s apart: one within 0.04 s of the last one sent is folded.
    assert 40 <= stats[(0, "heartbeat")]["count"] <= 149
    assert stats[(0, "heartbeat")]["max"] < 1.0
    assert stats[(1, "section:step")]["count"] == 150


def test_ft_report_shows_intervals_and_cycles(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--ft-rank-heartbeat-timeout", "1.5",
                       "--ft-simulated-fault", "rank_hung:base_delay=1,rank=1",
                       CASES, "clean_long")
    assert res.returncode == 0, res.stdout
    report = subprocess.run([FT_REPORT, str(run_dir), "--json"], capture_output=True,
                            text=True, timeout=30)
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    hb = [r for r in data["intervals"] if r["kind"] == "heartbeat" and r["cycle"] == 1]
    assert {r["rank"] for r in hb} == {0, 1}
    assert all(r["timeout_in_force"] == 1.5 and r["min"] <= r["p50"] <= r["max"] for r in hb)
    c0 = data["cycles"][0]
    assert any("injected rank_hung rank 1" in f for f in c0["faults"])
    # The last heartbeat came just before the fault: detection is at most the timeout.
    assert 1.4 <= c0["detection_s"] < 2.5 and 0 <= c0["restart_s"] < 3
    text = subprocess.run([FT_REPORT, str(run_dir)], capture_output=True, text=True,
                          timeout=30)
    assert "heartbeat" in text.stdout and "cycle 0:" in text.stdout
    bad = subprocess.run([FT_REPORT, str(run_dir / "nope")], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode != 0 and "no events.jsonl" in bad.stderr
    assert "Traceback" not in bad.stderr


def _wakeups(pid: int) -> int:
    """Times the launcher's main thread went to sleep by itself (each is one wake-up)."""
    for line in (Path(f"/proc/{pid}/task/{pid}/status")).read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc status")


@pytest.mark.slow
def test_a_launcher_watching_busy_ranks_wakes_a_few_times_a_second(run_dir):
    """Two ranks heartbeat at 20 Hz: the launcher reads their messages in batches and has
    nothing to poll on one node, so it wakes about 4 times a second (it woke at least 10
    times a second, every --monitor-interval, before). With warm restart and learned
    preloads on (the defaults; the zygote's preloads, which the launcher's loop never sees,
    are left out): the ranks are warm, and the standby pool, refilled (and replaced once the
    zygote learned the ranks' imports, a one-off burst) before the count starts, costs no
    wake-up. Voluntary switches only: preemption on a busy machine does not count."""
    proc = subprocess.Popen(
        launcher_cmd(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", CASES, "steady"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "STEADY_S": "60"})
    try:
        wait_for(lambda: len(named(events(run_dir), "rank_connected")) == 2, 60,
                 "both ranks to connect")
        wait_for(lambda: len(_refilled(events(run_dir), learned=True)) == 2, 30,
                 "a standby per local rank from the zygote that learned ft_agent's imports")
        time.sleep(1.0)
        before, t0 = _wakeups(proc.pid), time.monotonic()
        time.sleep(4.0)
        per_s = (_wakeups(proc.pid) - before) / (time.monotonic() - t0)
    finally:
        if run_dir.is_dir():
            (run_dir / "stop").touch()  # the ranks stop heartbeating and exit 0
        out = finish(proc, 60)
    print(f"launcher: {per_s:.1f} wake-ups a second")
    assert proc.returncode == 0, out[-3000:]
    assert named(events(run_dir), "workers_started")[0]["warm"] == [True, True]
    assert per_s < 7, f"{per_s:.1f} wake-ups a second"


def _refilled(evs: list[dict], learned: bool = False) -> set[int]:
    """Local ranks with a standby ready after the cycle's workers started (``learned``: from
    a zygote that learned preloads)."""
    names = [e["event"] for e in evs]
    if "workers_started" not in names:
        return set()
    after = evs[names.index("workers_started"):]
    return {e["local_rank"] for e in after if e["event"] == "standby_ready"
            and (not learned or e.get("generation", 0) > 0)}
