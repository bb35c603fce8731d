"""Real 2-rank jobs (gloo, CPU) driven by the rerun state machine, end to end.

Each launch starts tests/rerun/worker.py twice (rank 0 and 1), each in its own session, as
a fork of a forkserver that imported torch once for the module (tests/rerun/forked_worker.py
says what a fork shares with a fresh interpreter and what it does not); it waits with a
deadline and kills both sessions on timeout, so no process outlives a test, and the module
stops its forkserver at the end.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import forked_worker
import pytest
from rerun_test_support import clean_rerun_globals  # noqa: F401

from rerun import RerunStateMachine

WORKER = Path(__file__).with_name("worker.py")
LAUNCH_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def forks():
    """The module's forkserver, with torch and the rerun package imported; stopped at the
    end (multiprocessing would keep it until this test process exits)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(forked_worker.PRELOAD)
    yield ctx
    multiprocessing.forkserver._forkserver._stop()


def launch(forks, tmp: Path, name: str, *args: str, devices=("0", "1")) -> list[dict]:
    """Run a 2-rank job; return per rank {"rc", "output", "events", "result"}."""
    port = _free_port()
    procs, logs = [], []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            FT_DEVICE_ID=devices[rank],
            OMP_NUM_THREADS="1",
        )
        argv = [*args, "--out", str(tmp / f"{name}.{rank}.json")]
        logs.append(tmp / f"{name}.{rank}.log")
        proc = forks.Process(target=forked_worker.run_script,
                             args=(str(WORKER), argv, env, str(logs[-1])))
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            pytest.fail(f"{name}: workers still running after {LAUNCH_TIMEOUT_S}s")
    finally:
        for p in procs:
            if p.is_alive():
                os.killpg(p.pid, signal.SIGKILL)  # its session: the fork and any child
                p.join()
    ranks = []
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        out = log.read_text() if log.exists() else ""
        path = tmp / f"{name}.{rank}.json"
        assert path.exists(), f"{name} rank {rank} rc={p.exitcode} wrote nothing:\n{out}"
        data = json.loads(path.read_text())
        ranks.append({"rc": p.exitcode, "output": out, **data})
    return ranks


def verdicts(rank: dict) -> list[tuple[int, str | None, int | None]]:
    return [(e["iteration"], e["diagnostic"], e["exit_code"]) for e in rank["events"]]


def passes(rank: dict, result_key: str | None = None) -> dict[int, int]:
    result = rank["result"] if result_key is None else rank["result"][result_key]
    return {int(k): v for k, v in result["passes"].items()}


