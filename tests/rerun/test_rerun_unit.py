"""Unit tests of the rerun state machine in one process (no torch.distributed)."""

from __future__ import annotations

import inspect
import io
import json
import logging
import math
import pickle
import random
from functools import partial

import numpy as np
import pytest
import torch
from rerun_test_support import clean_rerun_globals  # noqa: F401

import rerun
import rerun.rerun_state_machine as rsm
from rerun import (
    COMPARISON_MATCH,
    COMPARISON_MISMATCH,
    QuickStats,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
)
from rerun.components import compare_floats

NAN = float("nan")
V = RerunMode.VALIDATE_RESULTS


def batches(n: int = 100) -> RerunDataIterator:
    return RerunDataIterator(iter([torch.full((2,), float(i)) for i in range(n)]))


def run_step(machine, data, value_of_pass, message="loss", fatal=True, **kw):
    """One step; value_of_pass(pass_no, batch) gives the validated value. Returns the passes
    as (batch value, python random, numpy random, torch random) tuples."""
    seen = []
    while machine.should_run_forward_backward(data):
        batch = next(data) if data is not None else None
        draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
        seen.append((None if batch is None else float(batch[0]), *draws))
        if batch is not None:
            batch.add_(1000.0)  # the model edits its input in place
        value = value_of_pass(len(seen), batch)
        machine.validate_result(torch.tensor(value), torch.isnan, message, fatal=fatal, **kw)
    return seen


def nan_on_first(pass_no, _):
    return NAN if pass_no == 1 else 1.0


def always_nan(*_):
    return NAN


def fine(*_):
    return 1.0


def roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain data only


def listen():
    events = []
    rerun.add_diagnosis_listener(events.append)
    return events


# ------------------------------------------------------------------------- public API
def test_public_names_match_megatron_and_alias_module():
    names = [
        "RerunStateMachine", "RerunDiagnostic", "RerunMode", "RerunState",
        "RerunValidationStatus", "Caller", "Call", "COMPARISON_MATCH", "COMPARISON_MISMATCH",
        "EXIT_CODE_RESUME_TO_DISAMBIGUATE", "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
        "RerunDataIterator", "QuickStats", "RerunErrorInjector",
        "initialize_rerun_state_machine", "get_rerun_state_machine",
        "destroy_rerun_state_machine", "add_diagnosis_listener", "remove_diagnosis_listener",
        "current_device_identity",
    ]
    for name in names:
        assert getattr(rerun, name) is getattr(rsm, name), name
    assert rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE == 16
    assert rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION == 17
    assert (COMPARISON_MATCH, COMPARISON_MISMATCH) == (0.0, math.inf)
    assert len(RerunState) == 6
    assert set(RerunMode.__members__) == {"DISABLED", "VALIDATE_RESULTS",
                                          "REPORT_DETERMINISM_STATS"}
    params = list(inspect.signature(RerunStateMachine).parameters)
    assert params == ["state_save_func", "state_restore_func", "mode", "error_injector",
                      "result_rejected_tracker_filename"]
    assert list(inspect.signature(RerunStateMachine.validate_result).parameters) == [
        "self", "result", "rejection_func", "message", "comparison_func", "tolerance", "fatal"]
    assert RerunStateMachine.REPORTING_INTERVAL_ITERATIONS >= 1
    for method in ("set_mode", "get_mode", "should_run_forward_backward",
                   "should_checkpoint_and_exit", "is_unexpectedly_large", "state_dict",
                   "validate_state_dict", "load_state_dict"):
        assert callable(getattr(RerunStateMachine, method))
    assert isinstance(inspect.getattr_static(
        RerunStateMachine, "get_skipped_iterations_from_tracker_file"), classmethod)


def test_singleton_lifecycle():
    machine = rerun.get_rerun_state_machine()  # implicit: DISABLED
    assert machine.get_mode() == RerunMode.DISABLED
    with pytest.raises(RuntimeError, match="already initialised"):
        rerun.initialize_rerun_state_machine(mode=V)
    rerun.destroy_rerun_state_machine()
    rerun.initialize_rerun_state_machine(mode=V)
    assert rerun.get_rerun_state_machine().get_mode() == V


