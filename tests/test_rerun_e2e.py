"""Exit codes 16 and 17 end to end: the rerun state machine in real DDP workers (gloo),
its verdicts sent through ft_agent, and the launcher's policy acting on them."""

from __future__ import annotations

import json

import pytest
from launch_helpers import EXAMPLES, events, named, run_launcher, summary

pytestmark = pytest.mark.timeout(240)
TRAIN = str(EXAMPLES / "train_rerun.py")


def _launch(run_dir, fault, *flags, script_flags=()):
    return run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "3", *flags,
                        TRAIN, "--fault", fault, "--at", "5", "--steps", "8", *script_flags,
                        timeout=200)


def _verdicts(run_dir):
    return [d for d in summary(run_dir)["diagnoses"] if d.get("diagnostic")]


def test_faulty_device_exit_16_rotates_then_persistent_error_names_the_device(run_dir):
    res = _launch(run_dir, "device")
    assert res.returncode == 17, res.stdout[-3000:]
    evs = events(run_dir)
    exits = [e for e in named(evs, "worker_exited") if e["cycle"] == 0]
    assert 16 in {e["exit_code"] for e in exits}
    # The launcher knew why before the process exited.
    first_16 = min(e["ts"] for e in exits if e["exit_code"] == 16)
    asked = [e for e in named(evs, "diagnosis") if e["exit_code"] == 16]
    assert asked and min(e["ts"] for e in asked) < first_16
    restart = named(evs, "restart")[0]
    assert restart["device_map"] == [1, 0]  # the re-run lands on the other device
    (verdict,) = _verdicts(run_dir)
    assert verdict["diagnostic"] == "PERSISTENT_ERROR"
    assert verdict["rank"] == 1 and verdict["suspicious_device"] == "1"
    assert verdict["device"] == "0" and verdict["iteration"] == 5
    s = summary(run_dir)
    assert s["next_action"]["requeue"] is True and s["next_action"]["exclude_nodes"] == [s["host"]]
    assert "device 1" in s["next_action"]["why"]


def test_bad_data_is_a_correct_result_and_stops_without_skip(run_dir):
    res = _launch(run_dir, "data")
    assert res.returncode == 17, res.stdout[-3000:]
    assert [v["diagnostic"] for v in _verdicts(run_dir)] == ["CORRECT_RESULT"]
    s = summary(run_dir)
    assert s["next_action"]["requeue"] is False and "--ft-skip-bad-iterations" in s["reason"]


def test_bad_data_is_skipped_with_skip_bad_iterations(run_dir):
    res = _launch(run_dir, "data", "--ft-skip-bad-iterations")
    assert res.returncode == 0, res.stdout[-3000:]
    result = json.loads((run_dir / "ckpt_rerun" / "result.json").read_text())
    assert result["skipped"] == [5] and result["last_step"] == 8
    assert 5 not in {int(k) for k in result["losses"]}
    reasons = [e["reason"] for e in named(events(run_dir), "decision")]
    assert any("bad data" in r for r in reasons)


def test_transient_error_restarts_in_place_and_training_continues(run_dir):
    res = _launch(run_dir, "transient")
    assert res.returncode == 0, res.stdout[-3000:]
    assert [v["diagnostic"] for v in _verdicts(run_dir)] == ["TRANSIENT_ERROR"]
    restart = named(events(run_dir), "restart")[0]
    assert "transient error" in restart["reason"]
    assert restart["device_map"] == [0, 1]  # in place: no rotation
    result = json.loads((run_dir / "ckpt_rerun" / "result.json").read_text())
    assert result["skipped"] == [] and result["last_step"] == 8


def test_the_step_to_re_run_is_resumed_from_a_snapshot_instead_of_a_disk_checkpoint(run_dir):
    res = _launch(run_dir, "device", "--ft-snapshot-every", "1", script_flags=["--snapshots"])
    assert res.returncode == 17, res.stdout[-3000:]
    assert not list((run_dir / "ckpt_rerun").glob("rank_*.pt"))  # no disk checkpoint at all
    evs = events(run_dir)
    restored = [e for e in named(evs, "snapshot_restored") if e["cycle"] == 1]
    # the state the machine asked for before exit 16: the end of step 4, before step 5
    assert sorted(e["rank"] for e in restored) == [0, 1]
    assert {e["iteration"] for e in restored} == {4}
    (verdict,) = _verdicts(run_dir)
    assert verdict["diagnostic"] == "PERSISTENT_ERROR" and verdict["iteration"] == 5
