"""The default snapshot frequency: the rules (ft_agent/snapshot_frequency.py, pure), the
launcher's agreement (ft_launcher/snapshots/coordinator.py) on a fake clock, the ranks'
switch at the same iteration, and the decoders of what the ranks and the other nodes send.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ft_agent import snapshot as store
from ft_agent.snapshot_client import SnapshotAgent, settings_from_env
from ft_agent.snapshot_frequency import (
    LOWER_AFTER_S,
    Grid,
    Measure,
    Meter,
    extend,
    node_busy,
    settle,
    start_of,
    wanted_every,
)
from ft_agent.snapshot_retention import Plan, decode_plan
from ft_launcher.snapshots import reports
from ft_launcher.snapshots.coordinator import (
    MEASURE_WAIT_S,
    Coordinator,
    Cost,
    FrequencyState,
    NodeSummary,
    World,
    decode_summary,
    encode_summary,
    holdings,
    next_frequency,
)

# -- the rules ------------------------------------------------------------------------------


def test_the_grid_is_the_first_call_at_or_past_each_point():
    grid = Grid(((10, 5), (30, 2)))
    assert not grid.due(9, None)  # before the agreed frequency starts
    assert grid.due(10, None) and not grid.due(12, 10) and grid.due(15, 12)
    assert grid.due(17, 12)  # 15 was not offered: the first call past it
    assert not grid.due(29, 27) and grid.due(30, 29) and not grid.due(31, 30)
    assert grid.due(32, 30)
    assert extend(((10, 5), (30, 2)), 25, 4) == ((10, 5), (25, 4))
    assert extend(((1, 1), (2, 1), (3, 1)), 9, 2) == ((2, 1), (3, 1), (9, 2))


def test_the_interval_keeps_the_cost_under_the_budget():
    # 4 ms of blocking on a 100 ms step is 4 %: every 2 steps for a 2 % budget
    assert wanted_every({0: (0.004, 0.1)}, 0.02) == 2
    assert wanted_every({0: (0.002, 0.1)}, 0.02) == 1  # exactly the budget
    assert wanted_every({0: (0.0001, 0.1), 1: (0.03, 0.1)}, 0.02) == 15  # the dearest rank
    assert wanted_every({}, 0.02) == 1
    m = Measure(blocking_s=0.017, commit_s=0.017, step_s=1.0, cpu=1.0)
    assert m.cost_s(busy=False) == 0.017 and m.cost_s(busy=True) == 0.034
    assert node_busy([1.0, 1.0], cores=2) and not node_busy([0.1, 0.2], cores=4)
    assert node_busy([1.0, 1.0, 1.5], cores=4)  # less than a core idle
    # Ranks in step that compute half of each step, on as many cores: their compute takes
    # every core at the same moments, whatever the average.
    assert node_busy([0.5, 0.5], cores=2) and not node_busy([0.5], cores=2)
    assert not node_busy([1.0] * 8, cores=16)


def test_the_interval_rises_at_once_and_falls_only_when_it_pays_and_has_held():
    assert settle(None, 3, 0.0, 0.0) == 3
    assert settle(3, 5, 1.0, 0.0) == 5  # over budget: at once
    assert settle(6, 4, 100.0, 0.0) == 6  # not half: wobble
    assert settle(6, 3, LOWER_AFTER_S - 1, 0.0) == 6  # half, but too soon
    assert settle(6, 3, LOWER_AFTER_S, 0.0) == 3


def test_a_change_takes_effect_far_enough_ahead():
    assert start_of(100, 0.1) == 110  # a second of steps
    assert start_of(100, 5.0) == 102  # at least two steps
    assert start_of(100, 0.0) == 102


def test_the_meter_measures_copies_commits_steps_and_the_ranks_own_cpu():
    m = Meter()
    m.call(1, now=0.0, cpu=0.0)
    m.blocked(0.010)
    assert m.measure() is None
    m.commit(0.020)
    m.call(2, now=0.5, cpu=0.5)
    m.call(3, now=1.0, cpu=0.9)  # over the last second: 0.9 s of CPU, 0.02 s of it a commit
    assert m.measure() is None  # two steps: the start-up may still be in them
    m.call(5, now=2.0, cpu=1.3)  # two steps in one call
    assert m.measure() == Measure(0.010, 0.020, 0.5, pytest.approx(0.4))
    m.commit(0.1)
    m.call(6, now=3.0, cpu=2.0)  # 0.7 s of CPU in that second, 0.1 s of it a commit
    assert m.measure() == Measure(0.010, pytest.approx(0.06), 0.5, pytest.approx(0.6))


@pytest.mark.parametrize("numel", [100, store.INLINE_BYTES // 4 + 1], ids=["small", "large"])
def test_a_rank_measures_the_whole_call_and_a_commit_inside_it_once(tmp_path, numel):
    """What a snapshot costs the step is the whole ``snapshot()`` call, whatever part of it
    the store times; a small state's commit, inside that call, is not counted again."""
    sent: list[dict] = []
    a = SnapshotAgent(settings_from_env({"FT_SNAPSHOT_DIR": str(tmp_path / "r"),
                                         "FT_SNAPSHOT_EVERY": "1"}),
                      lambda what, msg: sent.append(json.loads(msg)))
    state = {"w": torch.ones(numel)}
    a.snapshot(state, 0)  # makes the store; the slot's memory is claimed meanwhile
    a.store.wait()
    plain = a.store.snapshot

    def slow(*args, **kwargs):
        time.sleep(0.05)  # not in the store's own time
        return plain(*args, **kwargs)

    a.store.snapshot = slow
    for it in range(1, 6):
        assert a.snapshot(state, it).started
        a.store.wait()
    measures = [m for m in sent if m["kind"] == "measure"]
    assert measures, sent
    m = measures[-1]
    assert m["blocking_s"] >= 0.05
    assert (m["commit_s"] == 0) == (numel == 100), m
    a.close()