# --------------------------------------------------------------------------- DISABLED
def test_disabled_runs_once_and_does_nothing_else():
    calls = []
    machine = RerunStateMachine(state_save_func=lambda: calls.append(1))
    data = batches()
    for step in range(1, 4):
        seen = run_step(machine, data, fine)
        assert len(seen) == 1
        assert machine.current_iteration == step
    assert calls == []  # no state saved
    assert data.saved_microbatches == [] and not data._recording  # nothing buffered
    assert machine.should_checkpoint_and_exit() == (False, False, 0)
    assert machine.state_dict(data, "torch_dist") is None


def test_disabled_still_checks_results(caplog):
    machine = RerunStateMachine()
    with pytest.raises(RuntimeError, match="unexpected result nan"):
        run_step(machine, batches(), always_nan)
    machine = RerunStateMachine()
    with caplog.at_level(logging.WARNING, logger="rerun"):
        run_step(machine, batches(), always_nan, fatal=False)
    assert "unexpected result nan" in caplog.text


# ------------------------------------------------------------------- VALIDATE_RESULTS
def test_accepted_result_runs_once():
    machine = RerunStateMachine(mode=V)
    assert len(run_step(machine, batches(), fine)) == 1
    assert machine.state == RerunState.NOT_RUNNING_YET
    assert machine.should_checkpoint_and_exit() == (False, False, 0)


def test_first_step_is_validated_and_rerun_replays_state_and_copies():
    saved, restored = [], []
    machine = RerunStateMachine(
        state_save_func=lambda: saved.append(1) or {"x": len(saved)},
        state_restore_func=restored.append, mode=V,
    )
    data = batches()
    seen = run_step(machine, data, nan_on_first)
    assert machine.current_iteration == 1
    assert len(seen) == 2
    # The re-run saw the original batch (not the in-place edited one) and the same RNG draws.
    assert seen[0] == seen[1]
    assert seen[0][0] == 0.0
    # Restored before the re-run, and again before the exit so the checkpoint holds the
    # step's start: the next draw repeats the step's first one.
    assert restored == [{"x": 1}, {"x": 1}]
    assert random.random() == seen[0][1]
    assert machine.should_checkpoint_and_exit() == (True, True, 17)
    with pytest.raises(RuntimeError, match="asked the job to exit with code 17"):
        machine.should_run_forward_backward(data)


def test_transient_non_fatal_continues_and_reports():
    events = listen()
    machine = RerunStateMachine(mode=V)
    data = batches()
    run_step(machine, data, fine)
    seen = run_step(machine, data, nan_on_first, message="spike", fatal=False)
    assert len(seen) == 2
    assert machine.state == RerunState.NOT_RUNNING_YET
    assert machine.should_checkpoint_and_exit() == (False, False, 0)
    assert [(e["iteration"], e["diagnostic"], e["exit_code"], e["fatal"]) for e in events] == [
        (2, None, None, False), (2, "TRANSIENT_ERROR", None, False)]
    json.dumps(events)
    # The next step starts clean: one pass, no stale failure.
    assert len(run_step(machine, data, fine, message="spike", fatal=False)) == 1
    assert machine.failed_validation_call is None and machine.initial_result is None


