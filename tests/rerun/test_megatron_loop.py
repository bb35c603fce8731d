"""Megatron-LM's train() loop, ported by changing one import, on 1 and 2 gloo ranks.

tests/rerun/megatron_loop.py emulates the loop (see its docstring); one launch per world
size runs every scenario below, each a series of jobs like a requeued Slurm job, and each
test asserts one point of issue 13 step by step and sample id by sample id. Megatron's own
behaviour for each case is in the test's docstring.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rerun_test_support import clean_rerun_globals  # noqa: F401

LOOP = Path(__file__).with_name("megatron_loop.py")
MBS, MICROBATCHES = 2, 2
NAN = "found NaN in local forward loss calculation"


def ids(step: int, rank: int, world: int) -> list[int]:
    """The sample ids Megatron's sampler gives ``rank`` at 1-based ``step``."""
    out = []
    for m in range(MICROBATCHES):
        first = (step - 1) * MBS * world * MICROBATCHES + m * MBS * world + rank * MBS
        out.extend(range(first, first + MBS))
    return out


def first_sample(step: int, world: int) -> int:
    return (step - 1) * MBS * world * MICROBATCHES


def scenarios(world: int) -> dict:
    last = world - 1  # the rank that sees the faults
    devices = [str(r) for r in range(world)]
    moved = [str(r + 4) for r in range(world)]  # every rank on another device
    bad_sample = ids(3, last, world)[0]
    kv = ("ts=2025-01-01 10:00:00.5 node=n1 device=0 jobID={job} rank={rank} iteration={it} "
          "status={status} result=tensor(nan, device='cuda:0') message='{msg}'")
    return {
        "exit16": {"train_iters": 5, "jobs": [
            {"devices": devices, "faults": [
                {"kind": "device", "rank": last, "device": str(last), "step": 3}]},
            {"devices": devices, "faults": [  # resumed on the suspicious device again
                {"kind": "device", "rank": last, "device": str(last), "step": 3}]},
            {"devices": moved, "faults": [
                {"kind": "device", "rank": last, "device": str(last), "step": 3}]},
        ]},
        "transient17": {"train_iters": 5, "jobs": [
            {"devices": devices, "faults": [{"kind": "transient", "rank": last, "step": 3}]},
            {"devices": devices},
        ]},
        "skip": {"train_iters": 5, "jobs": [
            {"devices": devices, "faults": [{"kind": "data", "sample": bad_sample}]},
            {"devices": moved, "faults": [{"kind": "data", "sample": bad_sample}]},
            {"devices": moved, "faults": [{"kind": "data", "sample": bad_sample}],
             "share_skip": True},
        ]},
        "tracker": {"train_iters": 4, "jobs": [{"devices": devices, "share_skip": True}],
                    "tracker_lines": [
            kv.format(job=7, rank=last, it=2, status="RerunValidationStatus.INITIAL_RUN",
                      msg=NAN),
            kv.format(job=7, rank=last, it=2, status="rerun_disabled", msg=NAN),  # 3.10
            "ts=garbage rank=x",
            kv.format(job=8, rank=last, it=2,
                      status="RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE", msg=NAN),
            # Fields inside the message are not read.
            kv.format(job=8, rank=last, it=1, status="initial_run",
                      msg="x rank=0 iteration=3 status=rerun_disabled result=1"),
            kv.format(job=8, rank=last, it=1, status="initial_run",
                      msg="x rank=0 iteration=3 status=rerun_disabled result=1"),
            # Step 4: reproduced twice on rank 0, but also by rank 1 in job 9: not skipped.
            kv.format(job=9, rank=0, it=4, status="rerun_disabled", msg=NAN),
            kv.format(job=9, rank=0, it=4, status="rerun_disabled", msg=NAN),
            kv.format(job=9, rank=1, it=4, status="rerun_disabled", msg=NAN),
            json.dumps({"rank": last, "iteration": 3, "status": "INITIAL_RUN"}),
        ]},
        "state_dicts": {"train_iters": 3, "jobs": [
            {"devices": devices, "faults": [
                {"kind": "device", "rank": last, "device": str(last), "step": 2}]},
            {"devices": devices, "rerun_ckpt_override": "none"},
            {"devices": devices, "rerun_ckpt_override": "empty"},
            {"devices": devices, "rerun_ckpt_override": "not_running"},
            {"devices": devices, "rerun_ckpt_override": "megatron"},
        ]},
        "no_megatron": {"train_iters": 3, "jobs": [
            {"devices": devices, "no_megatron": True, "faults": [
                {"kind": "device", "rank": last, "device": str(last), "step": 2}]},
            {"devices": moved, "no_megatron": True},
        ]},
        "report": {"train_iters": 4, "jobs": [
            {"devices": devices, "mode": "report_determinism_stats", "report_every": 2}]},
        "vanishing": {"train_iters": 3, "jobs": [
            {"devices": devices, "faults": [{"kind": "vanishing", "rank": last, "step": 2}]},
            {"devices": devices},
        ]},
        "share": {"train_iters": 3, "jobs": [
            {"devices": devices, "share_skip": True,
             "iterations_to_skip_by_rank": [[2]] + [[]] * (world - 1)},
        ]},
    }


