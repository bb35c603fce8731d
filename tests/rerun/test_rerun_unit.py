"""Unit tests of the rerun state machine in one process (no torch.distributed)."""

from __future__ import annotations

import inspect
import io
import json
import logging
import math
import pickle
import random
import warnings
from functools import partial

import numpy as np
import pytest
import torch
from rerun_test_support import clean_rerun_globals  # noqa: F401
from torch_support import skip_below_torch_2_6

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
    assert machine.state_dict(data, "torch") is None


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
    state = roundtrip(machine.state_dict(data, "torch"))
    assert state["sharded"]["suspicious_device"] == 3  # Megatron's type: the index
    assert state["sharded"]["suspicious_device_identity"] == "3"
    assert type(machine.suspicious_device) is int
    assert machine.validate_state_dict(state)

    def resume(device, value_of_pass):
        monkeypatch.setenv("FT_DEVICE_ID", device)
        events = listen()
        fresh = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
        fresh.load_state_dict(state)
        fresh.current_iteration = 1  # the loop's own count of completed steps
        # The loader resumes at the step's first sample (Megatron's consumed samples).
        resumed = RerunDataIterator(iter([torch.full((2,), 1.0), torch.full((2,), 99.0)]))
        seen = run_step(fresh, resumed, value_of_pass)
        rerun.remove_diagnosis_listener(events.append)
        return fresh, seen, events, resumed

    fresh, seen, events, _ = resume("3", always_nan)
    assert [s[0] for s in seen] == [1.0]  # the step's sample, read from the loader once
    assert fresh.should_checkpoint_and_exit() == (False, True, 16)
    assert fresh.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT

    fresh, seen, events, resumed = resume("4", fine)
    assert fresh.should_checkpoint_and_exit() == (False, True, 17)
    assert [(e["iteration"], e["diagnostic"]) for e in events] == [(2, "PERSISTENT_ERROR")]
    assert events[0]["suspicious_device"] == "3" and events[0]["device"] == "4"

    # The re-run read the step's sample and nothing more: the next step reads the next one.
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
    state = machine.state_dict(data, "torch")
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
    state = roundtrip(machine.state_dict(data, "torch"))
    assert machine.validate_state_dict(state)
    fresh = RerunStateMachine(mode=V)
    fresh.load_state_dict(state)
    assert fresh.current_iteration == 1 and fresh.state == RerunState.NOT_RUNNING_YET
    resumed = RerunDataIterator(iter([torch.full((2,), 1.0), torch.full((2,), 7.0)]))
    seen = run_step(fresh, resumed, fine)
    assert [s[0] for s in seen] == [1.0]  # step 2's batch, from the resumed loader
    assert fresh.current_iteration == 2
    assert [s[0] for s in run_step(fresh, resumed, fine)] == [7.0]


@pytest.mark.parametrize("fatal, exit_", [(True, (True, True, 17)), (False, (False, False, 0))])
def test_failed_check_not_reached_in_rerun_gives_no_verdict(tmp_path, fatal, exit_):
    events = listen()
    path = tmp_path / "tracker.jsonl"
    machine = RerunStateMachine(mode=V, result_rejected_tracker_filename=str(path))
    passes = 0
    while machine.should_run_forward_backward(None):
        passes += 1
        if passes == 1:  # the re-run takes another path and never validates
            machine.validate_result(torch.tensor(NAN), torch.isnan, "loss", fatal=fatal)
    assert passes == 2
    assert machine.should_checkpoint_and_exit() == exit_
    # As Megatron-Core: nothing was compared, so no verdict and no second tracker line.
    assert [json.loads(x)["status"] for x in path.read_text().splitlines()] == ["INITIAL_RUN"]
    assert [e["diagnostic"] for e in events] == [None, None]
    assert "did not reach the rejected check" in events[-1]["message"]


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
        machine.state_dict(None, "torch", force=True)


def test_bad_state_dicts_are_refused(monkeypatch):
    machine = RerunStateMachine(mode=V)
    good = machine.state_dict(None, "torch", force=True)
    assert machine.validate_state_dict(None) is False
    assert machine.validate_state_dict(good) is False  # between steps: nothing to resume
    with pytest.raises(ValueError, match="version 99"):
        machine.load_state_dict({**good, "version": 99})
    megatron_like = {"mode": "validate_results", "state": RerunState.WILL_RERUN_FROM_CHECKPOINT,
                     "current_iteration": 3, "sharded": object()}
    with pytest.raises(ValueError, match="Megatron"):
        machine.load_state_dict(megatron_like)
    with pytest.raises(ValueError, match="malformed"):
        machine.load_state_dict({**good, "sharded": {}})
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="saved by rank 1"):
        machine.load_state_dict({**good, "sharded": {**good["sharded"], "rank": 1}})