def test_reproducible_then_resume_elsewhere_persistent_and_correct(monkeypatch):
    monkeypatch.setenv("FT_DEVICE_ID", "3")
    machine = RerunStateMachine(mode=V)
    data = batches()
    run_step(machine, data, fine)
    seen = run_step(machine, data, always_nan)
    assert len(seen) == 2 and seen[0][0] == seen[1][0] == 1.0
    assert machine.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert machine.should_checkpoint_and_exit() == (True, True, 16)
    state = roundtrip(machine.state_dict(data, "torch_dist"))
    assert state["sharded"]["suspicious_device"] == "3"
    assert machine.validate_state_dict(state)

    def resume(device, value_of_pass):
        monkeypatch.setenv("FT_DEVICE_ID", device)
        events = listen()
        fresh = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
        fresh.load_state_dict(state)
        fresh.current_iteration = 1  # the loop's own count of completed steps
        resumed = RerunDataIterator(iter([torch.full((2,), 99.0)]))  # after the step
        seen = run_step(fresh, resumed, value_of_pass)
        rerun.remove_diagnosis_listener(events.append)
        return fresh, seen, events, resumed

    fresh, seen, events, _ = resume("3", always_nan)
    assert [s[0] for s in seen] == [1.0]  # the checkpointed buffer was replayed
    assert fresh.should_checkpoint_and_exit() == (False, True, 16)
    assert fresh.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT

    fresh, seen, events, resumed = resume("4", fine)
    assert fresh.should_checkpoint_and_exit() == (False, True, 17)
    assert [(e["iteration"], e["diagnostic"]) for e in events] == [(2, "PERSISTENT_ERROR")]
    assert events[0]["suspicious_device"] == "3" and events[0]["device"] == "4"

    # The re-run read only the replayed buffer, nothing from the wrapped iterator.
    assert float(next(resumed.iterable)[0]) == 99.0
    fresh, seen, events, _ = resume("4", always_nan)
    assert fresh.should_checkpoint_and_exit() == (False, True, 17)
    assert [e["diagnostic"] for e in events] == ["CORRECT_RESULT"]


def test_skipped_pending_step_resumes_training_instead_of_exit_17(monkeypatch):
    monkeypatch.setenv("FT_DEVICE_ID", "0")
    machine = RerunStateMachine(mode=V)
    data = batches()
    run_step(machine, data, always_nan)
    machine.should_checkpoint_and_exit()
    state = machine.state_dict(data, "torch_dist")
    monkeypatch.setenv("FT_DEVICE_ID", "1")
    events = listen()
    fresh = RerunStateMachine(mode=V)
    fresh.load_state_dict(state)
    resumed = RerunDataIterator(iter([torch.zeros(2)] * 5))
    passes = 0
    while fresh.should_run_forward_backward(resumed):  # a dummy step: no validation
        next(resumed)
        passes += 1
    assert passes == 1
    assert fresh.should_checkpoint_and_exit() == (False, False, 0)
    assert fresh.state == RerunState.NOT_RUNNING_YET
    assert "abandoned" in events[-1]["message"] and events[-1]["exit_code"] is None
    assert len(run_step(fresh, resumed, fine)) == 1 and fresh.current_iteration == 2


def test_checkpoint_after_transient_exit_17_resumes_as_plain_step():
    machine = RerunStateMachine(mode=V)
    data = batches()
    run_step(machine, data, fine)
    run_step(machine, data, nan_on_first)
    assert machine.should_checkpoint_and_exit() == (True, True, 17)
    state = roundtrip(machine.state_dict(data, "torch_dist"))
    assert machine.validate_state_dict(state)
    fresh = RerunStateMachine(mode=V)
    fresh.load_state_dict(state)
    assert fresh.current_iteration == 1 and fresh.state == RerunState.NOT_RUNNING_YET
    resumed = RerunDataIterator(iter([torch.full((2,), 7.0)]))
    seen = run_step(fresh, resumed, fine)
    assert [s[0] for s in seen] == [1.0]  # step 2's batch, replayed from the checkpoint
    assert fresh.current_iteration == 2
    assert [s[0] for s in run_step(fresh, resumed, fine)] == [7.0]


def test_failed_check_not_reached_in_rerun_is_not_reproducible():
    machine = RerunStateMachine(mode=V)
    passes = 0
    while machine.should_run_forward_backward(None):
        passes += 1
        if passes == 1:  # the re-run takes another path and never validates
            machine.validate_result(torch.tensor(NAN), torch.isnan, "loss")
    assert passes == 2
    assert machine.should_checkpoint_and_exit() == (True, True, 17)


# ------------------------------------------------------------------------ comparisons
@pytest.mark.parametrize(
    "a, b, expected",
    [
        (1.0, 1.0, COMPARISON_MATCH),
        (NAN, NAN, COMPARISON_MATCH),
        (math.inf, -math.inf, COMPARISON_MISMATCH),
        (math.inf, 1.0, COMPARISON_MISMATCH),
        (NAN, 1.0, COMPARISON_MISMATCH),
        (1.0, -1.0, 2.0),
        (1e308, -1e308, 2.0),
        (2.0, 1.0, 2.0 / 3.0),
    ],
)
def test_compare_floats(a, b, expected):
    assert compare_floats(torch.tensor(a, dtype=torch.float64), b) == pytest.approx(expected)


