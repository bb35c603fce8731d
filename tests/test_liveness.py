"""Deadline rules of the liveness model and the timeout book, on a fake clock (no process)."""

from __future__ import annotations

import json
import math

import pytest

from ft_agent.protocol import HEARTBEAT_FOLD_S
from ft_launcher.config import FaultToleranceConfig
from ft_launcher.hang import blame
from ft_launcher.hang.liveness import STALL_SETTLE_S, Liveness
from ft_launcher.hang.timeouts import (
    AUTO_MIN_INTERVALS,
    AUTO_MIN_TIMEOUT_S,
    TimeoutBook,
    TimeoutValues,
    load_state,
    parse_timeouts,
    state_from_json,
)

T0 = 1000.0


def _model(ranks=(0,), **cfg) -> Liveness:
    cfg.setdefault("min_learned_timeout", 1.0)
    ft = FaultToleranceConfig(**{k: v for k, v in cfg.items()
                                 if k in FaultToleranceConfig.__dataclass_fields__})
    for k, v in cfg.items():  # fields another module may add to the config later
        setattr(ft, k, v)
    model = Liveness(TimeoutBook(ft))
    model.start_cycle({r: (r, T0) for r in ranks})
    return model


# -- initial timeout ---------------------------------------------------------------------


def test_initial_timeout_counts_from_spawn_not_from_connection():
    m = _model(initial_rank_heartbeat_timeout=10.0, rank_heartbeat_timeout=2.0)
    assert m.next_deadline() == T0 + 10.0
    assert m.check(T0 + 9.99) is None
    v = m.check(T0 + 10.0)
    assert (v.rank, v.timeout_kind, v.timeout_s, v.silence_s) == (0, "initial", 10.0, 10.0)


def test_a_rank_that_connected_but_never_heartbeats_is_judged_by_the_initial_timeout():
    m = _model(initial_rank_heartbeat_timeout=5.0, rank_heartbeat_timeout=1.0)
    m.reconnect(0)  # hello is not activity
    assert m.check(T0 + 4.9) is None
    assert m.check(T0 + 5.0).timeout_kind == "initial"


def test_without_any_timeout_nothing_is_judged():
    m = _model()
    assert m.next_deadline() is None and m.check(T0 + 1e6) is None


# -- heartbeats and stamps -----------------------------------------------------------------


def test_a_rank_that_folds_heartbeats_gets_the_fold_interval_on_its_deadline():
    """A rank that said ``folds`` may have folded its last heartbeat into the one read: its
    deadline allows for it, so no verdict comes before a true silence of the timeout. Its
    stamps still place every heartbeat; a rank that stops folding is judged exactly again."""
    m = _model(rank_heartbeat_timeout=2.0)
    m.heartbeat(0, T0 + 1.0, T0 + 1.0, folds=True)
    assert m.next_deadline() == T0 + 3.0 + HEARTBEAT_FOLD_S
    assert m.check(T0 + 3.0 + HEARTBEAT_FOLD_S / 2) is None
    v = m.check(T0 + 3.0 + HEARTBEAT_FOLD_S)
    assert v.timeout_kind == "heartbeat" and v.timeout_s == 2.0
    m.heartbeat(0, T0 + 4.0, T0 + 4.0)
    assert m.next_deadline() == T0 + 6.0


def test_heartbeat_deadline_moves_with_each_heartbeat():
    m = _model(rank_heartbeat_timeout=2.0)
    m.heartbeat(0, None, T0 + 1.0)
    assert m.next_deadline() == T0 + 3.0
    m.heartbeat(0, None, T0 + 2.5)
    assert m.check(T0 + 4.4) is None
    v = m.check(T0 + 4.5)
    assert v.timeout_kind == "heartbeat" and v.silence_s == 2.0


def test_a_stamp_from_the_future_cannot_postpone_the_deadline():
    m = _model(rank_heartbeat_timeout=2.0)
    m.heartbeat(0, T0 + 1e9, T0 + 1.0)  # stamped far ahead, read at T0+1
    assert m.next_deadline() == T0 + 3.0


def test_a_stamp_from_the_past_cannot_move_activity_backwards():
    m = _model(rank_heartbeat_timeout=2.0)
    m.heartbeat(0, T0 + 5.0, T0 + 5.0)
    m.heartbeat(0, T0 - 100.0, T0 + 5.5)  # older than the previous activity
    assert m.ranks[0].last_hb == T0 + 5.0
    assert m.ranks[0].samples["heartbeat"].lo == 0.0


