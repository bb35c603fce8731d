"""Stragglers end to end: a real launcher slows a real gloo rank (``rank_slow``), and its
monitor names that rank from the time each rank spends in ``client.section("compute")``.

The script (tests/scripts/straggler_train.py) logs every step's end time per rank, so "within
N steps of onset" is counted in the slow rank's own steps between the launcher's
``fault_injected`` and ``straggler_detected`` events. The test ends the training (a stop
file) once it has seen what it waits for, so a fast machine finishes fast; the bounds are
generous because this machine is shared. Timing rules are in tests/test_straggler.py; the
fast tier's end-to-end case of a slowed rank named by the detector is in test_rank_slow.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import (
    ROOT,
    SCRIPTS,
    TORCH_PRELOAD,
    events,
    launcher_cmd,
    named,
    slower_by_the_log,
    summary,
)

from ft_launcher.stragglers.straggler import speed_table

# Every case runs a real job for seconds to tens of seconds: the slow tier.
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TRAIN = str(SCRIPTS / "straggler_train.py")
# A step's section: ~1 ms of pure-Python CPU, then 50 ms of sleep (work that waits, as on a
# device). rank_slow stretches the whole section (ft_agent sleeps (factor - 1) times its wall
# time inside it), so the slowed rank's sections take ~150 ms while the others' stay ~51 ms.
# A sleep is hardly stretched by a busy machine and costs no CPU: the job proves the wiring
# (fault, sections, monitor, detector, action) for a few CPU seconds. A section of pure CPU
# work on ranks that share two cores differs by up to ~1.7x from scheduling alone (measured:
# rank 0's 1.5x rank 1's with nothing slowed); that noise is what the clean 8-rank run below
# keeps (and the fast tier's test_rank_slow.py), and the rules against it are tested on
# synthetic times in test_straggler.py.
LIGHT = ("--work", "20000", "--sleep", "0.05")
# The clean 8-rank run: ~10 ms of pure-Python CPU per section on every rank, 8 ranks on 2
# cores: scheduling noise and nothing else.
CLEAN = ("--work", "175000", "--idle", "0.05")
# base_delay of rank_slow: counted from the moment every rank is training, so the onset
# follows a window of clean steps however long the imports took (~70 steps on an idle
# machine; the cases assert the clean steps they need).
ONSET_S = 4.0
# The victim is slowed 3x and reported above 2.0: the options reach the detector, and a
# loaded machine's noise stays far below either. The default threshold (1.3) is the last
# case's.
THRESHOLD = ("--ft-straggler-threshold", "2.0")
SLOW = "rank_slow:factor=3,rank=1"
# A stopped or wedged rank fails the test in a minute instead of at the timeouts below.
FAST_STOP = ("--workers-stop-timeout", "5", "--ft-rank-heartbeat-timeout", "60")


def steps(out: Path, rank: int, cycle: int = 0) -> list[tuple[int, float, float]]:
    """(step, wall time at its end, compute seconds) of one rank."""
    path = out / f"cycle_{cycle}_rank_{rank}.txt"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:  # a line being written is shorter
            rows.append((int(parts[0]), float(parts[1]), float(parts[2])))
    return rows


def train(run_dir: Path, out: Path, nproc: int, *ft_args: str, until, bound_s: float,
          cap_s: float = 150.0, job: tuple[str, ...] = LIGHT
          ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the launcher; once ``until(events)`` holds (or after ``bound_s``) the training
    is told to stop. The script stops itself after ``cap_s`` in any case; ``job``: the
    script's load (and any other of its options)."""
    cmd = launcher_cmd(run_dir, *TORCH_PRELOAD, "--nproc-per-node", str(nproc), *FAST_STOP,
                       *ft_args, TRAIN, str(out), *job, "--seconds", str(cap_s))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ})
    deadline = time.monotonic() + bound_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if until(events(run_dir)):
                break
            time.sleep(0.2)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stop").touch()
        output, _ = proc.communicate(timeout=cap_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"ft_launcher did not finish:\n{output[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output, None), events(run_dir)


def steps_after(out: Path, rank: int, since: float, until: float) -> int:
    return sum(1 for _, ts, _ in steps(out, rank) if since < ts <= until)


def detected_then(extra_steps: int, out: Path, rank: int):
    """until(): a straggler_detected event, then ``extra_steps`` more steps of ``rank``."""
    def until(evs: list[dict]) -> bool:
        found = named(evs, "straggler_detected")
        return bool(found) and steps_after(out, rank, found[0]["ts"], float("inf")) >= \
            extra_steps
    return until


STEPS_BOUND = 80  # steps of the slowed rank from the onset to the report, end to end


def check_named_soon_after_onset(run_dir: Path, out: Path, proc, evs: list[dict], nproc: int,
                                window: int, clean_steps: int = 0):
    """rank 1 named within STEPS_BOUND of its steps after the onset, which came after at least
    ``clean_steps`` clean steps."""
    assert proc.returncode == 0, proc.stdout[-3000:]
    injected = named(evs, "fault_injected")
    assert len(injected) == 1, injected
    assert (injected[0]["fault_type"], injected[0]["rank"], injected[0]["factor"]) == (
        "rank_slow", 1, 3.0)
    onset = injected[0]["at"]  # the rank's own onset: its report may arrive after a verdict
    before = sum(1 for _, ts, _ in steps(out, 1) if ts <= onset)
    assert before >= clean_steps, f"only {before} clean steps before the onset: machine " \
        "too loaded for this test's base_delay"
    detected = named(evs, "straggler_detected")
    assert detected, f"rank 1 was never reported; compute times of rank 1: " \
        f"{[round(c, 3) for _, _, c in steps(out, 1)]}\nrank 0: " \
        f"{[round(c, 3) for _, _, c in steps(out, 0)]}"
    first = detected[0]
    assert {e["rank"] for e in detected} == {1}, f"a healthy rank was reported: {detected}"
    assert (first["rank"], first["host"], first["section"], first["window"]) == (
        1, socket.gethostname(), "compute", window)
    assert first["score"] > 2.0 and first["steps"] >= window, "never on fewer than a window"
    taken = steps_after(out, 1, onset, first["ts"])
    # The 20-step rule itself is a fake-clock test (test_straggler.py, 2x and 3x ranks); with
    # both cores kept busy by other work a step's time varies widely, so this bound only
    # proves the wiring.
    assert taken <= STEPS_BOUND, f"detected {taken} steps after the onset"
    assert summary(run_dir)["restarts"] == 0, "report: the job goes on"
    assert steps(out, 0)[-1][0] == steps(out, nproc - 1)[-1][0], "every rank ran every step"


def test_a_slow_rank_of_4_is_named_within_80_steps(run_dir: Path, tmp_path: Path):
    """Four ranks on two cores: the slow rank competes for the CPU with its peers. Default
    section "compute" and action report; a window of 10 (see THRESHOLD). Two ranks are
    named in test_a_transient_slowdown_is_reported_then_cleared."""
    out = tmp_path / "steps"
    proc, evs = train(run_dir, out, 4, *THRESHOLD, "--ft-straggler-window", "10",
                      "--ft-simulated-fault", f"{SLOW},base_delay={ONSET_S + 2}",
                      until=detected_then(5, out, 1), bound_s=150)
    check_named_soon_after_onset(run_dir, out, proc, evs, 4, window=10, clean_steps=10)
    # ft_report's table of relative speeds marks the straggler.
    from ft_launcher.observe.report import build_report

    rows = build_report(run_dir)["speeds"]["rows"]
    assert {r["rank"] for r in rows if r["straggler"]} == {1}, rows


# How long the transient slowdown lasts: ~100 slowed steps of ~150 ms on an idle machine,
# where the slowed rank is named after ~10-20 of them and cleared ~10 steps after the end.
# (With 60 ms of CPU work a step on two cores shared with other work, a step once took 1.8 s
# slowed and a 15 s slowdown ran out before a window of slow steps; a sleep is not stretched
# so.)
TRANSIENT_S = 15


def slowed_steps(out: Path, evs: list[dict]) -> dict[int, list[float]]:
    """Each rank's compute times from the onset on: what the detector saw, for a failure."""
    onset = min((e["ts"] for e in named(evs, "fault_injected")), default=float("inf"))
    return {rank: [round(c, 3) for _, ts, c in steps(out, rank) if ts > onset]
            for rank in (0, 1)}


def test_a_transient_slowdown_is_reported_then_cleared(run_dir: Path, tmp_path: Path):
    """Also the options: a window of 10 and a threshold of 2 reach the detector."""
    out = tmp_path / "steps"
    proc, evs = train(run_dir, out, 2, "--ft-straggler-window", "10", *THRESHOLD,
                      "--ft-simulated-fault",
                      f"{SLOW},base_delay={ONSET_S},duration={TRANSIENT_S}",
                      until=lambda evs: bool(named(evs, "straggler_cleared")), bound_s=150)
    assert proc.returncode == 0, proc.stdout[-3000:]
    transitions = [(e["event"], e["rank"]) for e in evs
                   if e["event"] in ("straggler_detected", "straggler_cleared")]
    assert transitions == [("straggler_detected", 1), ("straggler_cleared", 1)], (
        transitions, named(evs, "fault_injected"), slowed_steps(out, evs))
    cleared = named(evs, "straggler_cleared")[0]
    detected = named(evs, "straggler_detected")[0]
    # The throttle's grip varies with the load (a CPU budget, not a fixed speed), so when
    # within the slowdown the score falls back is not asserted; only that it does, after.
    assert cleared["ts"] > detected["ts"]
    assert detected["window"] == 10 and detected["score"] > 2.0
    assert cleared["score"] < 1.5  # below halfway back to 1


def test_restart_action_restarts_the_group_away_from_the_slowdown(run_dir: Path,
                                                                  tmp_path: Path):
    """rank_slow fires in cycle 0 only: after the restart the job runs clean to the end."""
    out = tmp_path / "steps"

    def until(evs):
        return len(steps(out, 1, cycle=1)) >= 30

    proc, evs = train(run_dir, out, 2, "--max-restarts", "2", "--ft-straggler-action",
                      "restart", *THRESHOLD, "--ft-simulated-fault",
                      f"{SLOW},base_delay={ONSET_S}", until=until,
                      bound_s=150)
    assert proc.returncode == 0, proc.stdout[-3000:]
    detected = named(evs, "straggler_detected")
    assert [(e["cycle"], e["rank"]) for e in detected] == [(0, 1)], detected
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["cycles"]) == (0, 1, 2)
    decision = [e for e in named(evs, "decision") if e["cycle"] == 0][0]
    assert "straggler" in str(decision.get("reason")), decision
    assert len(steps(out, 1, cycle=1)) >= 30