def test_nan_comparison_is_a_mismatch_not_a_pass():
    events = listen()
    machine = RerunStateMachine(mode=V)
    seen = run_step(machine, batches(), always_nan, comparison_func=lambda a, b: NAN,
                    tolerance=1.0)
    assert len(seen) == 2
    assert events[-1]["diagnostic"] == "TRANSIENT_ERROR"
    assert machine.should_checkpoint_and_exit() == (True, True, 17)


@pytest.mark.parametrize("difference, state", [
    (0.01, RerunState.WILL_RERUN_FROM_CHECKPOINT),  # within tolerance: reproduced
    (0.1, RerunState.RERUNNING_IN_PLACE),  # beyond: transient, exit 17
])
def test_tolerance_decides_reproducibility(difference, state):
    machine = RerunStateMachine(mode=V)
    run_step(machine, batches(), nan_on_first, comparison_func=lambda a, b: difference,
             tolerance=0.05)
    assert machine.state == state


# -------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    machine = RerunStateMachine(mode=V)
    with pytest.raises(RuntimeError, match="outside the should_run_forward_backward"):
        machine.validate_result(torch.tensor(1.0), torch.isnan, "loss")
    with pytest.raises(RuntimeError, match="rejection_func of 'loss' raised"):
        while machine.should_run_forward_backward(None):
            machine.validate_result(1.0, lambda r: 1 / 0, "loss")
    machine = RerunStateMachine(mode=V)
    with pytest.raises(RuntimeError, match="must return a bool"):
        while machine.should_run_forward_backward(None):
            machine.validate_result(torch.ones(3), torch.isnan, "loss")
    machine = RerunStateMachine(mode=V)
    with pytest.raises(RuntimeError, match="comparison_func of 'loss' failed"):
        run_step(machine, None, always_nan, comparison_func=lambda a, b: 1 / 0)
    machine = RerunStateMachine(mode=V)
    with pytest.raises(ValueError, match="tolerance"):
        run_step(machine, None, fine, tolerance=NAN)
    with pytest.raises(TypeError, match="RerunDataIterator"):
        RerunStateMachine(mode=V).should_run_forward_backward(iter([1]))
    with pytest.raises(ValueError, match="unknown rerun mode"):
        RerunStateMachine(mode="sometimes")
    with pytest.raises(ValueError, match="RerunDiagnostic"):
        RerunErrorInjector(1, "transient")
    with pytest.raises(ValueError, match=">= 0"):
        RerunErrorInjector(-1)
    machine = RerunStateMachine(mode=V)
    machine.should_run_forward_backward(None)
    with pytest.raises(RuntimeError, match="during a step"):
        machine.set_mode(RerunMode.DISABLED)
    with pytest.raises(RuntimeError, match="during a pass"):
        machine.state_dict(None, "torch_dist", force=True)


def test_bad_state_dicts_are_refused(monkeypatch):
    machine = RerunStateMachine(mode=V)
    good = machine.state_dict(None, "torch_dist", force=True)
    assert machine.validate_state_dict(None) is False
    assert machine.validate_state_dict(good) is False  # between steps: nothing to resume
    with pytest.raises(ValueError, match="version 99"):
        machine.load_state_dict({**good, "version": 99})
    megatron_like = {"mode": "validate_results", "state": RerunState.WILL_RERUN_FROM_CHECKPOINT,
                     "current_iteration": 3, "sharded": object()}
    with pytest.raises(ValueError, match="Megatron"):
        machine.validate_state_dict(megatron_like)
    with pytest.raises(ValueError, match="malformed"):
        machine.load_state_dict({**good, "sharded": {}})
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="saved by rank 1"):
        machine.load_state_dict({**good, "rank": 1})


def test_changed_data_iterator_count_is_an_error(monkeypatch):
    machine = RerunStateMachine(mode=V)
    data = batches()
    run_step(machine, data, always_nan)
    state = machine.state_dict(data, "torch_dist")
    fresh = RerunStateMachine(mode=V)
    fresh.load_state_dict(state)
    monkeypatch.setenv("FT_DEVICE_ID", "9")
    with pytest.raises(ValueError, match="1 data iterator states but 2"):
        fresh.should_run_forward_backward([batches(), batches()])