def test_changed_data_iterator_count_is_an_error(monkeypatch):
    machine = RerunStateMachine(mode=V)
    data = batches()
    run_step(machine, data, always_nan)
    state = machine.state_dict(data, "torch")
    fresh = RerunStateMachine(mode=V)
    fresh.load_state_dict(state)
    monkeypatch.setenv("FT_DEVICE_ID", "9")
    with pytest.raises(ValueError, match="1 data iterator states but 2"):
        fresh.should_run_forward_backward([batches(), batches()])


def test_load_in_disabled_mode_is_ignored():
    machine = RerunStateMachine(mode=V)
    run_step(machine, batches(), always_nan)
    state = machine.state_dict(None, "torch")
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
        state = roundtrip(machine.state_dict(None, "torch"))
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


# ------------------------------------------------------------- Megatron compatibility
def _pending_state(monkeypatch, fmt="torch"):
    monkeypatch.setenv("FT_DEVICE_ID", "2")
    machine = RerunStateMachine(mode=V)
    data = batches()
    run_step(machine, data, always_nan)
    return machine, machine.state_dict(data, fmt)


def test_validate_state_dict_never_raises_and_warns_once_for_foreign(caplog, monkeypatch):
    machine, pending = _pending_state(monkeypatch)
    fresh = RerunStateMachine(mode=V)
    between = fresh.state_dict(None, "torch", force=True)
    megatron = {"mode": RerunMode.VALIDATE_RESULTS,
                "state": RerunState.WILL_RERUN_FROM_CHECKPOINT,
                "current_iteration": 3, "sharded": {"rerun_requested": True}}
    with caplog.at_level(logging.WARNING, logger="rerun"):
        answers = [fresh.validate_state_dict(x) for x in (
            None, {}, between, {**megatron, "state": RerunState.NOT_RUNNING_YET}, [1], "x",
            {"state": "WILL_RERUN_FROM_CHECKPOINT"}, {**pending, "version": 1})]
        assert answers == [False] * 8
        caplog.clear()
        assert fresh.validate_state_dict(megatron) is False
    assert len(caplog.records) == 1 and "starting fresh" in caplog.text
    assert fresh.validate_state_dict(pending) is True


def test_request_flags_are_saved_and_restored(monkeypatch):
    machine, state = _pending_state(monkeypatch)
    state = roundtrip(state)
    assert (state["sharded"]["rerun_requested"], state["sharded"]["checkpoint_requested"]) == (
        True, True)
    fresh = RerunStateMachine(mode=V)
    fresh.load_state_dict(state)
    assert (fresh.rerun_requested, fresh.checkpoint_requested, fresh.restart_again_requested,
            fresh.continue_requested) == (True, True, False, False)
    assert fresh.suspicious_device == 2 and fresh.suspicious_device_identity == "2"


def test_torch_dist_wraps_the_rank_part_in_megatron_sharded_object(monkeypatch):
    skip_below_torch_2_6("megatron-core")
    from megatron.core.dist_checkpointing.mapping import ShardedObject  # a test dependency

    monkeypatch.setenv("RANK", "1")
    machine, state = _pending_state(monkeypatch, "torch_dist")
    obj = state["sharded"]
    assert isinstance(obj, ShardedObject)
    assert (obj.key, obj.global_shape, obj.global_offset) == (rsm.SHARDED_KEY, (1,), (1,))
    assert obj.data["rank"] == 1 and "rank" not in state  # the common part is rank-free
    # Megatron's load template has the same key, shape and offset.
    template = RerunStateMachine(mode=V).state_dict(None, "torch_dist", force=True)["sharded"]
    assert (template.key, template.global_offset) == (obj.key, obj.global_offset)
    # What the distributed checkpoint gives back: the rank's own dict in place.
    RerunStateMachine(mode=V).load_state_dict({**state, "sharded": obj.data})
    RerunStateMachine(mode=V).load_state_dict(state)  # still wrapped: unwrapped on load
    monkeypatch.setenv("RANK", "0")  # rank 0 handed rank 1's copy: refused
    with pytest.raises(ValueError, match="saved by rank 1, loaded by 0"):
        RerunStateMachine(mode=V).load_state_dict({**state, "sharded": obj.data})
    # Megatron keeps the structure constant: torch_dist returns a sentinel between steps.
    idle = RerunStateMachine(mode=V)
    assert idle.state_dict(None, "torch_dist")["state"] == "NOT_RUNNING_YET"
    assert idle.state_dict(None, "torch") is None
    assert RerunStateMachine().state_dict(None, "torch_dist") is None  # DISABLED
    # Without Megatron-Core: plain per-rank data.
    monkeypatch.setattr(rsm, "_sharded_object_class", lambda: None)
    assert isinstance(idle.state_dict(None, "torch_dist")["sharded"], dict)


