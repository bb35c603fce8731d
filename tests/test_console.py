"""The console's rule (ft_launcher/observe/console.py): per-rank reports once, clock times."""

from __future__ import annotations

import time

from ft_launcher.observe.console import Console, clock_time


def test_a_checkpoint_reported_by_every_rank_is_shown_once_per_iteration():
    console = Console()
    shown = [console.line(0, "checkpoint_saved", {"rank": r, "iteration": it})[0]
             for it in (20, 40) for r in range(4)]
    assert shown == [True, False, False, False] * 2


def test_first_steps_are_shown_once_per_cycle_and_again_in_the_next_cycle():
    console = Console()
    assert [console.line(0, "first_step", {"rank": r, "iteration": 1})[0]
            for r in range(3)] == [True, False, False]
    assert console.line(1, "first_step", {"rank": 1, "iteration": 141})[0]


def test_an_event_a_person_acts_on_is_always_shown():
    console = Console()
    lines = [console.line(0, "worker_exited", {"rank": 1, "exit_code": -9}) for _ in range(2)]
    assert lines == [(True, "cycle 0: worker_exited rank=1 exit_code=-9")] * 2


def test_epoch_seconds_read_as_clock_times_and_timeouts_are_left_out():
    at = 1_764_660_000.25
    _, line = Console().line(2, "training_started", {"at": at, "timeouts": {"x": 1}})
    assert line == f"cycle 2: training_started at={clock_time(at)}"
    assert clock_time(at) == time.strftime("%H:%M:%S", time.localtime(int(at))) + ".250"
    # a count is not a time
    assert Console().line(0, "restart", {"restarts_at": 3})[1].endswith("restarts_at=3")
