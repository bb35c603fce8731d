"""The policy as a pure function: ``decide`` reads the job state, ``apply`` changes it."""

from __future__ import annotations

import copy
import signal

import pytest

from ft_launcher import policy
from ft_launcher.hang.liveness import HangVerdict
from ft_launcher.policy import CycleResult, JobState, Outcome, WorkerExit


def _job(**kw) -> JobState:
    return JobState(**{"max_restarts": 2, "num_devices": 2, "nproc": 2, "host": "n1", **kw})


def _exit(rank=0, code=None, sig=None) -> WorkerExit:
    return WorkerExit(rank=rank, local_rank=rank, pid=1000 + rank, exit_code=code, signal=sig)


def _failed(code, diagnoses=()):
    return CycleResult(0, Outcome.FAILED, failures=[_exit(code=code)], diagnoses=list(diagnoses))


def test_plain_failures_count_against_max_restarts():
    job = _job(max_restarts=1)
    d = policy.decide(_failed(3), job)
    assert d.restart and d.reason == "rank 0 failed (exit code 3)"
    policy.apply(d, job)
    d = policy.decide(_failed(3), job)
    assert (d.restart, d.exit_code, d.next_action.requeue) == (False, 1, True)


def test_a_signal_is_named_in_the_reason():
    result = CycleResult(0, Outcome.FAILED, failures=[_exit(rank=1, sig="SIGKILL")])
    assert policy.decide(result, _job()).reason == "rank 1 failed (signal SIGKILL)"


def test_a_hang_verdict_is_typed_and_named():
    verdict = HangVerdict(rank=1, local_rank=1, timeout_kind="heartbeat", timeout_s=2.0,
                          silence_s=2.1)
    d = policy.decide(CycleResult(0, Outcome.HUNG, hang=verdict), _job())
    assert d.restart and d.reason == "rank 1 hung (heartbeat timeout)"


def test_exit_16_rotates_devices_then_asks_for_another_node():
    job = _job()
    d = policy.decide(_failed(16), job)
    assert d.restart and d.rotate
    policy.apply(d, job)
    assert job.device_map() == [1, 0]
    d = policy.decide(_failed(16), job)
    assert d.exit_code == 16 and d.next_action.exclude_nodes == ["n1"]
    one_device = _job(num_devices=1, nproc=1)
    assert policy.decide(_failed(16), one_device).exit_code == 16


@pytest.mark.parametrize(("diagnostic", "skip", "expected"), [
    ("TRANSIENT_ERROR", False, ("restart", None)),
    ("PERSISTENT_ERROR", False, ("exit", 17, True, ["n1"])),
    ("CORRECT_RESULT", False, ("exit", 17, False, [])),
    ("CORRECT_RESULT", True, ("restart", None)),
    (None, False, ("exit", 17, False, [])),
])
def test_exit_17_follows_the_diagnosis(diagnostic, skip, expected):
    diagnoses = [{"rank": 0, "state": "X", "diagnostic": diagnostic, "iteration": 9,
                  "suspicious_device": "0"}] if diagnostic else []
    d = policy.decide(_failed(17, diagnoses), _job(skip_bad_iterations=skip))
    if expected[0] == "restart":
        assert d.restart
    else:
        na = d.next_action
        assert (d.exit_code, na.requeue, na.exclude_nodes) == expected[1:]


def test_persistent_error_moves_off_the_bad_device_when_a_spare_exists():
    job = _job(num_devices=3, nproc=2)
    diag = [{"diagnostic": "PERSISTENT_ERROR", "iteration": 4, "suspicious_device": "1"}]
    d = policy.decide(_failed(17, diag), job)
    assert d.restart and d.exclude_device == 1
    policy.apply(d, job)
    assert 1 not in job.device_map()


def test_no_progress_stops_with_18():
    job = _job(max_restarts=10, max_no_progress_cycles=2)
    for expected in (True, True, False):
        result = _failed(3)
        result.progress_iteration = 100
        d = policy.decide(result, job)
        assert d.restart is expected
        policy.apply(d, job)
    assert d.exit_code == 18


def test_progress_resets_the_no_progress_count():
    job = _job(max_restarts=10, max_no_progress_cycles=2)
    for iteration in (100, 100, 150, 150):
        result = _failed(3)
        result.progress_iteration = iteration
        d = policy.decide(result, job)
        assert d.restart
        policy.apply(d, job)
    assert (job.last_iteration, job.cycles_without_progress) == (150, 1)


@pytest.mark.parametrize("result", [
    _failed(3), _failed(16), _failed(17, [{"diagnostic": "PERSISTENT_ERROR", "iteration": 1,
                                           "suspicious_device": "1"}]),
    CycleResult(0, Outcome.HUNG, hang=HangVerdict(0, 0, "initial", 1.0, 1.0),
                progress_iteration=5),
])
def test_decide_never_changes_the_job_state(result):
    job = _job(num_devices=3, max_no_progress_cycles=1, last_iteration=5)
    before = copy.deepcopy(job)
    policy.decide(result, job)
    assert job == before


def test_success_signal_and_control():
    assert policy.decide(CycleResult(0, Outcome.SUCCEEDED), _job()).exit_code == 0
    d = policy.decide(CycleResult(0, Outcome.SIGNALED, signum=signal.SIGTERM), _job())
    assert d.exit_code == 143 and d.next_action.requeue
    d = policy.decide(CycleResult(0, Outcome.CONTROL, control="exclude_node"), _job())
    assert d.next_action.exclude_nodes == ["n1"]
    d = policy.decide(CycleResult(0, Outcome.PEER_CHANGED), _job(max_restarts=0))
    assert d.restart and not d.counted


def test_an_announced_exit_code_counts_when_the_rank_died_otherwise():
    diag = [{"rank": 1, "state": "X", "diagnostic": "CORRECT_RESULT", "iteration": 5,
             "exit_code": 17}]
    result = CycleResult(0, Outcome.FAILED, diagnoses=diag, failures=[_exit(1, sig="SIGABRT")])
    d = policy.decide(result, _job())
    assert d.exit_code == 17 and d.next_action.requeue is False


def test_the_first_failure_is_the_cause_and_the_later_ones_its_consequence():
    result = CycleResult(0, Outcome.FAILED, failures=[_exit(1, sig="SIGKILL"), _exit(0, code=1),
                                                      _exit(2, code=1)])
    assert policy.decide(result, _job()).reason == \
        "rank 1 failed (signal SIGKILL); then ranks 0, 2 failed in consequence"