@pytest.mark.parametrize("stamp", [math.nan, math.inf, -math.inf])
def test_a_non_finite_stamp_counts_as_read_time(stamp):
    m = _model(rank_heartbeat_timeout=2.0)
    m.heartbeat(0, stamp, T0 + 1.0)
    assert m.next_deadline() == T0 + 3.0


def test_a_queued_heartbeat_is_placed_at_its_send_time():
    """Messages drained in a batch keep their own times, so intervals are not skewed."""
    m = _model(rank_heartbeat_timeout=2.0)
    for sent in (1.0, 1.1, 1.2):
        m.heartbeat(0, T0 + sent, T0 + 1.25)
    assert m.ranks[0].samples["heartbeat"].hi == pytest.approx(0.1)


# -- sections ----------------------------------------------------------------------------


def test_section_and_out_of_section_deadlines():
    m = _model(rank_section_timeouts={"step": 3.0}, rank_out_of_section_timeout=1.0)
    m.section_open(0, "step", None, T0 + 1.0)
    assert m.next_deadline() == T0 + 4.0  # no out-of-section deadline while one is open
    assert m.section_close(0, "step", None, T0 + 2.0)
    assert m.next_deadline() == T0 + 3.0
    v = m.check(T0 + 3.0)
    assert v.timeout_kind == "out_of_section" and v.timeout_s == 1.0


def test_a_section_overrun_is_judged_by_its_own_timeout():
    m = _model(rank_section_timeouts={"step": 3.0, "ckpt": 60.0})
    m.section_open(0, "ckpt", None, T0)
    m.section_open(0, "step", None, T0 + 1.0)
    v = m.check(T0 + 4.0)
    assert v.timeout_kind == "section:step" and v.silence_s == 3.0


def test_sections_opened_and_closed_back_to_back():
    m = _model(rank_section_timeouts={"a": 1.0, "b": 1.0}, rank_out_of_section_timeout=1.0)
    t = T0
    for _ in range(1000):
        m.section_open(0, "a", t, t)
        m.section_close(0, "a", t, t)  # zero-length section, zero gap
        m.section_open(0, "b", t, t)
        m.section_close(0, "b", t, t)
        t += 1e-6
    assert m.check(t + 0.5) is None
    assert m.ranks[0].samples["section:a"].hi == 0.0
    assert m.check(t + 1.0).timeout_kind == "out_of_section"


def test_closing_an_unopened_section_is_reported_and_harmless():
    m = _model(rank_section_timeouts={"a": 1.0})
    assert m.section_close(0, "a", None, T0 + 0.1) is False
    assert m.ranks[0].sections == {}


def test_open_sections_and_section_names_per_rank_are_bounded():
    m = _model()
    for i in range(200):
        m.section_open(0, f"s{i}", None, T0 + i * 1e-3)
    assert len(m.ranks[0].sections) == 64 and m.rejected["too_many_open_sections"] == 136
    m.section_close_all(0, None, T0 + 1)
    for i in range(200):
        m.section_open(0, f"n{i}", None, T0 + 2)
        m.section_close(0, f"n{i}", None, T0 + 2)
    assert len(m.ranks[0].samples) <= 64


def test_goodbye_ends_judging_and_reconnect_restores_it():
    m = _model(rank_heartbeat_timeout=1.0)
    m.heartbeat(0, None, T0)
    m.goodbye(0)
    assert m.check(T0 + 100) is None and m.next_deadline() is None
    m.reconnect(0)
    assert m.check(T0 + 100).timeout_kind == "heartbeat"


def test_what_a_rank_sent_before_its_exit_counts_when_read_after_it():
    """The launcher can see a rank's exit before it reads the rank's last frames (seen
    under load: one section of 150 missing from interval_stats): they are still sampled,
    and still set no deadline."""
    m = _model(rank_heartbeat_timeout=1.0)
    m.heartbeat(0, T0, T0)
    m.section_open(0, "step", T0, T0)
    m.goodbye(0)  # the exit, seen first
    m.section_close(0, "step", T0 + 0.04, T0 + 5)
    m.heartbeat(0, T0 + 0.04, T0 + 5)
    stats = m.stats()[0]
    assert stats["section:step"]["count"] == 1 and stats["heartbeat"]["count"] == 1
    assert m.check(T0 + 100) is None and m.next_deadline() is None


def test_progress_is_activity_and_tracks_steps_and_checkpoints():
    m = _model(initial_rank_heartbeat_timeout=5.0)
    first = m.progress(0, 7, False, None, T0 + 1)
    assert first.first_step and not first.checkpoint
    again = m.progress(0, 10, True, None, T0 + 2)
    assert not again.first_step and again.checkpoint
    r = m.ranks[0]
    assert (r.iteration, r.checkpoint, r.first_activity) == (10, 10, T0 + 1)
    assert m.all_training() and m.check(T0 + 100) is None


# -- the launcher's stalls -----------------------------------------------------------------


def test_a_late_wake_up_holds_verdicts_until_queued_messages_are_read():
    m = _model(rank_heartbeat_timeout=2.0)
    m.heartbeat(0, None, T0)
    # The launcher meant to wake at T0+2 (the deadline) but ran again only at T0+12.
    assert m.woke(planned=T0 + 2.0, now=T0 + 12.0)
    assert m.check(T0 + 12.0) is None
    assert m.next_deadline() == T0 + 12.0 + STALL_SETTLE_S
    # The heartbeats the rank sent during the stall are read now, with their own stamps.
    for sent in range(1, 13):
        m.heartbeat(0, T0 + sent, T0 + 12.1)
    assert m.check(T0 + 12.0 + STALL_SETTLE_S) is None


def test_a_rank_really_silent_during_a_stall_is_judged_after_the_settle_time():
    m = _model(rank_heartbeat_timeout=2.0)
    m.heartbeat(0, None, T0)
    m.woke(planned=T0 + 2.0, now=T0 + 12.0)
    v = m.check(T0 + 12.0 + STALL_SETTLE_S)
    assert v is not None and v.silence_s == pytest.approx(12.0 + STALL_SETTLE_S)


def test_an_ordinary_wake_up_is_not_a_stall():
    m = _model(rank_heartbeat_timeout=2.0)
    assert not m.woke(planned=T0 + 2.0, now=T0 + 2.3)


# -- who is silent, who is blamed -------------------------------------------------------------


def test_silent_ranks_are_the_suspects():
    m = _model(ranks=(0, 1, 2), rank_heartbeat_timeout=2.0)
    m.heartbeat(0, None, T0 + 1.0)
    m.heartbeat(1, None, T0 + 1.1)
    m.heartbeat(2, None, T0 + 2.9)  # still active
    v = m.check(T0 + 3.0)
    assert v.rank == 0
    assert m.silent_ranks(v, T0 + 3.0) == {0: 2.0, 1: 1.9}


@pytest.mark.parametrize(("suspects", "rank", "why"), [
    ([blame.Suspect(0, 2.0, in_collective=True), blame.Suspect(1, 1.9, stopped=True)],
     1, "stopped"),
    ([blame.Suspect(0, 2.0, in_collective=True), blame.Suspect(1, 1.9, in_collective=False)],
     1, "not_in_collective"),
    ([blame.Suspect(0, 2.0, in_collective=True), blame.Suspect(1, 1.9, in_collective=True)],
     0, "oldest_activity"),
    ([blame.Suspect(0, 2.0), blame.Suspect(1, 2.5)], 1, "oldest_activity"),
])
def test_the_culprit_is_chosen_by_evidence(suspects, rank, why):
    chosen = blame.choose(suspects)
    assert (chosen.rank, chosen.why) == (rank, why)
    assert [s["rank"] for s in chosen.suspects] == sorted(s.rank for s in suspects)


def test_collective_frames_are_recognised_in_stack_dumps():
    gloo = ('Thread 0x7f (most recent call first):\n  File "/x/torch/distributed/'
            'distributed_c10d.py", line 2801 in all_reduce\n  File "train.py", line 40 in main')
    sleeping = 'Thread 0x7f (most recent call first):\n  File "train.py", line 12 in main'
    assert blame.in_collective(gloo) is True
    assert blame.in_collective(sleeping) is False
    assert blame.in_collective("") is None


# -- the timeout book --------------------------------------------------------------------


def _book(**cfg) -> TimeoutBook:
    ft = FaultToleranceConfig()
    for k, v in cfg.items():
        setattr(ft, k, v)
    return TimeoutBook(ft)