def test_exclude_action_requeues_without_the_stragglers_host(run_dir: Path, tmp_path: Path):
    out = tmp_path / "steps"
    proc, evs = train(run_dir, out, 2, "--max-restarts", "2", "--ft-straggler-action",
                      "exclude", *THRESHOLD, "--ft-simulated-fault",
                      f"{SLOW},base_delay={ONSET_S}",
                      until=lambda evs: False, bound_s=90)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert [e["rank"] for e in named(evs, "straggler_detected")] == [1]
    s = summary(run_dir)
    assert s["restarts"] == 0
    nxt = s["next_action"]
    assert nxt["requeue"] is True and nxt["exclude_nodes"] == [socket.gethostname()], nxt
    assert "straggler" in nxt["why"]


CLEAN_STEPS = 150


def test_a_clean_run_of_8_ranks_reports_no_straggler(run_dir: Path, tmp_path: Path):
    """8 ranks of pure-CPU sections on 2 shared cores for 150 steps: noise, no straggler.
    150 steps: past the detector's baseline horizon (10 windows of 12) and the half of it
    after which a rank slow from its first step is named, so every rule has had its say.
    The 5-minute run is scripts/straggler_soak.sh."""
    out = tmp_path / "steps"
    proc, evs = train(run_dir, out, 8, until=lambda evs: False, bound_s=400, cap_s=0,
                      job=(*CLEAN, "--min-steps", str(CLEAN_STEPS)))
    assert proc.returncode == 0, proc.stdout[-3000:]
    counts = [len(steps(out, r)) for r in range(8)]
    assert counts == [CLEAN_STEPS] * 8, f"every rank runs every step: {counts}"
    # The whole run's medians: no rank slower than the others by half. (The light job's
    # sections are ~20 ms: one rank's median came out 1.42x the others' on a busy machine.)
    table = speed_table(evs)
    assert len(table) == 8 and all(row["score"] < 1.5 for row in table), table
    # 2 cores shared with the rest of the suite can hold one of 8 ranks slower than the
    # others for longer than the persistence rule waits (rank 7 was named once, beside 2 busy
    # loops and the suite's other workers). Such a verdict must be true by the job's own
    # log; a verdict on a rank the log does not show slower fails the test.
    times = {r: [(ts, c) for _, ts, c in steps(out, r)] for r in range(8)}
    for verdict in named(evs, "straggler_detected"):
        ratio = slower_by_the_log(times, verdict)
        assert ratio >= 1.2, (verdict, ratio)