# -- the launcher's agreement, one node, a fake clock ----------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def coordinator(tmp_path: Path, ranks: int = 2, budget: float = 0.02, cores: int = 4
                ) -> tuple[Coordinator, list[tuple[str, dict]], Clock]:
    evs: list[tuple[str, dict]] = []
    clock = Clock()
    c = Coordinator(tmp_path, auto=True, budget=budget, cores=cores, clock=clock,
                    events=lambda name, **f: evs.append((name, f)))
    c.begin_cycle({r: [] for r in range(ranks)}, None, World(tuple(range(ranks)), ranks), 0,
                  None)
    return c, evs, clock


def measure(c: Coordinator, rank: int, at: int, blocking: float, step: float,
            commit: float = 0.0, cpu: float = 0.1) -> None:
    c.on_measure(rank, {"iteration": at, "blocking_s": blocking, "commit_s": commit,
                        "step_s": step, "cpu": cpu})


def plan_file(tmp_path: Path) -> Plan:
    plan = decode_plan((tmp_path / "plan.json").read_bytes())
    assert plan is not None
    return plan


def test_the_ranks_agree_on_one_interval_announced_ahead_of_every_rank(tmp_path):
    c, evs, clock = coordinator(tmp_path)
    measure(c, 0, at=3, blocking=0.004, step=0.1)
    assert plan_file(tmp_path).grid == ()  # rank 1 has not measured yet
    measure(c, 1, at=4, blocking=0.006, step=0.1)
    # rank 1's 6 ms on 100 ms steps: every 3 steps, from a second of steps past step 4
    assert plan_file(tmp_path).grid == ((14, 3),)
    (name, fields), = evs
    assert name == "snapshot_frequency"
    assert fields == {"every": 3, "start": 14, "previous": None, "reason": "first measure",
                      "rank": 1, "blocking_s": 0.006, "commit_s": 0.0,
                      "commit_counted": False, "step_s": 0.1, "budget": 0.02,
                      "overhead": 0.02, "ranks_measured": 2}
    # Dearer now (the machine got busy): more steps between snapshots at once.
    clock.t += 5
    measure(c, 0, at=60, blocking=0.010, step=0.1)
    assert plan_file(tmp_path).grid == ((14, 3), (70, 5))
    assert evs[-1][1]["reason"] == "over budget" and evs[-1][1]["previous"] == 3
    # Cheaper again: only once the interval has held LOWER_AFTER_S, and by half or more.
    measure(c, 0, at=80, blocking=0.001, step=0.1)
    measure(c, 1, at=80, blocking=0.001, step=0.1)
    assert plan_file(tmp_path).grid[-1] == (70, 5)
    clock.t += LOWER_AFTER_S
    measure(c, 1, at=400, blocking=0.001, step=0.1)
    assert plan_file(tmp_path).grid[-1] == (410, 1) and evs[-1][1]["reason"] == "cheaper"


def test_the_measuring_snapshot_counts_as_the_first_point_of_the_grid(tmp_path):
    c, evs, _ = coordinator(tmp_path)
    for r in (0, 1):
        c.on_held(r, [2], at=2)  # the snapshot each rank took to measure
    for r in (0, 1):
        measure(c, r, at=5, blocking=0.2, step=1.0)
    # Every 10 steps: the next point 10 steps after the measuring one, not at step 7 (two
    # steps ahead), which would make a short run pay one snapshot more than the budget.
    assert plan_file(tmp_path).grid == ((12, 10),) and evs[-1][1]["start"] == 12
    for r in (0, 1):
        c.on_held(r, [2, 12, 22], at=22)
    # With a grid in force, a dearer measure takes effect as soon as every rank can know.
    measure(c, 0, at=25, blocking=0.4, step=1.0)
    assert plan_file(tmp_path).grid == ((12, 10), (27, 20))


def test_a_copy_from_before_a_restart_further_back_does_not_delay_the_grid(tmp_path):
    c, _, _ = coordinator(tmp_path)
    # Iteration 40 was kept, but the script went back to its disk checkpoint (step 0).
    c.begin_cycle({0: [40], 1: [40]}, 40, World((0, 1), 2), 0, None)
    for r in (0, 1):
        c.on_held(r, [2, 40], at=2)
    for r in (0, 1):
        measure(c, r, at=5, blocking=0.2, step=1.0)
    assert plan_file(tmp_path).grid == ((12, 10),)  # not from 50


# (cores, each rank's CPU, interval, commit counted) for 2 ranks whose snapshot blocks 17 ms
# and whose commit takes 17 ms of CPU, on 1 s steps: counted, 34 ms is every 2 steps at 2 %.
@pytest.mark.parametrize(("cores", "cpu", "every", "counted"), [
    (2, 1.0, 2, True),  # every core busy
    (16, 1.0, 1, False),  # idle cores for the commit
    # Two ranks in step on 2 cores, computing half of each step: one core idle on average,
    # none while they compute, when the commit runs.
    (2, 0.5, 2, True),
], ids=["busy", "idle", "half"])
def test_the_commit_counts_when_the_node_has_no_idle_core(tmp_path, cores, cpu, every, counted):
    c, evs, _ = coordinator(tmp_path, cores=cores)
    measure(c, 0, at=3, blocking=0.017, step=1.0, commit=0.017, cpu=cpu)
    measure(c, 1, at=3, blocking=0.017, step=1.0, commit=0.017, cpu=cpu)
    assert plan_file(tmp_path).grid[-1][1] == every
    assert evs[-1][1]["commit_counted"] is counted


def test_a_rank_that_never_measures_is_waited_for_a_bounded_time(tmp_path):
    c, evs, clock = coordinator(tmp_path)
    measure(c, 0, at=3, blocking=0.001, step=0.1)
    clock.t += MEASURE_WAIT_S - 0.1
    measure(c, 0, at=50, blocking=0.001, step=0.1)
    assert plan_file(tmp_path).grid == ()
    clock.t += 0.2
    measure(c, 0, at=52, blocking=0.001, step=0.1)
    assert plan_file(tmp_path).grid == ((62, 1),) and evs[-1][1]["ranks_measured"] == 1