def test_heartbeat_timeout_is_learned_only_after_enough_intervals():
    book = _book(min_learned_timeout=1.0)
    for _ in range(AUTO_MIN_INTERVALS - 1):
        book.heartbeat_interval(0.1)
    assert book.timeout_for("heartbeat") is None
    book.heartbeat_interval(0.1)
    assert book.timeout_for("heartbeat") == AUTO_MIN_TIMEOUT_S


def test_calculated_values_have_a_floor():
    book = _book(min_learned_timeout=60.0)
    book.calculate("heartbeat", 1e-9)
    assert book.timeout_for("heartbeat") == 60.0
    book.set_values(TimeoutValues(ranks={"rank_heartbeat_timeout": 0.5}))
    assert book.explain("heartbeat") == (60.0, "calculated")


def test_a_configured_value_is_not_lowered_unless_the_user_says_so():
    book = _book(rank_heartbeat_timeout=5.0, min_learned_timeout=1.0)
    book.calculate("heartbeat", 0.2)  # 5 x 0.2 = 1 s
    assert book.explain("heartbeat") == (5.0, "configured (not lowered by a calculated value)")
    book.calculate("heartbeat", 2.0)  # 10 s: raising is fine
    assert book.timeout_for("heartbeat") == 10.0
    lowering = _book(rank_heartbeat_timeout=5.0, min_learned_timeout=1.0,
                     learned_timeouts_override=True)
    lowering.calculate("heartbeat", 0.2)
    assert lowering.timeout_for("heartbeat") == 1.0


def test_calculated_timeouts_only_grow():
    book = _book(min_learned_timeout=1.0)
    book.calculate("heartbeat", 2.0)
    book.calculate("heartbeat", 0.5)
    assert book.timeout_for("heartbeat") == 10.0


def test_learned_from_few_samples_still_respects_the_floor():
    book = _book(min_learned_timeout=30.0)
    book.calculate("section:step", 0.01)
    assert book.timeout_for("section:step") == 30.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0, 1e12, "5", True, [1]])
def test_set_timeouts_refuses_non_finite_and_absurd_values(bad):
    values, problems = parse_timeouts({"rank_heartbeat_timeout": bad})
    assert values.ranks == {} and problems


def test_set_timeouts_keeps_valid_values_and_names_invalid_ones():
    values, problems = parse_timeouts({"rank_heartbeat_timeout": 30,
                                       "rank_section_timeouts": {"step": 5, "x" * 500: 1},
                                       "bogus": 1, "initial_rank_heartbeat_timeout": None})
    assert values.ranks == {"rank_heartbeat_timeout": 30.0}
    assert values.sections == {"step": 5.0}
    assert len(problems) == 2


@pytest.mark.parametrize("content", [
    '{"version": 1, "calculated": []}',
    '{"version": 1, "calculated": {"rank_heartbeat_timeout": "ten"}}',
    '{"version": 1, "observed": {"heartbeat": NaN}, "calculated": {"rank_heartbeat_timeout": -1}}',
    '{"version": 1, "observed": [], "calculated": {"rank_section_timeouts": "x"}}',
    '[' * 100_000, '\xff\xfe', '', 'null', '{"version": 2}',
])
def test_a_corrupted_state_file_is_ignored(tmp_path, content, caplog):
    path = tmp_path / "ft_state.json"
    path.write_text(content, errors="surrogateescape")
    state = load_state(path)
    assert state.calculated.ranks == {} and state.observed == {}
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_a_valid_state_file_round_trips(tmp_path):
    data = {"version": 1, "observed": {"heartbeat": 0.2, "section:step": 1.5},
            "calculated": {"rank_heartbeat_timeout": 30.0,
                           "rank_section_timeouts": {"step": 8.0}}}
    state, problems = state_from_json(json.loads(json.dumps(data)))
    assert problems == [] and state.to_json() == data


def test_catching_up_on_a_backlog_counts_as_the_launchers_stall():
    m = _model(rank_heartbeat_timeout=1.0)
    m.heartbeat(0, T0, T0)
    assert not m.behind(0.5, T0 + 0.5)  # a short backlog is not a stall
    assert m.behind(1.5, T0 + 1.5)  # reading a long one: the rank may be behind it
    assert m.check(T0 + 1.5) is None
    m.heartbeat(0, T0 + 1.6, T0 + 1.6)  # its next beat, once the queue has room again
    assert m.check(T0 + 1.5 + STALL_SETTLE_S) is None