def test_transient_errors_stale_failure_and_resume_after_exit_17(forks, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # Rank 1 fails a non-fatal check at step 2, rank 0 at step 4 (where rank 1's stale step-2
    # failure must not be judged), then rank 1 a fatal one at step 6.
    r0, r1 = launch(
        forks, tmp_path, "a", "--ckpt", str(ckpt), "--steps", "8",
        "--inject", "1:2:transient:aux", "--inject", "0:4:transient:aux",
        "--inject", "1:6:transient:loss",
    )
    assert (r0["rc"], r1["rc"]) == (17, 17), r0["output"] + r1["output"]
    for r in (r0, r1):  # every rank re-ran exactly the rejected steps
        assert passes(r) == {1: 1, 2: 2, 3: 1, 4: 2, 5: 1, 6: 2}
    assert verdicts(r1) == [
        (2, None, None), (2, "TRANSIENT_ERROR", None),
        (6, None, None), (6, "TRANSIENT_ERROR", 17),
    ]
    assert verdicts(r0) == [(4, None, None), (4, "TRANSIENT_ERROR", None), (6, None, 17)]
    assert all(isinstance(e["fatal"], bool) for e in r1["events"])
    lines = [json.loads(x) for x in (ckpt / "tracker.jsonl").read_text().splitlines()]
    assert [(x["rank"], x["iteration"], x["status"]) for x in lines] == [
        (1, 2, "INITIAL_RUN"), (1, 2, "FIRST_RERUN_NOT_REPRODUCIBLE"),
        (0, 4, "INITIAL_RUN"), (0, 4, "FIRST_RERUN_NOT_REPRODUCIBLE"),
        (1, 6, "INITIAL_RUN"), (1, 6, "FIRST_RERUN_NOT_REPRODUCIBLE"),
    ]

    # Resuming the exit-17 checkpoint runs step 6 again as a plain step (Megatron crashes).
    r0, r1 = launch(forks, tmp_path, "b", "--ckpt", str(ckpt), "--steps", "8")
    assert (r0["rc"], r1["rc"]) == (0, 0), r0["output"] + r1["output"]
    for r in (r0, r1):
        assert r["result"]["first_step"] == 6
        assert passes(r) == {6: 1, 7: 1, 8: 1}
        assert r["events"] == []


def test_persistent_error_correct_result_and_skip(forks, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    faulty = ["--steps", "5", "--inject", "1:3:device=1:loss"]
    r0, r1 = launch(forks, tmp_path, "first", "--ckpt", str(ckpt), *faulty)
    assert (r0["rc"], r1["rc"]) == (16, 16), r0["output"] + r1["output"]
    assert passes(r0) == passes(r1) == {1: 1, 2: 1, 3: 2}
    assert verdicts(r1) == [(3, None, None), (3, None, 16)]
    assert r1["events"][-1]["suspicious_device"] == "1"
    assert r1["events"][-1]["state"] == "WILL_RERUN_FROM_CHECKPOINT"
    assert verdicts(r0) == [(3, None, 16)]
    saved = tmp_path / "saved"
    shutil.copytree(ckpt, saved)

    # Same devices again: the suspicious device cannot judge itself; asks 16 again.
    r0, r1 = launch(forks, tmp_path, "same", "--ckpt", str(ckpt), *faulty)
    assert (r0["rc"], r1["rc"]) == (16, 16), r0["output"] + r1["output"]
    assert passes(r1) == {3: 1}
    assert verdicts(r1) == [(3, None, 16)]
    assert r1["events"][-1]["state"] == "RERUNNING_AGAIN_FROM_CHECKPOINT"

    # Devices rotated: rank 1 now computes on device 0, gets no NaN: persistent error.
    r0, r1 = launch(forks, tmp_path, "other", "--ckpt", str(ckpt), *faulty, devices=("1", "0"))
    assert (r0["rc"], r1["rc"]) == (17, 17), r0["output"] + r1["output"]
    assert verdicts(r1) == [(3, "PERSISTENT_ERROR", 17)]
    assert verdicts(r0) == [(3, None, 17)]

    # The same checkpoint, but the input itself gives NaN: a correct result.
    r0, r1 = launch(
        forks, tmp_path, "correct", "--ckpt", str(saved), "--steps", "5",
        "--inject", "1:3:always:loss", devices=("1", "0"),
    )
    assert (r0["rc"], r1["rc"]) == (17, 17), r0["output"] + r1["output"]
    assert verdicts(r1) == [(3, "CORRECT_RESULT", 17)]
    assert RerunStateMachine.get_skipped_iterations_from_tracker_file(
        str(saved / "tracker.jsonl")) == [3]

    # Resubmitted, skipping step 3 whose diagnosis the checkpoint still holds: it must not
    # loop on exit 17; training goes on to the end.
    r0, r1 = launch(
        forks, tmp_path, "skip", "--ckpt", str(saved), "--steps", "5",
        "--inject", "1:3:always:loss", "--skip-from-tracker", devices=("1", "0"),
    )
    assert (r0["rc"], r1["rc"]) == (0, 0), r0["output"] + r1["output"]
    assert r1["result"]["skip"] == [3]
    assert passes(r1) == {3: 1, 4: 1, 5: 1}
    assert verdicts(r1) == [(3, None, None)]
    assert "abandoned" in r1["events"][0]["message"]


def test_reruns_are_bit_identical_without_injection(forks, tmp_path):
    (r0, r1) = launch(forks, tmp_path, "det", "--mode", "determinism", "--steps", "4")
    assert (r0["rc"], r1["rc"]) == (0, 0), r0["output"] + r1["output"]
    for r in (r0, r1):
        res = r["result"]
        assert passes(r, "disabled") == {1: 1, 2: 1, 3: 1, 4: 1}
        assert passes(r, "validate") == {1: 1, 2: 1, 3: 1, 4: 1}
        assert passes(r, "report") == {1: 2, 2: 2, 3: 2, 4: 2}
        # Both passes of each step computed the same loss, bit for bit.
        assert all(a == b for a, b in res["report"]["losses"].values())
        # And the machine changed nothing about training itself.
        assert res["disabled"]["params"] == res["validate"]["params"] == res["report"]["params"]
        assert r["events"] == []
    # Rank 0 gathered both ranks' spreads: 4 steps x 2 ranks, all identical.
    assert r0["result"]["report"]["stats"] == {
        "loss is NaN": "8 samples, all identical",
        "output is NaN": "8 samples, all identical",
    }
