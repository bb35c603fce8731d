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
                  why: str = "", host: str = "vm", workers: list[dict] | None = None,
                  outcome: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = {"version": 1, "host": host, "exit_code": code, "reason": why,
               "next_action": {"requeue": requeue, "exclude_nodes": exclude or [], "why": why}}
    if outcome is not None:  # the last cycle's outcome; summaries before it had none
        summary["outcome"] = outcome
    if workers is not None:  # ft_launcher writes the list; older tests leave it out
        summary["workers"] = workers
    path.write_text(json.dumps(summary))
    return path


TRAINED = [{"cycle": 0, "rank": 0, "exit_code": 0}]  # a node whose workers ran and exited 0
SICK = "health check failed: test $SLURMD_NODENAME != node1 (exit 1)"


def three_nodes(tmp_path: Path, node1: tuple | None, node2: tuple, node3: tuple
                ) -> dict[str, Path]:
    """Summaries of a 3-node allocation (node1's is not written when ``node1`` is None);
    each tuple is write_summary's (code, requeue, exclude, why, workers)."""
    out = {}
    for name, spec in (("node1", node1), ("node2", node2), ("node3", node3)):
        path = tmp_path / name / "summary.json"
        if spec is not None:
            code, requeue, exclude, why, workers = spec
            write_summary(path, code, requeue, exclude, why, workers=workers)
        out[name] = path
    return out


PARTITION = ["node1", "node2", "node3"]


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


def test_a_node_that_lost_the_rendezvous_does_not_give_the_job_its_code(tmp_path):
    # node2's rank exits 16; its launcher hosted the store, so node1's launcher loses the
    # rendezvous and exits 1 before srun's --kill-on-bad-exit reaches it (CI saw this race)
    lost = "rendezvous lost: the c10d store at 127.0.0.1:29595 is unreachable"
    s1 = write_summary(tmp_path / "node1" / "summary.json", 1, True, why=lost,
                       outcome="rendezvous_lost")
    s2 = write_summary(tmp_path / "node2" / "summary.json", 16, True, ["vm"], why="exit 16",
                       outcome="failed")
    d = decide(tmp_path, 143, {"node1": s1, "node2": s2}, nnodes=2,
               partition_nodes=["node1", "node2", "node3"])
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 16, ["node2"])
    assert lost in d.why  # still reported, only not the job's code
    # Alone, a lost rendezvous is the job's code (and no node is blamed for it).
    d = decide(tmp_path, 1, {"node1": s1}, nnodes=1)
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 1, [])


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
        "why=node1: exit 16: no device; requeue 1 of 2 excluding node1", "check_nodes="]


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


# ---------------------------------------------------------------- nodes that left the job

def test_a_node_that_failed_its_health_check_while_the_others_finished_is_reported(tmp_path):
    # --nodes 3, --nnodes 2:2: node1 failed its check and left; a spare took its place
    nodes = three_nodes(tmp_path, (1, True, ["vm"], SICK, []), (0, False, [], "done", TRAINED),
                        (0, False, [], "done", TRAINED))
    d = decide(tmp_path, 0, nodes, nnodes=3, partition_nodes=PARTITION)
    assert (d.action, d.exit_code, d.exclude) == ("finished", 0, [])
    assert d.why == ("training finished (the nodes that trained exited 0); 1 node(s) left "
                     "the job: node1")
    assert d.check_nodes == ["node1"]
    assert d.notes == [f"node1: {SICK}; it left the job and a spare took its place"]


def test_a_sick_node_is_excluded_when_the_job_is_requeued_anyway(tmp_path):
    # the same, but the training only checkpointed (USR1): the next run goes without node1
    nodes = three_nodes(tmp_path, (1, True, ["vm"], SICK, []), (0, False, [], "", TRAINED),
                        (0, False, [], "", TRAINED))
    d = decide(tmp_path, 0, nodes, nnodes=3, got_usr1=True,
               partition_nodes=[*PARTITION, "node4"])
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 1, ["node1"])
    assert d.check_nodes == ["node1"]