def _launch(tmp: Path, world: int) -> dict[int, dict]:
    spec = {"scenarios": scenarios(world)}
    for name, scenario in spec["scenarios"].items():
        if "tracker_lines" in scenario:
            (tmp / name).mkdir(parents=True)
            (tmp / name / "tracker.txt").write_text("\n".join(scenario["tracker_lines"]) + "\n")
    (tmp / "spec.json").write_text(json.dumps(spec))
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        env.pop("SLURM_JOB_ID", None)
        procs.append(subprocess.Popen(
            [sys.executable, str(LOOP), str(tmp / "spec.json"), str(tmp)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return {r: json.loads((tmp / f"rank{r}.json").read_text())["scenarios"]
            for r in range(world)}


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def run(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"megatron{world}")
    return world, _launch(tmp, world), tmp


def steps(job: dict) -> list[tuple[int, str, list[list[int]]]]:
    return [(s["iteration"], s["kind"], s["passes"]) for s in job["steps"]]


def verdicts(job: dict) -> list[tuple[int, str | None, int | None]]:
    return [(e["iteration"], e["diagnostic"], e["exit_code"]) for e in job["events"]]


def test_resume_after_exit_16_reads_the_step_from_the_loader_once(run):
    """Megatron: the loader resumes at the checkpoint's consumed samples (the re-run step's
    first sample); the re-run reads the step from it and the next step reads the next
    samples. Before: the saved buffer was replayed on top, the loader stayed behind."""
    world, ranks, _ = run
    last = world - 1
    for rank, result in ranks.items():
        first, same_device, moved = result["exit16"]
        expected = [(1, "train", [ids(1, rank, world)]), (2, "train", [ids(2, rank, world)]),
                    (3, "train", [ids(3, rank, world)] * 2)]
        assert steps(first) == expected
        assert first["exit_code"] == 16 and first["log"] == ["saved checkpoint at iteration 2"]
        for job in (same_device, moved):
            # One pass of step 3, from the loader, with the samples the first run read.
            assert steps(job) == [(3, "train", [ids(3, rank, world)])]
            # The loader is at step 4's first sample: the next step reads the next samples.
            assert job["next_sample"] == first_sample(4, world)
        assert same_device["exit_code"] == 16
        assert moved["exit_code"] == 17
        if rank == last:
            assert same_device["after_load"]["flags"] == [True, True, False, False]
            assert verdicts(first) == [(3, None, None), (3, None, 16)]
            assert verdicts(moved)[-1] == (3, "PERSISTENT_ERROR", 17)
            assert moved["suspicious_device"] == last  # Megatron's type: the device index
            assert type(moved["suspicious_device"]) is int
        assert not any("other microbatches" in line for line in moved["rerun_log"])


def test_resume_after_transient_exit_17_continues_without_repeats(run):
    """Megatron 0.16: TypeError on resume (no saved RNG state). Here the checkpoint of the
    exit resumes: step 3 runs once more as a plain step, then 4 and 5, no sample twice."""
    world, ranks, _ = run
    for rank, result in ranks.items():
        first, second = result["transient17"]
        assert steps(first)[-1] == (3, "train", [ids(3, rank, world)] * 2)
        assert first["exit_code"] == 17 and first["log"] == ["saved checkpoint at iteration 2"]
        assert steps(second) == [(s, "train", [ids(s, rank, world)]) for s in (3, 4, 5)]
        assert second["exit_code"] == 0 and second["events"] == []
        trained = [i for s in second["steps"] for i in s["trained"]]
        assert len(trained) == len(set(trained))


def test_skipping_the_pending_step_trains_new_samples_and_finishes(run):
    """Bad data at step 3: 16, then CORRECT_RESULT (17) on other devices; the tracker lists
    step 3 (points 3 and 4). The third job skips it with Megatron's dummy_train_step: the
    dummy reads step 3's samples, the pending diagnosis is dropped, steps 4 and 5 train new
    samples and the job ends 0. Megatron: exit 17 forever; before: step 4 trained step 3's
    samples."""
    world, ranks, _ = run
    last = world - 1
    for rank, result in ranks.items():
        first, correct, skipped = result["skip"]
        assert first["exit_code"] == 16 and correct["exit_code"] == 17
        assert steps(correct) == [(3, "train", [ids(3, rank, world)])]
        assert skipped["iterations_to_skip"] == [3]
        assert steps(skipped) == [(3, "dummy", [ids(3, rank, world)]),
                                  (4, "train", [ids(4, rank, world)]),
                                  (5, "train", [ids(5, rank, world)])]
        assert [s.get("trained") for s in skipped["steps"]] == [
            None, ids(4, rank, world), ids(5, rank, world)]
        assert skipped["exit_code"] == 0
        if rank == last:
            assert verdicts(correct)[-1] == (3, "CORRECT_RESULT", 17)
            assert verdicts(skipped) == [(3, None, None)]
            assert "abandoned" in skipped["events"][0]["message"]


def test_megatron_tracker_file_is_read_with_its_skip_rule(run):
    """key=value lines in both status spellings are read; a malformed line is skipped, not
    the rest; fields in the message are not read; a step reported by two ranks in one job is
    not skipped (Megatron's rule)."""
    world, ranks, _ = run
    for rank, result in ranks.items():
        (job,) = result["tracker"]
        assert job["iterations_to_skip"] == [2]
        assert steps(job) == [(1, "train", [ids(1, rank, world)]),
                              (2, "dummy", [ids(2, rank, world)]),
                              (3, "train", [ids(3, rank, world)]),
                              (4, "train", [ids(4, rank, world)])]
        assert job["exit_code"] == 0
        assert any("line 3 skipped" in line for line in job["rerun_log"])
        assert any("several ranks of one job" in line and "[4]" in line
                   for line in job["rerun_log"])


def test_old_or_foreign_rerun_state_starts_fresh(run):
    """None, {}, NOT_RUNNING_YET and a Megatron-Core dict: validate_state_dict is False
    without raising, the machine starts fresh (one warning for Megatron's), and the job
    trains from the checkpoint with the loader's samples."""
    world, ranks, _ = run
    for rank, result in ranks.items():
        first, *fresh = result["state_dicts"]
        assert first["exit_code"] == 16
        for job in fresh:
            assert job["after_load"]["state"] == "NOT_RUNNING_YET"
            assert steps(job) == [(2, "train", [ids(2, rank, world)]),
                                  (3, "train", [ids(3, rank, world)])]
            assert job["exit_code"] == 0 and job["events"] == []
            assert not any("Unable to restore" in line for line in job["log"])
        warned = [[line for line in job["rerun_log"] if "ignored, starting fresh" in line]
                  for job in fresh]
        assert [len(w) for w in warned] == [0, 0, 0, 1]


def test_per_rank_state_needs_megatron_or_every_rank_drops_it(run):
    """torch_dist without Megatron-Core: the per-rank part is plain data, stored once from
    rank 0 like any common entry. Rank 1 must not take rank 0's copy: it refuses it, and
    every rank then drops the diagnosis (one all-reduce) instead of mismatching collectives.
    With one rank its own copy resumes normally."""
    world, ranks, _ = run
    for rank, result in ranks.items():
        first, second = result["no_megatron"]
        assert first["exit_code"] == 16
        if world == 1:
            assert steps(second) == [(2, "train", [ids(2, rank, world)])]
            assert second["exit_code"] == 17
            continue
        assert steps(second) == [(2, "train", [ids(2, rank, world)]),
                                 (3, "train", [ids(3, rank, world)])]
        assert second["exit_code"] == 0
        if rank == 1:
            assert any("saved by rank 0, loaded by 1" in line for line in second["log"])
        assert any("not restored on every rank" in line or "other ranks resumed" in line
                   for line in second["rerun_log"])


def test_report_determinism_stats_reruns_only_validated_steps(run):
    """Megatron: a step re-runs when any rank validated something in it."""
    world, ranks, _ = run
    for result in ranks.values():
        (job,) = result["report"]
        assert [len(s["passes"]) for s in job["steps"]] == [1, 2, 1, 2]
        assert all(p == s["passes"][0] for s in job["steps"] for p in s["passes"])
        assert job["exit_code"] == 0
    stats = ranks[0]["report"][0]["stats"]
    assert stats[NAN] == f"{2 * MICROBATCHES * world} samples, all identical"


def test_check_missing_from_the_rerun_gives_no_verdict_and_no_record(run):
    """Megatron: no comparison, no tracker line, exit 17. Before: a TRANSIENT_ERROR verdict
    and a FIRST_RERUN_NOT_REPRODUCIBLE line that never happened."""
    world, ranks, tmp = run
    lines = [json.loads(x) for x in (tmp / "vanishing" / "tracker.txt").read_text().splitlines()]
    assert [(x["rank"], x["iteration"], x["status"]) for x in lines] == [
        (world - 1, 2, "INITIAL_RUN")]
    last = world - 1
    for rank, result in ranks.items():
        first, resumed = result["vanishing"]
        assert steps(first)[-1] == (2, "train", [ids(2, rank, world)] * 2)
        assert first["exit_code"] == 17
        assert all(e["diagnostic"] is None for e in first["events"])
        if rank == last:
            assert "did not reach the rejected check" in first["events"][-1]["message"]
        assert steps(resumed) == [(2, "train", [ids(2, rank, world)]),
                                  (3, "train", [ids(3, rank, world)])]


def test_first_iteration_complete_and_no_autograd_warning(run):
    world, ranks, _ = run
    for result in ranks.values():
        for name, jobs in result.items():
            for job in jobs:
                assert job["warnings"] == [], (name, job["warnings"])
                assert job["after_load"]["first_iteration_complete"] is False
                if any(s["kind"] == "train" for s in job["steps"]):
                    assert job["first_iteration_complete"] is True


def test_share_iterations_to_skip_gives_every_rank_rank_0s_list(run):
    world, ranks, _ = run
    for result in ranks.values():
        (job,) = result["share"]
        assert job["iterations_to_skip"] == [2]
        assert [s["kind"] for s in job["steps"]] == ["train", "dummy", "train"]
        assert job["exit_code"] == 0
