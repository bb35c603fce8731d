"""``rank_slow`` slows the rank's work, whatever the loop's shape.

A rank that times sections (ft_agent) stretches each closing section to ``factor`` times its
work (ft_agent/simulated_fault.py ``SlowSections``); the launcher's SIGSTOP/SIGCONT throttle
is only for a rank that times none (ft_launcher/stragglers/throttle.py). The pure stretch is
tested on a fake clock; end to end, a real 2-rank gloo job of the DDP shape the slowdown
must survive (a short ``compute`` section, a sleep, an all-reduce) is slowed 3x on rank 1.
"""

from __future__ import annotations

import json
import os
import statistics
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
)

from ft_agent import simulated_fault
from ft_agent.simulated_fault import SlowSections
from ft_launcher import faults
from ft_launcher.hang.monitor import parse_agent_fault
from ft_launcher.stragglers.throttle import DEFAULT_MAX_STOP_S

TRAIN = str(SCRIPTS / "straggler_train.py")
PLAIN = str(SCRIPTS / "plain_slow_train.py")


# -- the stretch, on a fake clock ---------------------------------------------------------


def test_a_section_after_the_onset_lasts_factor_times_its_work():
    slow = SlowSections(3.0, delay=5.0)
    slow.opened("compute", 100.0)  # the first section: the onset is 5 s later
    assert slow.extra_s("compute", 100.01) == 0.0
    slow.opened("compute", 105.0)
    assert slow.extra_s("compute", 105.0017) == pytest.approx(2 * 0.0017)
    slow.opened("compute", 106.0)
    assert slow.extra_s("compute", 106.010) == pytest.approx(0.020)


def test_a_nested_section_is_not_slowed_twice():
    slow = SlowSections(3.0)
    slow.opened("step", 0.0)
    slow.opened("compute", 0.005)
    inner = slow.extra_s("compute", 0.015)  # 10 ms of work -> +20 ms
    assert inner == pytest.approx(0.020)
    # step: 25 ms of work (10 inside compute) took 45 ms with the inner stretch; 3x is 75.
    assert slow.extra_s("step", 0.045) == pytest.approx(0.030)


def test_duration_ends_the_slowdown_and_unopened_sections_add_nothing():
    slow = SlowSections(2.0, delay=1.0, duration=2.0)
    assert slow.extra_s("compute", 5.0) == 0.0  # never opened
    slow.opened("compute", 0.0)
    slow.extra_s("compute", 0.1)
    slow.opened("compute", 2.0)
    assert slow.extra_s("compute", 2.5) == pytest.approx(0.5)
    slow.opened("compute", 3.5)
    assert slow.extra_s("compute", 3.6) == 0.0  # after start + duration


@pytest.mark.parametrize("duration", [None, 4.0])
def test_the_env_value_round_trips(duration):
    value = simulated_fault.slow_fault_value(3.0, 8.0, duration)
    assert simulated_fault.parse_slow_fault(value) == (3.0, 8.0, duration)
    armed = faults.ArmedFault("rank_slow", 1, 8.0, factor=3.0, duration=duration)
    assert armed.env_value() == value


@pytest.mark.parametrize("bad", ["rank_slow:factor=1,delay=2", "rank_slow:factor=2",
                                 "rank_slow:factor=x,delay=1", "rank_exit:code=3,delay=1",
                                 "rank_slow:factor=2,delay=1,duration=0"])
def test_a_bad_env_value_arms_nothing(bad):
    assert simulated_fault.parse_slow_fault(bad) is None


# -- who slows the rank -------------------------------------------------------------------


class _Worker:
    def __init__(self, rank: int, pid: int) -> None:
        self.rank, self.pid, self.alive = rank, pid, True


class _Group:
    def __init__(self) -> None:
        self.workers = [_Worker(0, 1000), _Worker(1, 1001)]


class _Throttle:
    made: list[dict] = []

    def __init__(self, pid, factor, **kwargs) -> None:
        _Throttle.made.append({"pid": pid, "factor": factor, **kwargs})
        self.max_stop_s = DEFAULT_MAX_STOP_S

    def start(self) -> None:
        pass