def test_load_in_disabled_mode_is_ignored():
    machine = RerunStateMachine(mode=V)
    run_step(machine, batches(), always_nan)
    state = machine.state_dict(None, "torch_dist")
    fresh = RerunStateMachine()
    fresh.load_state_dict(state)
    assert fresh.state == RerunState.NOT_RUNNING_YET and fresh.current_iteration == 0


# ------------------------------------------------------------ REPORT_DETERMINISM_STATS
def test_report_determinism_stats_reruns_every_step_and_reports(caplog):
    machine = RerunStateMachine(mode=RerunMode.REPORT_DETERMINISM_STATS)
    data = batches()
    rejected = []
    with caplog.at_level(logging.INFO, logger="rerun"):
        for step in range(4):
            spread = iter([1.0, 1.0 + 0.1 * step])
            while machine.should_run_forward_backward(data):
                next(data)
                machine.validate_result(torch.tensor(next(spread)),
                                        lambda r: rejected.append(r) or True, "loss")
                machine.validate_result(torch.tensor(NAN), torch.isnan, "nan",
                                        comparison_func=lambda a, b: NAN)
            assert machine.should_checkpoint_and_exit() == (False, False, 0)
    assert rejected == []  # validation is suspended in this mode
    report = machine.last_stats_report
    assert report["loss"].startswith("4/1 total/identical samples")
    assert "max: 2.609E-01" in report["loss"]  # 2 * 0.3 / 2.3
    assert report["nan"].startswith("4/0 total/identical")  # NaN spread counted as inf
    assert "determinism of 'loss'" in caplog.text


# ------------------------------------------------------------------ helpers and stats
def test_quick_stats():
    stats = QuickStats(max_size=3)
    assert stats.print_stats() == "0 samples, all identical"
    for v in (0.0, 0.0, 1.0, 2.0, 3.0, 4.0):
        stats.record(v)
    assert stats.zero_cnt == 2 and sorted(stats.samples) == [2.0, 3.0, 4.0]
    assert stats.max == 4.0
    with pytest.raises(ValueError):
        stats.record(NAN)
    other = pickle.loads(pickle.dumps(QuickStats(samples=[5.0], zero_cnt=1, max=5.0)))
    stats.combine([other])
    assert stats.zero_cnt == 3 and stats.max == 5.0 and len(stats.samples) == 3
    text = stats.print_stats()
    assert text.startswith("6/3 total/identical") and "max: 5.000E+00" in text
    stats.reset()
    assert stats == QuickStats(max_size=3)


def test_is_unexpectedly_large():
    machine = RerunStateMachine(mode=V)
    check = partial(machine.is_unexpectedly_large, threshold=10, context="loss", num_samples=3)
    assert [check(torch.tensor(v)) for v in (1.0, -2.0, 1.5)] == [False] * 3
    assert check(torch.tensor(19.0)) is False
    assert check(torch.tensor(-20.0)) is True
    assert check(torch.tensor(NAN)) is False and check(math.inf) is False
    assert check(100.0, resample=True) is False  # starts sampling again
    with pytest.raises(ValueError):
        machine.is_unexpectedly_large(1.0, threshold=0, context="x")


def test_error_injector_drives_each_diagnosis(monkeypatch):
    for kind, first_exit in [(RerunDiagnostic.TRANSIENT_ERROR, 17),
                             (RerunDiagnostic.PERSISTENT_ERROR, 16),
                             (RerunDiagnostic.CORRECT_RESULT, 16)]:
        monkeypatch.setenv("FT_DEVICE_ID", "0")
        machine = RerunStateMachine(mode=V, error_injector=RerunErrorInjector(1, kind))
        assert len(run_step(machine, batches(), fine)) == 2
        assert machine.should_checkpoint_and_exit()[2] == first_exit
        if first_exit == 17:
            continue
        state = roundtrip(machine.state_dict(None, "torch_dist"))
        assert state["sharded"]["error_injector_checkpoint"]["injected_error_type"] == kind.value
        monkeypatch.setenv("FT_DEVICE_ID", "1")
        events = listen()
        fresh = RerunStateMachine(mode=V)
        fresh.load_state_dict(state)
        run_step(fresh, None, fine)
        assert fresh.should_checkpoint_and_exit() == (False, True, 17)
        assert events[-1]["diagnostic"] == kind.name
        rerun.remove_diagnosis_listener(events.append)