def test_a_new_cycle_starts_measuring_then_takes_up_the_known_interval(tmp_path):
    c, evs, _ = coordinator(tmp_path)
    measure(c, 0, at=3, blocking=0.004, step=0.1)
    measure(c, 1, at=3, blocking=0.004, step=0.1)
    c.begin_cycle({0: [20], 1: [20]}, 20, World((0, 1), 2), 0, None)
    plan = plan_file(tmp_path)
    assert (plan.pin, plan.floor, plan.grid) == (20, 21, ())  # the restored copy is pinned
    c.on_held(0, [20, 21], at=21)  # the first snapshot of the cycle
    assert plan_file(tmp_path).grid == ((31, 2),)
    assert evs[-1][1]["reason"] == "new cycle"


def test_a_fixed_frequency_announces_no_grid_but_moves_the_pin(tmp_path):
    c = Coordinator(tmp_path, auto=False, budget=0.02, events=lambda *a, **k: None)
    c.begin_cycle({0: [], 1: []}, None, World((0, 1), 2), 0, None)
    measure(c, 0, at=3, blocking=0.004, step=0.1)
    c.on_held(0, [1, 2], at=2)
    c.on_held(1, [2], at=2)
    plan = plan_file(tmp_path)
    assert (plan.pin, plan.floor, plan.grid) == (2, 3, ())


# -- several nodes: what the leader reads -----------------------------------------------------


def test_the_leader_combines_every_nodes_costs_and_holdings():
    world = World(tuple(range(4)), nproc=2, nodes=2, replicas=1)
    a = NodeSummary(0, {0: (5, 6), 1: (5, 6)}, {0: 7, 1: 7}, {2: (5,), 3: (5,)},
                    {0: Cost(0.001, 0.1, 0.001, 0.0, False)})
    b = NodeSummary(1, {2: (5, 6), 3: (5,)}, {2: 8, 3: 7}, {0: (6,), 1: (6,)},
                    {2: Cost(0.004, 0.1, 0.002, 0.002, True)}, failing=(0,))
    held = holdings(world, {0: a, 1: b})
    # node 1's pushes to node 0 fail: its ranks' replicas there do not count for now
    assert held == {"0": (5, 6), "0@1": (6,), "1": (5, 6), "1@1": (6,), "2": (5, 6),
                    "3": (5,)}
    state = FrequencyState()
    plan = next_frequency(Plan(), world, {0: a, 1: b}, state, 0.02, now=0.0)
    assert plan.grid == ()  # two ranks have not measured
    plan = next_frequency(Plan(), world, {0: a, 1: b}, state, 0.02, now=MEASURE_WAIT_S)
    assert plan.grid == ((18, 2),) and plan.why["rank"] == 2  # 4 ms: every 2 steps
    assert plan.why["commit_counted"] is True


def test_a_node_summary_round_trips():
    s = NodeSummary(3, {6: (1, 2), 7: ()}, {6: 9}, {1: (4,)},
                    {6: Cost(0.5, 1.0, 0.25, 0.25, True)}, (0, 1))
    assert decode_summary(encode_summary(s)) == s


@pytest.mark.parametrize("raw", [
    b"", b"\xff", b"[]", b"{}", b'{"v":2,"node":0}', b"x" * (2 << 20),
    json.dumps({"v": 1, "node": -1, "held": {}, "at": {}, "hosted": {}, "costs": {},
                "failing": []}),
    json.dumps({"v": 1, "node": 0, "held": {"x": [1]}, "at": {}, "hosted": {}, "costs": {},
                "failing": []}),
    json.dumps({"v": 1, "node": 0, "held": {"1": [1.5]}, "at": {}, "hosted": {}, "costs": {},
                "failing": []}),
    json.dumps({"v": 1, "node": 0, "held": {"1": list(range(50))}, "at": {}, "hosted": {},
                "costs": {}, "failing": []}),
    json.dumps({"v": 1, "node": 0, "held": {}, "at": {"1": True}, "hosted": {}, "costs": {},
                "failing": []}),
    json.dumps({"v": 1, "node": 0, "held": {}, "at": {}, "hosted": {},
                "costs": {"1": [1, 1, 1, 1, 1]}, "failing": []}),
    '{"v":1,"node":0,"held":{},"at":{},"hosted":{},"costs":{"1":[NaN,1,1,1,true]},'
    '"failing":[]}',
    json.dumps({"v": 1, "node": 0, "held": {}, "at": {}, "hosted": {},
                "costs": {"1": [1e9, 1, 1, 1, True]}, "failing": []}),
    json.dumps({"v": 1, "node": 0, "held": {}, "at": {}, "hosted": {}, "costs": {},
                "failing": "0"}),
])
def test_a_malformed_node_summary_is_refused(raw):
    assert decode_summary(raw) is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c,
                                                                         max_size=4),
                    max_leaves=30))
def test_decode_summary_never_raises(obj):
    decode_summary(json.dumps({"v": 1, "node": 0, "held": obj, "at": obj, "hosted": obj,
                               "costs": obj, "failing": obj}))
    decode_summary(json.dumps(obj))


# -- the ranks' reports of what they hold and what a snapshot costs -------------------------


def test_held_and_measure_reports_decode():
    assert reports.decode(json.dumps({"kind": "held", "held": [3, 1], "at": 4})) == (
        "held", {"held": [1, 3], "at": 4})
    assert reports.decode(json.dumps({"kind": "measure", "iteration": 9, "blocking_s": 0.01,
                                      "commit_s": 0, "step_s": 0.1, "cpu": 1.5})) == (
        "measure", {"iteration": 9, "blocking_s": 0.01, "commit_s": 0.0, "step_s": 0.1,
                    "cpu": 1.5})


@pytest.mark.parametrize("message", [
    {"kind": "held", "held": [1, 2, 3, 4], "at": 4},
    {"kind": "held", "held": [1.0], "at": 4},
    {"kind": "held", "held": "1", "at": 4},
    {"kind": "held", "held": [1], "at": None},
    {"kind": "held", "held": [True], "at": 1},
    {"kind": "held", "held": [2**70], "at": 1},
    {"kind": "measure", "iteration": 1, "blocking_s": -1, "commit_s": 0, "step_s": 1, "cpu": 0},
    {"kind": "measure", "iteration": 1, "blocking_s": 0, "commit_s": 0, "step_s": 1e6,
     "cpu": 0},
    {"kind": "measure", "iteration": 1, "blocking_s": 0, "commit_s": 0, "step_s": 1,
     "cpu": 1e9},
    {"kind": "measure", "iteration": 1, "blocking_s": 0, "commit_s": 0, "step_s": 1},
    {"kind": "measure", "iteration": "1", "blocking_s": 0, "commit_s": 0, "step_s": 1,
     "cpu": 0},
])
def test_malformed_held_and_measure_reports_are_refused(message):
    assert reports.decode(json.dumps(message)) is None