def test_device_times_reach_the_detector_and_name_the_rank(run_dir: Path):
    """Sections with ``device=True`` under a real launcher; MOCK: the CUDA events only (no
    GPU here; tests/scripts/straggler_device_train.py). Wall times are equal (a fixed sleep)
    while rank 1's device times are 3x from its first step: the report names rank 1 on clock
    "device", once it has been slow for half the detector's horizon (50 steps here)."""
    from launch_helpers import run_launcher

    res = run_launcher(run_dir, *TORCH_PRELOAD, "--nproc-per-node", "2", *FAST_STOP, *THRESHOLD,
                       "--ft-straggler-window", "10",
                       str(SCRIPTS / "straggler_device_train.py"), "--steps", "90",
                       timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    detected = named(events(run_dir), "straggler_detected")
    assert [(e["rank"], e["clock"]) for e in detected] == [(1, "device")], res.stdout[-3000:]
    assert detected[0]["score"] > 2.0
    assert detected[0]["median_s"] == pytest.approx(3 * detected[0]["reference_s"], rel=0.3)


def test_the_default_threshold_names_a_2x_rank_of_2_and_nothing_else(run_dir: Path,
                                                                   tmp_path: Path):
    """The issue's case with every straggler option at its default (threshold 1.3, window
    12) and ``rank_slow:factor=2``. Measured with 60 ms steps of CPU work (2026-12-01, load
    2-4): named 13 of its steps after the onset with 2 ranks, 17 with 4; the bound is
    STEPS_BOUND (this proves the wiring; see README "Stragglers", Limits)."""
    out = tmp_path / "steps"
    proc, evs = train(run_dir, out, 2, "--ft-simulated-fault",
                      f"rank_slow:factor=2,rank=1,base_delay={ONSET_S + 2}",
                      until=detected_then(5, out, 1), bound_s=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    onset = named(evs, "fault_injected")[0]["at"]
    assert sum(1 for _, ts, _ in steps(out, 1) if ts <= onset) >= 20, "machine too loaded"
    detected = named(evs, "straggler_detected")
    assert [e["rank"] for e in detected] == [1], detected
    first = detected[0]
    assert first["window"] == 12 and first["score"] > 1.3 and first["ts"] > onset
    taken = steps_after(out, 1, onset, first["ts"])
    assert taken <= STEPS_BOUND, f"detected {taken} steps after the onset"
