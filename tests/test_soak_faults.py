"""The snapshot soak's fault plan (scripts/soak_faults.py): pure logic, no processes."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from soak_faults import (  # noqa: E402
    JobState,
    can_inject,
    choose,
    default_faults,
    next_gap,
    node_role,
    parse_faults,
    recovery_times,
)

WHOLE = JobState(ranks_running=2, world_size=2, world_nodes=2, spares=1)


def test_faults_parsed_and_node_faults_need_two_nodes():
    assert parse_faults("kill, stop", 1) == ["kill", "stop"]
    assert parse_faults(default_faults(2), 2) == ["kill", "stop", "freeze", "node_kill"]
    assert parse_faults(default_faults(1), 1) == ["kill", "stop"]
    with pytest.raises(ValueError, match="need --nodes 2"):
        parse_faults("kill,freeze", 1)
    with pytest.raises(ValueError, match="unknown fault 'oops'"):
        parse_faults("kill,oops", 2)
    with pytest.raises(ValueError, match="names no fault"):
        parse_faults(" , ", 2)


def test_gaps_average_every_within_half_either_way():
    rng = random.Random(1)
    gaps = [next_gap(rng, 30) for _ in range(2000)]
    assert 15 <= min(gaps) and max(gaps) <= 45
    assert sum(gaps) / len(gaps) == pytest.approx(30, rel=0.03)


def test_kinds_drawn_uniformly_and_the_same_for_a_seed():
    kinds = ["kill", "stop", "freeze", "node_kill"]
    draws = [choose(random.Random(7), kinds) for _ in range(3)]
    assert len(set(draws)) == 1  # a seed replays
    counts = Counter(choose(rng, kinds) for rng in [random.Random(3)] for _ in range(4000))
    assert set(counts) == set(kinds) and min(counts.values()) > 850


def test_a_fault_waits_for_a_whole_training_job_and_a_node_fault_for_a_spare():
    assert can_inject("kill", WHOLE, 2) and can_inject("freeze", WHOLE, 2)
    no_spare = JobState(2, 2, 2, 0)
    assert can_inject("stop", no_spare, 2) and not can_inject("node_kill", no_spare, 2)
    between_cycles = JobState(1, 2, 2, 1)
    assert not can_inject("kill", between_cycles, 2)
    node_missing = JobState(2, 2, 1, 1)  # a rank count can be whole with one node short
    assert not can_inject("stop", node_missing, 2)
    recovering = JobState(2, 2, 2, 1, recovering=True)
    assert not can_inject("kill", recovering, 2) and not can_inject("freeze", recovering, 2)
    assert can_inject("stop", JobState(2, 2, 1, 0), 1)  # one launcher, no spare needed


def test_a_launchers_role_is_its_last_telling_event():
    assert node_role([]) == "starting"
    assert node_role(["launcher_started", "rendezvous_done", "first_step"]) == "world"
    assert node_role(["launcher_started", "spare_waiting"]) == "spare"
    assert node_role(["spare_waiting", "spare_admitted", "restart"]) == "world"
    assert node_role(["rendezvous_done", "node_dropped"]) == "rejoining"
    assert node_role(["rendezvous_done", "node_dropped", "spare_waiting"]) == "spare"
    assert node_role(["rendezvous_done", "launcher_exited"]) == "gone"


def test_recovery_is_the_last_ranks_first_step_after_the_fault():
    firsts = [(1.0, 0), (1.1, 1),  # cycle 0
              (20.0, 1), (20.3, 0),  # after the fault at 15
              (40.0, 0),  # after the fault at 35 only rank 0 so far
              ]
    assert recovery_times([15.0, 35.0], firsts, 2) == [pytest.approx(5.3), None]
    assert recovery_times([0.5], [(3.0, 0), (2.0, 1), (9.0, 1)], 2) == [pytest.approx(2.5)]