def test_the_service_hands_held_and_measure_reports_to_the_plan(tmp_path):
    from ft_launcher.snapshots.service import JobSnapshots, SnapshotOptions  # noqa: PLC0415

    (tmp_path / "shm").mkdir()
    evs: list[tuple[str, dict]] = []
    job = JobSnapshots(SnapshotOptions(), "run", tmp_path / "run", tmp_path / "ipc",
                       lambda name, **f: evs.append((name, f)), 2, shm=tmp_path / "shm")
    env = job.begin_cycle([0, 1], 1)
    assert env[0]["FT_SNAPSHOT_EVERY"] == "auto"
    path = Path(env[0]["FT_SNAPSHOT_PLAN"])
    assert not path.parent.exists()  # made by the first rank to snapshot
    os.close(store.open_dir(env[0]["FT_SNAPSHOT_DIR"], create=True))  # as a rank's store
    for rank in (0, 1):
        job.on_report(rank, json.dumps({"kind": "held", "held": [1], "at": 1}))
        job.on_report(rank, json.dumps({"kind": "measure", "iteration": 3, "blocking_s": 0.001,
                                        "commit_s": 0.001, "step_s": 0.1, "cpu": 0.1}))
    plan = decode_plan(path.read_bytes())
    assert plan is not None and (plan.pin, plan.grid) == (1, ((13, 1),))
    assert [n for n, _ in evs if n not in ("snapshots_ready", "snapshot_picked")] == [
        "snapshot_frequency"]
    assert job.due(job.coordinator.clock()) is not None  # reports coming: read them soon
    job.close()
    assert not path.exists()


# -- the ranks switch at the same iteration ----------------------------------------------------


def agent(directory: Path, plan: Path) -> tuple[SnapshotAgent, list[dict]]:
    sent: list[dict] = []
    settings = settings_from_env({"FT_SNAPSHOT_DIR": str(directory), "FT_SNAPSHOT_EVERY": "auto",
                                  "FT_SNAPSHOT_PLAN": str(plan)})
    assert settings is not None and settings.frequency is None
    return SnapshotAgent(settings, lambda what, msg: sent.append(json.loads(msg))), sent


def test_ranks_measure_once_then_follow_the_grid_the_launcher_writes(tmp_path):
    c, _, _ = coordinator(tmp_path)
    agents = [agent(tmp_path / f"rank_{r}", c.path) for r in (0, 1)]
    taken: dict[int, list[int]] = {0: [], 1: []}
    for it in range(1, 40):
        for r, (a, sent) in enumerate(agents):
            status = a.snapshot({"w": torch.full((4,), float(it))}, it)
            if status is not None:
                a.store.wait()
                if status.reason == "claim":  # the slot's memory first, in the background
                    continue
                assert status.started, status
                taken[r].append(it)
            for m in sent:  # what the launcher's loop would read
                if m["kind"] == "held":
                    c.on_held(r, m["held"], m["at"])
                elif m["kind"] == "measure":
                    measure(c, r, m["iteration"], m["blocking_s"], 0.1, m["commit_s"], m["cpu"])
            sent.clear()
    every = c.plan.grid[-1][1]
    start = c.plan.grid[-1][0]
    assert taken[0] == taken[1], taken  # the same iterations on both ranks
    assert taken[0][0] == 2  # the measuring snapshot, once the slot was claimed
    assert taken[0][1:] == list(range(start, 40, every))
    for a, _ in agents:
        a.close()


def test_ft_report_lists_each_frequency_the_ranks_agreed_on(tmp_path):
    from ft_launcher.observe.report import build_report, render_text  # noqa: PLC0415

    why = {"previous": None, "reason": "first measure", "rank": 1, "blocking_s": 0.006,
           "commit_s": 0.002, "commit_counted": False, "step_s": 0.1, "budget": 0.02,
           "overhead": 0.02, "ranks_measured": 2}
    evs = [{"ts": 1.0, "event": "launcher_started", "cycle": 0},
           {"ts": 2.0, "event": "snapshot_frequency", "cycle": 0, "every": 3, "start": 14,
            **why},
           {"ts": 9.0, "event": "snapshot_frequency", "cycle": 0, "every": 5, "start": 70,
            **why, "previous": 3, "reason": "over budget", "overhead": 0.0184}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    report = build_report(tmp_path)
    assert [(r["every"], r["start"], r["reason"]) for r in report["snapshot_frequency"]] == [
        (3, 14, "first measure"), (5, 70, "over budget")]
    text = render_text(report)
    assert "Snapshot frequency" in text
    row = next(line for line in text.splitlines() if "over budget" in line).split()
    assert row[:3] == ["0", "5", "70"] and row[-1] == "1.8%"
