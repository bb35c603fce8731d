"""The wrapper's decision table (scripts/slurm/next_action.py), without a cluster.

Real summary.json files written the way ft_launcher writes them; the real-Slurm runs of
the same paths are in test_ft_sbatch.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import SLURM_DIR

_spec = importlib.util.spec_from_file_location("ft_next_action", SLURM_DIR / "next_action.py")
assert _spec is not None and _spec.loader is not None
na = importlib.util.module_from_spec(_spec)
sys.modules["ft_next_action"] = na  # dataclasses look their module up by name
_spec.loader.exec_module(na)


def write_summary(path: Path, code: int, requeue: bool, exclude: list[str] | None = None,
                  why: str = "", host: str = "vm") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "version": 1, "host": host, "exit_code": code, "reason": why,
        "next_action": {"requeue": requeue, "exclude_nodes": exclude or [], "why": why},
    }))
    return path


def decide(tmp_path: Path, launcher_exit: int, summaries: dict[str, Path] | None = None,
           **kw: Any):
    if summaries is None:
        summaries = {"node1": tmp_path / "summary.json"}
    nodes = [na.read_summary(n, p) for n, p in summaries.items()]
    inp = na.Inputs(launcher_exit=launcher_exit, nodes=nodes,
                    partition_nodes=kw.pop("partition_nodes", ["node1", "node2"]), **kw)
    return na.decide(inp)


def test_exit_0_is_finished(tmp_path):
    write_summary(tmp_path / "summary.json", 0, False, why="all workers finished with 0")
    d = decide(tmp_path, 0)
    assert (d.action, d.exit_code) == ("finished", 0)


def test_exit_0_without_the_finished_flag_file_is_requeued(tmp_path):
    write_summary(tmp_path / "summary.json", 0, False)
    flag = tmp_path / "done.flag"
    d = decide(tmp_path, 0, finished_flag_file=str(flag))
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 1, [])
    assert f"{flag} does not exist: not finished" in d.why
    flag.touch()
    assert decide(tmp_path, 0, finished_flag_file=str(flag)).action == "finished"


def test_exit_0_after_usr1_is_a_checkpoint_not_the_end(tmp_path):
    write_summary(tmp_path / "summary.json", 0, False)
    d = decide(tmp_path, 0, got_usr1=True)
    assert d.action == "requeue"
    assert "exit 0 after USR1" in d.why
    flag = tmp_path / "done.flag"
    flag.touch()  # the training says it is done: USR1 or not, nothing left to run
    assert decide(tmp_path, 0, got_usr1=True, finished_flag_file=str(flag)).action == "finished"


def test_exit_16_excludes_the_slurm_node_not_the_hostname(tmp_path):
    write_summary(tmp_path / "summary.json", 16, True, ["vm"], why="exit 16: no device left")
    d = decide(tmp_path, 16)
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 16, ["node1"])
    assert d.why.endswith("requeue 1 of 3 excluding node1")


def test_exclusions_merge_with_the_jobs_existing_ones(tmp_path):
    write_summary(tmp_path / "summary.json", 16, True, ["vm"], why="exit 16")
    d = decide(tmp_path, 16, excluded=["node7"], partition_nodes=["node1", "node2", "node7"])
    assert (d.action, d.exclude) == ("requeue", ["node1", "node7"])


def test_exclusion_that_leaves_too_few_nodes_stops(tmp_path):
    write_summary(tmp_path / "summary.json", 16, True, ["vm"], why="exit 16")
    d = decide(tmp_path, 16, excluded=["node2"])
    assert (d.action, d.exit_code) == ("stop", 16)
    assert "excluding node1,node2 would leave 0 node(s) for a 1-node job" in d.why


def test_no_requeue_stops_with_the_launchers_code_and_why(tmp_path):
    write_summary(tmp_path / "summary.json", 17, False,
                  why="exit 17 without a diagnosis from the rank")
    d = decide(tmp_path, 17)
    assert (d.action, d.exit_code) == ("stop", 17)
    assert d.why == "node1: exit 17 without a diagnosis from the rank; not requeued"


def test_missing_summary_means_a_crash_and_a_requeue(tmp_path):
    d = decide(tmp_path, 137)
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 137, [])
    assert "the launcher on node1 crashed?" in d.why


def test_broken_summary_counts_as_missing(tmp_path):
    (tmp_path / "summary.json").write_text("{not json")
    d = decide(tmp_path, 1)
    assert d.action == "requeue" and "unreadable" in d.why


def test_budget_spent_stops(tmp_path):
    write_summary(tmp_path / "summary.json", 1, True, why="restarts exhausted")
    d = decide(tmp_path, 1, restart_count=2, max_resubmissions=2)
    assert (d.action, d.exit_code) == ("stop", 1)
    assert "resubmission budget spent (2 of 2 requeues done)" in d.why
    assert decide(tmp_path, 1, restart_count=1, max_resubmissions=2).action == "requeue"


def test_sigterm_leaves_the_job_to_slurm(tmp_path):
    # scancel: slurmstepd TERMs the workers too, so the launcher may report a plain failure
    write_summary(tmp_path / "summary.json", 1, True, why="rank 0 failed (signal SIGTERM)")
    d = decide(tmp_path, 1, got_term=True)
    assert (d.action, d.exit_code) == ("stop", 1)


def test_two_nodes_on_one_host_blame_the_node_whose_summary_failed(tmp_path):
    s1 = write_summary(tmp_path / "node1" / "summary.json", 0, False)
    s2 = write_summary(tmp_path / "node2" / "summary.json", 16, True, ["vm"], why="exit 16")
    d = decide(tmp_path, 143, {"node1": s1, "node2": s2}, nnodes=1,
               partition_nodes=["node1", "node2", "node3"])
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 16, ["node2"])


def test_a_node_named_by_another_summary_host_is_mapped(tmp_path):
    # real cluster: host names are distinct, and a summary may name another node's host
    s1 = write_summary(tmp_path / "a" / "summary.json", 1, True, ["hostb"], host="hosta")
    s2 = write_summary(tmp_path / "b" / "summary.json", 1, True, [], host="hostb")
    d = decide(tmp_path, 1, {"a": s1, "b": s2}, partition_nodes=["a", "b", "c"])
    assert d.exclude == ["b"]


def test_an_unknown_host_is_reported_not_excluded(tmp_path):
    write_summary(tmp_path / "summary.json", 1, True, ["elsewhere"], why="asked")
    d = decide(tmp_path, 1)
    assert (d.action, d.exclude) == ("requeue", [])
    assert "cannot map elsewhere to Slurm nodes, not excluded" in d.why


def test_usr1_before_the_launch_requeues(tmp_path):
    inp = na.Inputs(launcher_exit=0, nodes=[], got_usr1=True, not_started=True)
    assert na.decide(inp).action == "requeue"


def test_cli_prints_key_value_lines(tmp_path):
    s = write_summary(tmp_path / "summary.json", 16, True, ["vm"], why="exit 16:\nno device")
    out = subprocess.run(
        [sys.executable, str(SLURM_DIR / "next_action.py"), "--launcher-exit", "16",
         "--summary", f"node1={s}", "--restart-count", "", "--max-resubmissions", "2",
         "--excluded", "(null)", "--partition-nodes", "node1,node2"],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "action=requeue", "exit_code=16", "exclude=node1",
        "why=node1: exit 16: no device; requeue 1 of 2 excluding node1"]


@pytest.mark.parametrize("args, message", [
    (["--launcher-exit", "x", "--summary", "n=p"], "--launcher-exit must be a non-negative"),
    (["--launcher-exit", "1", "--summary", "nodeonly"], "--summary must be NODE=PATH"),
    (["--launcher-exit", "1"], "--summary NODE=PATH is required"),
])
def test_cli_usage_errors_are_one_line(args, message):
    out = subprocess.run([sys.executable, str(SLURM_DIR / "next_action.py"), *args],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr
