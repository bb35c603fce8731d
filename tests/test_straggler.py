"""Straggler detector (ft_launcher/stragglers/straggler.py): synthetic section times, fake clock.

The timing rules live here; tests/test_straggler_e2e.py proves the wiring under a real
launcher. A "step" is one section time per rank, then one evaluate(), as the supervisor does.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_launcher.stragglers.straggler import (
    CLEARED,
    DETECTED,
    StragglerDetector,
    scores,
    speed_table,
)

BASE_S = 0.1


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(det: StragglerDetector, ranks: int, steps: int, duration, start: int = 0):
    """Feed ``steps`` steps; ``duration(step, rank)`` gives each section time. Returns
    [(step, event)] for every transition."""
    out = []
    for step in range(start, start + steps):
        for rank in range(ranks):
            assert det.observe(rank, "compute", duration(step, rank))
        out += [(step, e) for e in det.evaluate()]
    return out


def noisy(rng: random.Random, spike_p: float = 0.05):
    """Jitter of +-20 % on every rank, and 3x spikes with probability ``spike_p``."""
    def duration(step: int, rank: int) -> float:
        value = BASE_S * rng.uniform(0.8, 1.2)
        return value * 3 if rng.random() < spike_p else value
    return duration


@pytest.mark.parametrize("factor", [2, 3])  # 3: what rank_slow:factor=3 does to a step
@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_a_2x_or_3x_slow_rank_is_named_within_20_steps_of_onset(ranks, seed, factor):
    rng = random.Random(seed)
    victim, onset = rng.randrange(ranks), 60
    base = noisy(rng)

    def duration(step, rank):
        return base(step, rank) * (factor if rank == victim and step >= onset else 1)

    events = run(StragglerDetector(host="node-a"), ranks, 120, duration)
    assert events, "the slow rank was never reported"
    step, first = events[0]
    assert (first.event, first.rank, first.host, first.section) == (DETECTED, victim,
                                                                    "node-a", "compute")
    assert onset <= step < onset + 20, f"detected {step - onset} steps after onset"
    assert first.score > 1.3 and first.window == 12 and first.steps == step + 1
    assert math.isclose(first.score, first.median_s / first.reference_s)
    assert [e.event for _, e in events] == [DETECTED], "one report, no flapping"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.sampled_from([2, 3, 4, 8]),
       burst=st.integers(0, 5))
def test_noise_is_never_reported(seed, ranks, burst):
    """Jitter, 3x spikes on any rank, and short bursts of 3x on one rank (up to a quarter
    of the window in a row): medians ride over all of it."""
    rng = random.Random(seed)
    base = noisy(rng)
    burst_rank, burst_at = rng.randrange(ranks), rng.randrange(50, 250)

    def duration(step, rank):
        in_burst = rank == burst_rank and burst_at <= step < burst_at + burst
        return base(step, rank) * (3 if in_burst else 1)

    det = StragglerDetector()
    assert run(det, ranks, 300, duration) == []
    assert det.stragglers() == []


def test_a_rank_slower_than_the_threshold_allows_is_not_a_straggler():
    det = StragglerDetector(threshold=1.3)
    assert run(det, 4, 200, lambda s, r: BASE_S * (1.15 if r == 2 else 1.0)) == []
    assert det.scores()[2] == pytest.approx(1.15)


def test_a_transient_slowdown_is_detected_then_cleared():
    rng = random.Random(7)
    base = noisy(rng)
    onset, end = 40, 100

    def duration(step, rank):
        return base(step, rank) * (2 if rank == 1 and onset <= step < end else 1)

    det = StragglerDetector()
    events = run(det, 4, 200, duration)
    assert [(e.event, e.rank) for _, e in events] == [(DETECTED, 1), (CLEARED, 1)]
    (detected_at, _), (cleared_at, cleared) = events
    assert onset <= detected_at < onset + 20
    assert end <= cleared_at < end + 20
    assert cleared.score < det.clear_threshold
    assert det.stragglers() == []


def test_hysteresis_keeps_a_straggler_between_the_thresholds():
    # Slow from the first step; baseline_steps=window: no horizon to wait out (its own tests).
    det = StragglerDetector(threshold=1.3, baseline_steps=12)  # clears below 1.15
    slow = {"factor": 2.0}
    events = run(det, 2, 60, lambda s, r: BASE_S * (slow["factor"] if r == 1 else 1))
    assert [e.event for _, e in events] == [DETECTED]
    slow["factor"] = 1.2  # between the two thresholds: neither reported again nor cleared
    assert run(det, 2, 60, lambda s, r: BASE_S * (slow["factor"] if r == 1 else 1),
               start=60) == []
    assert det.stragglers() == [1]
    slow["factor"] = 1.0
    assert [e.event for _, e in run(det, 2, 60, lambda s, r: BASE_S, start=120)] == [CLEARED]


def test_never_decided_on_fewer_than_the_window():
    """Slow from the very first step: nothing can be said before every rank has a full
    window, then it takes confirm_steps more (no horizon to wait out: baseline_steps=window)."""
    det = StragglerDetector(window=20, baseline_steps=20)
    events = run(det, 2, 60, lambda s, r: BASE_S * (3 if r == 0 else 1))
    assert [(e.event, e.rank) for _, e in events] == [(DETECTED, 0)]
    step, first = events[0]
    assert first.steps >= 20 + det.confirm_steps
    det = StragglerDetector(window=20, baseline_steps=20)
    assert run(det, 2, 19, lambda s, r: BASE_S * (3 if r == 0 else 1)) == []
    assert det.scores() == {} and det.local_medians() == {}


def test_a_single_rank_has_nobody_to_be_slow_against():
    det = StragglerDetector(window=5)
    assert run(det, 1, 50, lambda s, r: BASE_S) == []
    assert det.scores() == {}


def test_evaluating_rarely_still_counts_steps_not_calls():
    det = StragglerDetector(window=10, baseline_steps=10)
    for _ in range(10):
        for rank in (0, 1):
            det.observe(rank, "compute", BASE_S * (2 if rank == 1 else 1))
    assert det.evaluate() == []  # crossed; confirm_steps (2) steps still to come
    assert det.evaluate() == [], "another call without new steps confirms nothing"
    for _ in range(2):
        for rank in (0, 1):
            det.observe(rank, "compute", BASE_S * (2 if rank == 1 else 1))
    assert [e.rank for e in det.evaluate()] == [1]


def test_remote_medians_count_until_they_age_out():
    clock = Clock()
    # remote_settle_s=0: the wait for medians read after the excess is tested below.
    det = StragglerDetector(window=5, now=clock, remote_ttl_s=30, host="node-b",
                            baseline_steps=5, remote_settle_s=0)
    for rank, host in ((0, "node-a"), (1, "node-a"), (2, "node-c")):
        assert det.observe_remote(rank, host, BASE_S)
    events = run(det, 0, 0, None)
    for _ in range(10):
        det.observe(3, "compute", 2 * BASE_S)
        events += det.evaluate()
    assert [(e.event, e.rank, e.host) for e in events] == [(DETECTED, 3, "node-b")]
    assert events[0].score == pytest.approx(2.0)
    rows = {r["rank"]: r for r in det.speed_table()}
    assert rows[0]["host"] == "node-a" and rows[3]["straggler"] and rows[3]["speed"] == 0.5
    clock.t += 31  # the other nodes went quiet: nobody left to compare with
    assert det.medians() == {3: pytest.approx(2 * BASE_S)} and det.scores() == {}
    assert det.evaluate() == [] and det.stragglers() == [3]


def test_a_local_rank_beats_a_remote_entry_of_the_same_number():
    det = StragglerDetector(window=3)
    det.observe_remote(0, "elsewhere", 100.0)
    for _ in range(3):
        det.observe(0, "compute", BASE_S)
        det.observe(1, "compute", BASE_S)
    assert det.medians() == {0: BASE_S, 1: BASE_S}


@pytest.mark.parametrize("rank, section, seconds", [
    (0, "step", 0.1), (0, "compute", math.nan), (0, "compute", math.inf),
    (0, "compute", -0.1), (0, "compute", "0.1"), (True, "compute", 0.1), (-1, "compute", 0.1),
    (0, "compute", 1e12), (0.0, "compute", 0.1),
])
def test_untrusted_values_are_ignored(rank, section, seconds):
    det = StragglerDetector(window=3)
    assert det.observe(rank, section, seconds) is False
    assert det.observe_remote(rank, "h", seconds) is (section == "step" and rank == 0)
    assert det.local_medians() == {}


def test_forget_drops_an_exited_rank():
    det = StragglerDetector(window=3)
    run(det, 3, 5, lambda s, r: BASE_S)
    det.forget(2)
    assert set(det.medians()) == {0, 1}


@pytest.mark.parametrize("kwargs, words", [
    ({"threshold": 1.0}, "threshold must be a finite number > 1"),
    ({"threshold": math.nan}, "threshold must be a finite number > 1"),
    ({"window": 2}, "window must be an integer >= 3"),
    ({"window": 5.0}, "window must be an integer >= 3"),
    ({"section": ""}, "section must be a non-empty name"),
    ({"clear_threshold": 1.5}, "clear_threshold must be in [1, threshold]"),
])
def test_bad_settings_are_rejected(kwargs, words):
    with pytest.raises(ValueError) as err:
        StragglerDetector(**kwargs)
    assert words in str(err.value)


def test_event_fields_are_json_ready():
    det = StragglerDetector(window=3, host="h", clock="device", baseline_steps=3)
    events = run(det, 2, 10, lambda s, r: BASE_S * (2 if r == 1 else 1))
    fields = events[0][1].fields()
    assert fields == {"rank": 1, "host": "h", "section": "compute", "score": 2.0,
                      "window": 3, "median_s": 0.2, "reference_s": 0.1,
                      "steps": fields["steps"], "clock": "device"}


def test_scores_leave_the_rank_itself_out():
    assert scores({0: 1.0, 1: 2.0}) == {0: 0.5, 1: 2.0}
    assert scores({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0})[3] == 2.0
    assert scores({0: 0.0, 1: 0.0}) == {}  # too short to time: no score
    assert scores({0: 1.0}) == {}


def test_speed_table_from_a_runs_events():
    events = [{"event": "launcher_started", "cycle": 0, "host": "n0"}] + [
        {"event": "interval_stats", "cycle": 0, "rank": r, "kind": "section:compute",
         "count": 50, "p50": p50, "min": 0, "p99": 1, "max": 1}
        for r, p50 in enumerate((0.1, 0.1, 0.2, 0.1))
    ] + [
        {"event": "interval_stats", "cycle": 0, "rank": 0, "kind": "heartbeat", "p50": 9.0,
         "count": 50},
        {"event": "straggler_detected", "cycle": 0, "rank": 2, "host": "n1",
         "section": "compute", "score": 2.0},
        {"event": "interval_stats", "cycle": 1, "rank": 0, "kind": "section:compute",
         "count": 7, "p50": 0.1},
        {"event": "interval_stats", "cycle": 1, "rank": 1, "kind": "section:compute",
         "count": 7, "p50": 0.1},
        {"event": "interval_stats", "cycle": 1, "rank": "x", "kind": "section:compute",
         "p50": 0.1},
        {"event": "interval_stats", "cycle": 1, "rank": 3, "kind": "section:compute",
         "p50": math.nan},
        {"cycle": 1},
    ]
    rows = speed_table(events)
    assert [(r["cycle"], r["rank"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                       (1, 0), (1, 1)]
    slow = rows[2]
    assert slow == {"cycle": 0, "rank": 2, "host": "n1", "median_s": 0.2, "score": 2.0,
                    "speed": 0.5, "straggler": True, "count": 50}
    assert rows[0]["score"] == 1.0 and not rows[0]["straggler"] and rows[0]["host"] == "n0"
    assert all(r["speed"] == 1.0 for r in rows[4:])
    assert speed_table(events, section="step") == []


# -- --ft-straggler-* options (ft_launcher/config.py, ft_launcher/cli.py) -----------------


def test_straggler_options_defaults_flags_and_yaml(tmp_path):
    from ft_launcher.cli import build_ft_config

    ft = build_ft_config(None, {})
    assert (ft.straggler_threshold, ft.straggler_action, ft.straggler_window,
            ft.straggler_section) == (1.3, "report", 12, "compute")
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  straggler_threshold: 1.5\n  straggler_window: 30\n"
                   "  straggler_action: exclude\n  straggler_section: fwd_bwd\n")
    ft = build_ft_config(str(cfg), {"straggler_action": "restart"})  # the flag wins
    assert (ft.straggler_threshold, ft.straggler_action, ft.straggler_window,
            ft.straggler_section) == (1.5, "restart", 30, "fwd_bwd")
    StragglerDetector(ft.straggler_threshold, ft.straggler_window, ft.straggler_section)


@pytest.mark.parametrize("flag, value, words", [
    ("--ft-straggler-threshold", "1", "must be greater than 1"),
    ("--ft-straggler-threshold", "0.5", "must be greater than 1"),
    ("--ft-straggler-threshold", "nan", "must be a finite number"),
    ("--ft-straggler-threshold", "slow", "expected a number"),
    ("--ft-straggler-window", "2", "must be in [3, 100000]"),
    ("--ft-straggler-window", "twenty", "expected an integer"),
    ("--ft-straggler-action", "kill", "expected one of report, restart, exclude"),
    ("--ft-straggler-section", " ", "expected a section name"),
])
def test_bad_straggler_options_are_one_error_naming_the_option(flag, value, words, tmp_path):
    from click.testing import CliRunner

    from ft_launcher.cli import cli

    script = tmp_path / "train.py"
    script.write_text("")
    result = CliRunner().invoke(cli, ["--ft-run-dir", str(tmp_path / "run"), flag, value,
                                      str(script)])
    assert result.exit_code == 1
    assert f"Error: {flag}: " in result.output and words in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_the_first_steps_of_a_rank_are_not_scored():
    d = StragglerDetector(threshold=1.3, window=5, warmup_steps=3)
    for rank in (0, 1):
        for _ in range(3):  # a slow start of rank 1 (allocator, a peer importing)
            d.observe(rank, "compute", 5.0 if rank == 1 else 1.0)
    assert d.local_medians() == {}
    for _ in range(5):
        for rank in (0, 1):
            d.observe(rank, "compute", 1.0)
    assert d.local_medians() == {0: 1.0, 1: 1.0}
    assert d.evaluate() == []


# -- robustness to scheduling noise (issue 14) ------------------------------------------
# Measured with tests/scripts/straggler_train.py under ft_launcher on this machine (2 cores,
# load average 3-15 from other engineers' tests), nothing slowed: in 2 ranks x 993 steps one
# healthy rank's 20-step median stayed 1.5-1.75x the other's for up to 33 steps in a row (5
# such episodes a minute); the old score (median only) reported 5 false stragglers in every
# clean run of 2, 4 and 8 ranks. A score alone cannot tell such an episode from a straggler;
# persistence within the window removes most: replayed through the detector, 0 false reports
# with 4 ranks (234 steps) and 8 ranks (271 steps), 2 with 2 ranks (993 steps, from 5).
# The window is 12 now (a 2x rank named 9-13 steps after the onset, end to end; 20 took
# 16-20), and a rank must also be slower than the others' usual and its own (the baseline
# horizon): 0 false reports replaying three 8-rank soaks (416-874 steps) and eight 2- and
# 4-rank runs before their onset, one (2 ranks, 20 ms steps, ~17 steps of one rank's
# slow mode while the other stayed fast) where the window of 20 had one more.


def test_an_uneven_excess_is_not_reported_where_a_median_alone_would_be():
    """Rank 0 is 1.8x slow on 60 % of its steps, 6 slow then 4 not (a scheduler's episode):
    its median is above 1.3 but no window has 70 % of its steps above (at most 8 of 12); the
    median-only rule (persist=0) reports it, the default does not."""
    slow_steps = {s for s in range(40, 140) if s % 10 < 6}

    def duration(step, rank):
        return BASE_S * (1.8 if rank == 0 and step in slow_steps else 1.0)

    assert run(StragglerDetector(), 2, 160, duration) == []
    median_only = run(StragglerDetector(persist=0, baseline_steps=12), 2, 160, duration)
    assert [(e.event, e.rank) for _, e in median_only][:1] == [(DETECTED, 0)]


def test_persistence_compares_each_step_with_the_same_step_of_the_others():
    """Steps shared by every rank (the machine slowed all of them) do not count against a
    rank: per step, rank 0 is never slower than the others, whatever its median."""
    det = StragglerDetector(window=10)
    shared = {2, 3, 5, 7, 8, 9}  # steps where every rank took 3x

    def duration(step, rank):
        return BASE_S * (3 if step in shared else 1) * (1.05 if rank == 0 else 1.0)

    run(det, 3, 10, duration)
    assert det.persistence(0, BASE_S) == 0.0
    # Against a fixed reference (no other local rank has these steps) they would count.
    lone = StragglerDetector(window=10)
    run(lone, 1, 10, duration)
    assert lone.persistence(0, BASE_S) == pytest.approx(0.6)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_a_2x_rank_passes_the_persistence_gate_under_jitter(ranks):
    rng = random.Random(ranks)
    base = noisy(rng, spike_p=0.1)

    def duration(step, rank):
        return base(step, rank) * (2 if rank == ranks - 1 and step >= 50 else 1)

    events = run(StragglerDetector(), ranks, 100, duration)
    assert [(e.event, e.rank) for _, e in events] == [(DETECTED, ranks - 1)]
    assert events[0][0] < 50 + 20


def test_a_peer_that_got_faster_does_not_make_a_straggler():
    """Measured with 2 ranks on this machine's 2 cores (20 ms steps, nothing slowed): one
    rank's sections ran 1.7x faster than usual for ~40 steps while the other's did not
    change. Score and persistence alike name the unchanged rank; it is slower than neither
    its own usual nor the other's, so it is not reported. With the baseline horizon cut to
    the window (the rule before the horizon), it would be."""
    def duration(step, rank):
        return BASE_S / 1.7 if rank == 1 and 150 <= step < 190 else BASE_S

    assert run(StragglerDetector(), 2, 260, duration) == []
    old_rule = run(StragglerDetector(baseline_steps=12), 2, 260, duration)
    assert [(e.event, e.rank) for _, e in old_rule][:1] == [(DETECTED, 0)]


def test_a_rank_slow_from_the_start_is_reported_after_half_the_horizon():
    """No onset to see: a rank 2x slow from its first step has no usual of its own to be
    slower than, so it is reported once it has been slower than the others' usual for half
    the baseline horizon (60 steps with the default window of 12), not before."""
    det = StragglerDetector()
    events = run(det, 2, 120, lambda step, rank: BASE_S * (2 if rank == 1 else 1))
    assert [(e.event, e.rank) for _, e in events] == [(DETECTED, 1)]
    assert det.baseline_steps == 120
    assert 60 <= events[0][0] < 60 + 20


def test_a_short_clean_past_is_enough_to_see_a_rank_get_slower():
    """A rank's own usual is its times before the current window: with only a window of clean
    steps behind it, a 2x onset is still named within 20 steps, not after half the horizon."""
    for window in (10, 12):
        events = run(StragglerDetector(window=window), 2, 60,
                     lambda step, rank, w=window: BASE_S * (2 if rank == 1 and step >= w else 1))
        assert [(e.event, e.rank) for _, e in events] == [(DETECTED, 1)], window
        assert events[0][0] < window + 20


def test_bad_baseline_is_rejected():
    with pytest.raises(ValueError, match="baseline_steps"):
        StragglerDetector(window=12, baseline_steps=11)


def test_bad_persist_is_rejected():
    for bad in (-0.1, 1.5, "0.7"):
        with pytest.raises(ValueError, match="persist"):
            StragglerDetector(persist=bad)


# -- device time -------------------------------------------------------------------------


def test_device_times_are_scored_once_every_rank_has_a_window_of_them():
    """Wall times say nothing (the host is shared evenly); the GPU times of rank 1 are 2x.
    Device times arrive a few steps late (the client reads completed CUDA events)."""
    det = StragglerDetector(window=10)
    events = []
    for step in range(60):
        for rank in (0, 1):
            det.observe(rank, "compute", BASE_S)
            if step >= 3:  # three steps late
                det.observe_device(rank, "compute", 0.05 * (2 if rank == 1 else 1))
        events += [(step, e) for e in det.evaluate()]
    assert det.active_clock() == "device"
    assert [(e.event, e.rank, e.clock) for _, e in events] == [(DETECTED, 1, "device")]
    step, first = events[0]
    assert first.median_s == pytest.approx(0.1) and first.reference_s == pytest.approx(0.05)
    assert step >= 3 + 10, "not before a full window of device times"


def test_wall_time_is_used_until_every_rank_reports_device_time():
    det = StragglerDetector(window=5)
    for _ in range(10):
        det.observe(0, "compute", BASE_S)
        det.observe(1, "compute", BASE_S)
        det.observe_device(0, "compute", 0.5)  # only rank 0 times its GPU
    assert det.active_clock() == "wall" and det.scores() == {0: 1.0, 1: 1.0}


@pytest.mark.parametrize("section, seconds", [("step", 0.1), ("compute", math.nan),
                                              ("compute", -1.0), ("compute", True)])
def test_untrusted_device_times_are_ignored(section, seconds):
    det = StragglerDetector(window=3)
    assert det.observe_device(0, section, seconds) is False


def test_remote_medians_of_another_clock_do_not_count():
    det = StragglerDetector(window=3)
    assert det.observe_remote(5, "node-a", BASE_S, clock="device")
    assert not det.observe_remote(6, "node-a", BASE_S, clock="cpu")
    run(det, 1, 3, lambda s, r: 2 * BASE_S)
    assert det.medians() == {0: 2 * BASE_S}, "a wall median is not compared with GPU time"
    assert det.medians("device") == {5: BASE_S}


# -- two nodes, one rank each: the reference is the other node's late median -------------

STEP_S, EXCHANGE_S = 0.02, 3.0  # a step every 20 ms; a median published/read every 3 s


def two_nodes(duration, steps: int, **kwargs):
    """Node a (rank 0) and node b (rank 1) in one synchronous job on one machine, each
    detector fed its rank's section times and the other node's median as the exchange
    delivers it (published every EXCHANGE_S, read every EXCHANGE_S half a period later).
    Returns {node: [(step, event)]}."""
    clock = Clock()
    dets = {n: StragglerDetector(threshold=2.0, window=10, now=clock, host=f"node-{n}",
                                 **kwargs) for n in "ab"}
    local = {"a": 0, "b": 1}
    published: dict[str, dict[int, float]] = {}
    out: dict[str, list] = {"a": [], "b": []}
    for step in range(steps):
        clock.t = 1000.0 + step * STEP_S
        for n, det in dets.items():
            det.observe(local[n], "compute", duration(step, local[n]))
        phase = round(step * STEP_S / EXCHANGE_S, 9)
        if phase == int(phase):
            published = {n: det.local_medians() for n, det in dets.items()}
        if phase - 0.5 == int(phase - 0.5):
            for n, det in dets.items():
                for rank, median in published.get("b" if n == "a" else "a", {}).items():
                    det.observe_remote(rank, "node-x", median)
        for n, det in dets.items():
            out[n] += [(step, e) for e in det.evaluate()]
    return out


def test_a_load_on_the_whole_machine_does_not_name_a_rank_alone_on_its_node():
    """The false report of the two-node end-to-end case: a burst of load (both ranks 3x for
    2 s, here between two reads of the exchange) made node a's healthy rank 3x its own past
    and 3x node b's last median, which was read before the burst; every rule held. Only a
    median read after the burst began shows node b's rank was as slow."""
    burst = range(610, 710)  # 12.2-14.2 s: just after a read at 10.5 s, before 13.5 s's

    def duration(step, rank):
        return 0.01 * (3 if step in burst else 1)

    got = two_nodes(duration, 1200)
    assert got == {"a": [], "b": []}
    # Without the wait for a median that covers the burst, both would have been named.
    got = two_nodes(duration, 1200, remote_settle_s=-math.inf)
    assert sorted({(n, e.rank) for n, evs in got.items() for _, e in evs}) == [
        ("a", 0), ("b", 1)]


def test_a_slow_rank_alone_on_its_node_is_still_named_once_the_medians_cover_it():
    onset = 600

    def duration(step, rank):
        return 0.01 * (3 if rank == 1 and step >= onset else 1)

    got = two_nodes(duration, 1500)
    assert got["a"] == []
    step, first = got["b"][0]
    assert (first.event, first.rank) == (DETECTED, 1)
    # 6 s to settle, a window's span, then the next read (every 3 s): within 10 s.
    assert 6.0 < (step - onset) * STEP_S <= 10.0, (step - onset) * STEP_S