def test_a_node_with_no_summary_while_the_others_wrote_one_died_and_is_excluded(tmp_path):
    # -N 2 with no spare: node1's launcher was SIGKILLed, srun TERMed node2's
    nodes = three_nodes(tmp_path, None, (143, True, [], "launcher received SIGTERM", TRAINED),
                        (0, False, [], "", TRAINED))
    del nodes["node3"]
    d = decide(tmp_path, 137, nodes, nnodes=2, partition_nodes=PARTITION)
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 137, ["node1"])
    assert "the launcher on node1 crashed?" in d.why and "excluded: it died" in d.why
    assert d.why.endswith("requeue 1 of 3 excluding node1")


def test_no_summary_anywhere_blames_no_node(tmp_path):
    nodes = {"node1": tmp_path / "node1" / "summary.json",
             "node2": tmp_path / "node2" / "summary.json"}
    d = decide(tmp_path, 2, nodes, nnodes=2, partition_nodes=PARTITION)
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 2, [])


def test_a_dead_node_whose_spare_finished_the_job_is_reported_not_requeued(tmp_path):
    nodes = three_nodes(tmp_path, None, (0, False, [], "", TRAINED), (0, False, [], "", TRAINED))
    d = decide(tmp_path, 0, nodes, nnodes=3, partition_nodes=PARTITION)
    assert (d.action, d.exclude, d.check_nodes) == ("finished", [], ["node1"])
    assert d.notes[0].startswith("node1: left no summary.json (its launcher or the node died)")


def test_an_unneeded_spare_is_neither_a_failure_nor_the_node_that_finished(tmp_path):
    spare = (0, False, [], "spare not needed: the job ended without it", [])
    nodes = three_nodes(tmp_path, spare, (0, False, [], "", TRAINED), (0, False, [], "", TRAINED))
    d = decide(tmp_path, 0, nodes, nnodes=3, partition_nodes=PARTITION)
    assert (d.action, d.why, d.check_nodes) == (
        "finished", "training finished (every launcher exited 0)", [])
    # a failure elsewhere: requeued without blaming the spare
    nodes = three_nodes(tmp_path, spare, (16, True, ["vm"], "exit 16", TRAINED),
                        (143, True, [], "launcher received SIGTERM", TRAINED))
    d = decide(tmp_path, 16, nodes, nnodes=2, partition_nodes=PARTITION)
    assert (d.action, d.exit_code, d.exclude) == ("requeue", 16, ["node2"])
    # only spares exited 0: nobody trained, so the job is not finished
    nodes = three_nodes(tmp_path, spare, spare, spare)
    assert decide(tmp_path, 0, nodes, nnodes=3, partition_nodes=PARTITION).action == "requeue"


def test_a_node_that_stopped_the_job_wins_over_a_finished_launch(tmp_path):
    nodes = three_nodes(tmp_path, (17, False, [], "exit 17 without a diagnosis", TRAINED),
                        (0, False, [], "", TRAINED), (0, False, [], "", TRAINED))
    d = decide(tmp_path, 0, nodes, nnodes=3, partition_nodes=PARTITION)
    assert (d.action, d.exit_code) == ("stop", 17)


def test_cli_reports_the_nodes_to_check_and_records_the_decision(tmp_path):
    s1 = write_summary(tmp_path / "node1" / "summary.json", 1, True, ["vm"], SICK, workers=[])
    s2 = write_summary(tmp_path / "node2" / "summary.json", 0, False, workers=TRAINED)
    record = tmp_path / "verdicts.jsonl"
    args = [sys.executable, str(SLURM_DIR / "next_action.py"), "--launcher-exit", "0",
            "--summary", f"node1={s1}", "--summary", f"node2={s2}", "--nnodes", "2",
            "--partition-nodes", "node1,node2,node3", "--record", str(record)]
    for _ in range(2):
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "action=finished" and "check_nodes=node1" in lines
    assert f"note=node1: {SICK}; it left the job and a spare took its place" in lines
    verdicts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(verdicts) == 2  # appended, one line per run of the wrapper
    assert verdicts[0]["action"] == "finished" and verdicts[0]["check_nodes"] == ["node1"]