@pytest.mark.parametrize("times_sections", [True, False])
def test_a_rank_that_times_sections_slows_itself_else_it_is_throttled(times_sections):
    _Throttle.made = []
    seen = []
    armed = faults.ArmedFault("rank_slow", 1, 2.0, factor=3.0)
    got = faults.inject(_Group(), armed, 0, lambda name, **f: seen.append((name, f)),
                        new_throttle=_Throttle, times_sections=lambda rank: times_sections)
    assert got is not None and got.record["fault_type"] == "rank_slow" and armed.fired
    assert (got.throttle is None) == times_sections
    # The rank itself says when its first section is stretched (source "agent").
    assert seen == [] if times_sections else seen[0][1]["by"] == "throttle"
    if not times_sections:  # and the throttle ends once the rank closes a section
        assert _Throttle.made[0]["pid"] == 1001 and _Throttle.made[0]["until"]() is False


# -- end to end: a real 2-rank gloo job ---------------------------------------------------


def _compute_times(out: Path, rank: int) -> list[tuple[float, float, float]]:
    """(wall time at the step's end, section seconds, CPU seconds of the work inside it) per
    step of ``rank``, in step order."""
    rows = []
    path = out / f"cycle_0_rank_{rank}.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 4:  # a line being written is shorter
            rows.append((float(parts[1]), float(parts[2]), float(parts[3])))
    return rows


def _named_since(evs: list[dict], rank: int) -> float | None:
    """From when ``rank`` is under a straggler verdict after the slowdown's onset (the rank's
    own ``fault_injected.at``): the onset itself where a verdict from before it still stood (a
    loaded machine can slow a rank before the fault does), else the first verdict after it;
    None before either."""
    injected = named(evs, "fault_injected")
    if not injected:
        return None
    onset, standing = injected[0]["at"], False
    for e in evs:
        if e["event"] not in ("straggler_detected", "straggler_cleared") or e["rank"] != rank:
            continue
        if e["ts"] <= onset:
            standing = e["event"] == "straggler_detected"
        elif e["event"] == "straggler_detected":
            return e["ts"]
    return onset if standing else None


def _slowed_run(tmp_path: Path, work: str, idle: str) -> dict:
    """rank_slow:factor=3 on rank 1 of 2, 2 s after training starts; the run stops 30 of
    rank 1's steps after it is named (or at its cap). Returns the medians and the steps."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    cmd = launcher_cmd(run_dir, *TORCH_PRELOAD, "--nproc-per-node", "2",
                       "--workers-stop-timeout", "5",
                       "--ft-simulated-fault", "rank_slow:factor=3,rank=1,base_delay=2",
                       TRAIN, str(out), "--work", work, "--idle", idle, "--seconds", "25")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ})
    try:
        deadline = time.monotonic() + 40
        while proc.poll() is None and time.monotonic() < deadline:
            since = _named_since(events(run_dir), 1)
            if since is not None and sum(ts > since for ts, _, _ in _compute_times(out, 1)) >= 30:
                break
            time.sleep(0.2)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stop").touch()
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-3000:]
    evs = events(run_dir)
    injected = named(evs, "fault_injected")
    assert [(e["rank"], e["by"]) for e in injected] == [(1, "sections")], injected
    # When the rank stretched its first section (its own clock), not when the launcher heard
    # of it: the report can arrive after the launcher has already named the rank.
    onset = injected[0]["at"]
    # The same steps of both ranks (a synchronous job: step k ends together), from a step
    # after the onset to the stop.
    slowed, peer = _compute_times(out, 1), _compute_times(out, 0)
    first = next(i for i, (ts, _, _) in enumerate(slowed) if ts > onset) + 1
    pairs = list(zip(slowed[first:], peer[first:], strict=False))
    detected = named(evs, "straggler_detected")
    after = [e for e in detected if e["ts"] > onset]
    since = _named_since(evs, 1)
    return {"slowed_s": statistics.median(s for (_, s, _), _ in pairs),
            "peer_s": statistics.median(p for _, (_, p, _) in pairs), "steps": len(pairs),
            "stretch": statistics.median(s / max(cpu, 1e-6) for _, s, cpu in slowed[first:]),
            "before": [e for e in detected if e["ts"] <= onset], "after": after,
            "steps_to_verdict": None if since is None else sum(
                onset < ts <= since for ts, _, _ in slowed),
            "times": {0: peer, 1: slowed}, "output": output}


def test_a_verdict_standing_at_the_onset_names_the_rank_from_the_onset():
    def ev(event, ts, rank=1):
        return {"event": event, "ts": ts, "rank": rank}
    injected = {"event": "fault_injected", "ts": 10.5, "at": 10.0, "rank": 1}
    standing = [ev("straggler_detected", 5.0), injected, ev("straggler_detected", 12.0, 0)]
    assert _named_since(standing, 1) == 10.0
    cleared = [ev("straggler_detected", 5.0), ev("straggler_cleared", 7.0), injected,
               ev("straggler_detected", 11.0)]
    assert _named_since(cleared, 1) == 11.0
    assert _named_since(cleared[:3], 1) is None
    assert _named_since([ev("straggler_detected", 5.0)], 1) is None  # no onset yet


# The fast tier's end-to-end proof of rank_slow by sections, and of a straggler verdict: the
# ~10 ms section. The 2 ms one, more at the mercy of the load, is in the slow tier.
@pytest.mark.parametrize(("work", "idle", "max_steps"), [
    ("175000", "0.01", 60),
    pytest.param("55000", "0.01", 150, marks=pytest.mark.slow),
], ids=["short-section", "2ms-section"])
def test_a_slowed_rank_s_section_takes_factor_times_its_work_and_is_named(tmp_path, work, idle,
                                                                          max_steps):
    got = _slowed_run(tmp_path, work, idle)
    ratio = got["slowed_s"] / got["peer_s"]
    print(f"section medians over {got['steps']} steps: slowed {got['slowed_s'] * 1e3:.2f} ms, "
          f"peer {got['peer_s'] * 1e3:.2f} ms (x{ratio:.2f}), slowed section x"
          f"{got['stretch']:.2f} its work's CPU time; verdict after {got['steps_to_verdict']} "
          f"steps; {len(got['before'])} verdict(s) before the onset")
    # Exact whatever the load: the section lasts factor times its wall time, which is at least
    # the CPU time of its work (2.9: the log's microsecond rounding).
    assert got["stretch"] >= 2.9, got["output"][-2000:]
    if max_steps <= 60:
        # Against the peer the ratio also carries the load, and not evenly: the slowed rank
        # sleeps two thirds of its section, so a busy machine's scheduler hands it the core
        # first and its peer's work waits (on a busy CI machine the peer's ~7 ms of work took
        # 15.3 ms, the slowed rank's 7.4 ms: x1.46). Slower than the peer, as the verdict needs,
        # and below 5 (factor 3, with room for the peer's noise).
        assert 1.2 < ratio < 5.0, got["output"][-2000:]
    # Rank 1 is named after the onset, by a new verdict or by one from before it that still
    # stands, and no other rank is.
    assert got["steps_to_verdict"] is not None, (got["before"], got["after"])
    assert {e["rank"] for e in got["after"]} <= {1}, got["after"]
    # Before the onset nothing is slowed, but 2 shared cores under a busy CI machine can
    # hold one rank's section 1.3x the other's long enough to be named (rank 0 was, once, ~50
    # steps before the onset; rank 1 once, its verdict standing through the onset). Such a
    # verdict must be true by the job's own log; the clean-run tests in test_straggler_e2e.py
    # are the ones that assert none on a quiet run.
    for verdict in got["before"]:
        assert slower_by_the_log(got["times"], verdict) >= 1.2, \
            (verdict, got["output"][-2000:])
    # The rule's own bound is on a fake clock (tests/test_straggler.py); here the wiring, with
    # room for a loaded machine. The detector waits out noise as large as the excess, and a
    # 2 ms section's noise is: 35 and 67 steps were seen for it under the whole suite.
    assert got["steps_to_verdict"] <= max_steps, got["steps_to_verdict"]


# -- end to end: a plain script (no sections): the launcher's throttle ---------------------


def _plain_rows(out: Path, rank: int) -> list[list[float]]:
    """[wall time at the step's end, compute_s, sleep_s, allreduce_s] per step of ``rank``."""
    path = out / f"cycle_0_rank_{rank}.txt"
    rows = [line.split() for line in (path.read_text().splitlines() if path.exists() else [])]
    return [[float(x) for x in r[1:]] for r in rows if len(r) == 5]


def _throttled_run(tmp_path: Path, idle: float, steps: int = 30) -> dict:
    """rank_slow:factor=3 on rank 1 of 2 of a plain script (~40 ms of compute, then ``idle``
    seconds of sleep), 2 s after spawn (a warm fork is past its imports by then); ``steps``
    steps after the onset, then the stop file. Medians over the same steps of both ranks."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    cmd = launcher_cmd(run_dir, *TORCH_PRELOAD, "--nproc-per-node", "2",
                       "--workers-stop-timeout", "5",
                       "--ft-simulated-fault", "rank_slow:factor=3,rank=1,base_delay=2",
                       PLAIN, str(out), "--work", "700000", "--idle", str(idle), "--seconds", "40")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ})
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            injected = named(events(run_dir), "fault_injected")
            if injected and sum(r[0] > injected[0]["ts"] for r in _plain_rows(out, 1)) > steps:
                break
            time.sleep(0.2)
        out.mkdir(parents=True, exist_ok=True)
        (out / "stop").touch()
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-3000:]
    injected = named(events(run_dir), "fault_injected")
    assert [(e["rank"], e["by"]) for e in injected] == [(1, "throttle")], injected
    slowed, peer = _plain_rows(out, 1), _plain_rows(out, 0)
    first = next(i for i, r in enumerate(slowed) if r[0] > injected[0]["ts"]) + 1
    pairs = list(zip(slowed[first:], peer[first:], strict=False))
    got = {"steps": len(pairs), "output": output}
    for i, name in enumerate(("compute", "sleep", "allreduce"), start=1):
        got[f"slowed_{name}"] = statistics.median(s[i] for s, _ in pairs)
        got[f"peer_{name}"] = statistics.median(p[i] for _, p in pairs)
    got["slowed_step"] = statistics.median(
        b[0] - a[0] for a, b in zip(slowed[first:], slowed[first + 1:], strict=False))
    return got


def test_a_throttled_plain_script_s_compute_takes_factor_times_the_peers(tmp_path):
    """No sections: the launcher stops rank 1 for 2x each slice of its work. Its ~40 ms of
    compute (timed in the script) takes ~3x its peer's; its 10 ms sleep is not stretched."""
    idle = 0.01
    got = _throttled_run(tmp_path, idle)
    ratio = got["slowed_compute"] / got["peer_compute"]
    print(f"medians over {got['steps']} steps (ms): compute slowed "
          f"{got['slowed_compute'] * 1e3:.2f} peer {got['peer_compute'] * 1e3:.2f} "
          f"(x{ratio:.2f}); sleep slowed {got['slowed_sleep'] * 1e3:.2f} peer "
          f"{got['peer_sleep'] * 1e3:.2f}; all-reduce slowed "
          f"{got['slowed_allreduce'] * 1e3:.2f} peer {got['peer_allreduce'] * 1e3:.2f}; "
          f"step {got['slowed_step'] * 1e3:.2f}")
    # Loose: both ranks' work also varies with the load on 2 shared cores, and a rank
    # continued after a stop is run before its busy neighbours, so on a loaded machine the
    # peer's compute can double. Seen on a 2-core machine at load 3-6: x2.2-3.8. Work much
    # shorter than a kernel tick (a loop of ~2 ms compute and an all-reduce alone) is not
    # asserted: x2.4-3.3 on an idle machine, but x0.98-1.41 with 3 busy processes beside it.
    # The same held for ~10 ms of work under the whole suite with every core busy (x0.65:
    # the launcher's reads of the rank's state wait their turn for a core too, so a slice
    # of work shorter than the scheduler's share can pass unseen): ~40 ms gives it room.
    assert 1.5 < ratio < 6.0, got["output"][-2000:]
    # A stop that begins at the end of the work runs on into the sleep, by one stop at most.
    assert got["slowed_sleep"] < idle + DEFAULT_MAX_STOP_S, got


def test_the_rank_s_own_report_of_a_slowdown_is_checked():
    ok = parse_agent_fault(json.dumps({"fault_type": "rank_slow", "at": 5.0, "factor": 3.0,
                                       "duration": None}))
    assert ok == {"fault_type": "rank_slow", "at": 5.0, "factor": 3.0, "duration": None,
                  "by": "sections"}
    for bad in ({"fault_type": "rank_slow", "at": 5.0, "factor": "fast"},
                {"fault_type": "rank_slow", "at": 5.0, "factor": 3.0, "duration": "inf"}):
        assert parse_agent_fault(json.dumps(bad)) is None