def test_report_determinism_stats_reruns_only_steps_that_validated():
    machine = RerunStateMachine(mode=RerunMode.REPORT_DETERMINISM_STATS)
    data = batches()
    seen = [len(run_step(machine, data, fine)) for _ in range(2)]
    passes = 0
    while machine.should_run_forward_backward(data):  # a step without validation
        next(data)
        passes += 1
    assert seen == [2, 2] and passes == 1


def test_is_unexpectedly_large_resample_keeps_the_maximum():
    machine = RerunStateMachine(mode=V)
    check = partial(machine.is_unexpectedly_large, threshold=10, context="loss", num_samples=2)
    assert [check(v) for v in (5.0, 1.0)] == [False, False]
    assert check(1.0, resample=True) is False  # counting again; the maximum stays 5
    assert check(2.0) is False
    assert machine.max_values["loss"] == 5.0
    assert check(49.0) is False and check(50.0) is True


def test_no_autograd_warning_when_a_result_is_recorded(tmp_path):
    machine = RerunStateMachine(mode=V, result_rejected_tracker_filename=str(tmp_path / "t"))
    weight = torch.ones((), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        passes = 0
        while machine.should_run_forward_backward(None):
            passes += 1
            loss = weight * (NAN if passes == 1 else 2.0)
            machine.validate_result(loss, torch.isnan, "loss", fatal=False)
            machine.validate_result(loss, partial(machine.is_unexpectedly_large, threshold=10,
                                                  context="loss"), "spike", fatal=False)
            loss.backward()
    assert passes == 2


def test_first_iteration_complete():
    machine = RerunStateMachine(mode=V)
    assert machine.first_iteration_complete is False
    run_step(machine, batches(), fine)
    assert machine.first_iteration_complete is False
    machine.should_checkpoint_and_exit()
    assert machine.first_iteration_complete is True


def test_resumed_loader_at_the_wrong_sample_is_reported(monkeypatch, caplog):
    machine, state = _pending_state(monkeypatch)
    monkeypatch.setenv("FT_DEVICE_ID", "5")
    events = listen()
    fresh = RerunStateMachine(mode=V)
    fresh.load_state_dict(state)
    wrong = RerunDataIterator(iter([torch.full((2,), 42.0)]))  # resumed after the step
    with caplog.at_level(logging.ERROR, logger="rerun"):
        run_step(fresh, wrong, always_nan)
    assert "gave other microbatches" in caplog.text
    assert "other input" in events[-1]["message"]


def test_share_iterations_to_skip_without_distributed():
    assert rerun.share_iterations_to_skip([5, 3, 5]) == [3, 5]


@pytest.mark.parametrize("line, expected", [
    ("ts=2025-01-01 00:00:00.1 node=n device=0 jobID=N/A rank=3 iteration=7 "
     "status=RerunValidationStatus.RERUN_DISABLED result=tensor(nan) message='a b'",
     ("N/A", 3, 7, "RERUN_DISABLED")),
    ("ts=2025-01-01 00:00:00.1 node=n device=0 jobID=4 rank=0 iteration=2 "
     "status=first_rerun_reproducible result=1 message='rank=9 iteration=9 status=x'",
     ("4", 0, 2, "FIRST_RERUN_REPRODUCIBLE")),
    ('{"rank": 1, "iteration": 4, "status": "INITIAL_RUN", "job_id": 12}',
     ("12", 1, 4, "INITIAL_RUN")),
])
def test_tracker_lines_of_both_formats(line, expected):
    from rerun import tracker

    r = tracker.parse_line(line)
    assert (r.job, r.rank, r.iteration, r.status) == expected


@pytest.mark.parametrize("line", [
    "x" * 70000, '{"rank": true, "iteration": 1, "status": "INITIAL_RUN"}', "[1]",
    "ts=1 node=n device=0 jobID=1 rank=1 iteration=1e9 status=initial_run result=1",
    "ts=1 node=n device=0 jobID=1 rank=1 iteration=1 status=bogus result=1",
])
def test_malformed_tracker_lines_are_refused(line):
    from rerun import tracker

    with pytest.raises(ValueError):
        tracker.parse_line(line)