def test_data_iterator_replay_and_state():
    data = batches(3)
    data._recording = True
    first = next(data)
    first.add_(5.0)
    data.rewind()
    replay = next(data)
    assert float(replay[0]) == 0.0 and replay is not data.saved_microbatches[0]
    with pytest.raises(RuntimeError, match="read only 1"):
        next(data)
    copy = RerunDataIterator(iter([]))
    copy.load_state_dict(data.state_dict())
    assert copy.replaying and len(copy.saved_microbatches) == 1
    with pytest.raises(ValueError, match="missing"):
        copy.load_state_dict({"replaying": True})
    data.advance()
    assert float(next(data)[0]) == 1.0


def test_listener_errors_are_swallowed_and_remove_works(caplog):
    def broken(event):
        raise RuntimeError("boom")

    events = listen()
    rerun.add_diagnosis_listener(broken)
    machine = RerunStateMachine(mode=V)
    with caplog.at_level(logging.ERROR, logger="rerun"):
        run_step(machine, batches(), nan_on_first, fatal=False)
    assert len(events) == 2 and "boom" in caplog.text
    rerun.remove_diagnosis_listener(events.append)
    run_step(machine, batches(), nan_on_first, fatal=False)
    assert len(events) == 2
    with pytest.raises(TypeError):
        rerun.add_diagnosis_listener("not callable")


def test_device_identity(monkeypatch):
    host, device = rerun.current_device_identity()
    assert host and device == "0"
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert rerun.current_device_identity()[1] == "2"
    monkeypatch.setenv("FT_DEVICE_ID", "5")
    assert rerun.current_device_identity()[1] == "5"

    # Mocked GPU (this machine has none): the CUDA device wins, named by its UUID.
    class Props:
        uuid = "1234-abcd"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    assert rerun.current_device_identity()[1] == "GPU-1234-abcd"


# ------------------------------------------------------------------------ tracker file
def test_tracker_file_and_skip_list_are_one_based(tmp_path, caplog):
    path = str(tmp_path / "tracker.jsonl")
    for _job in range(2):  # two jobs fail at the same step in DISABLED mode
        machine = RerunStateMachine(result_rejected_tracker_filename=path)
        data = batches()
        with pytest.raises(RuntimeError):
            for step in range(1, 5):
                run_step(machine, data, always_nan if step == 3 else fine)
        assert machine.current_iteration == 3
    with open(path, "a") as f:
        f.write("not json\n")
        f.write('{"rank": 0, "iteration": "x", "status": "RERUN_DISABLED"}\n')
        f.write('{"rank": 0, "iteration": 7, "status": "BOGUS"}\n')
        f.write("\n")
        for _ in range(2):  # after the bad lines: still parsed
            f.write(json.dumps({"rank": 1, "iteration": 9, "status": "RERUN_DISABLED"}) + "\n")
        f.write(json.dumps({"rank": 0, "iteration": 11, "status": "RERUN_DISABLED"}) + "\n")
        f.write(json.dumps({"rank": 1, "iteration": 11, "status": "RERUN_DISABLED"}) + "\n")
        f.write(json.dumps({"rank": 1, "iteration": 12, "status": "INITIAL_RUN"}) + "\n")
        f.write(json.dumps({"rank": 1, "iteration": 12, "status": "INITIAL_RUN"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="rerun"):
        skip = RerunStateMachine.get_skipped_iterations_from_tracker_file(path)
    assert skip == [3, 9]
    for lineno in (3, 4, 5):
        assert f"line {lineno} skipped" in caplog.text
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(
        str(tmp_path / "missing")) == []


def test_unwritable_tracker_file_fails_at_start(tmp_path):
    with pytest.raises(RuntimeError, match="cannot be appended"):
        RerunStateMachine(result_rejected_tracker_filename=str(tmp_path / "no" / "file"))
