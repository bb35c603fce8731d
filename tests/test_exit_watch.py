"""The stuck-exit rule (``hang/exit_watch.py``) on a fake clock."""

from ft_launcher.hang.exit_watch import EXIT_GRACE_S, ExitWatch


def test_a_rank_that_said_goodbye_after_a_clean_exit_is_overdue_after_the_grace():
    w = ExitWatch()
    assert w.overdue(10.0, True, {1}, {0, 1}) == [] and w.deadline() == 10.0 + EXIT_GRACE_S
    assert w.overdue(10.0 + EXIT_GRACE_S - 0.01, True, {1}, {0, 1}) == []
    assert w.overdue(10.0 + EXIT_GRACE_S, True, {1}, {0, 1}) == [1]


def test_no_wait_without_a_clean_exit_or_while_a_live_rank_has_not_said_goodbye():
    w = ExitWatch(grace_s=5.0)
    assert w.overdue(0.0, False, {0, 1}, {0, 1}) == [] and w.deadline() is None
    assert w.overdue(0.0, True, {1, 2}, {0, 1}) == [] and w.deadline() is None
    assert w.overdue(100.0, True, set(), {0, 1}) == [] and w.deadline() is None


def test_the_wait_starts_again_when_its_condition_lapses():
    w = ExitWatch(grace_s=5.0)
    w.overdue(0.0, True, {1}, {1})
    w.overdue(3.0, True, {1}, set())  # connected again (a second fit()): no longer done
    assert w.deadline() is None
    assert w.overdue(4.0, True, {1}, {1}) == [] and w.deadline() == 9.0
    assert w.overdue(9.0, True, {1, 2}, {1, 2}) == [1, 2]


def test_a_grace_of_zero_waits_forever():
    w = ExitWatch(grace_s=0.0)
    assert w.overdue(0.0, True, {1}, {1}) == [] and w.overdue(1e9, True, {1}, {1}) == []
    assert w.deadline() is None
