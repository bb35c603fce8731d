"""The supervisor's use of health checks and hot spares, end to end.

The supervisor runs ``run_health_checks`` before every rendezvous and turns a failure
into an exit with ``next_action`` requeue excluding this host.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from .conftest import LAUNCHER, ROOT, Nodes, wait_until


def test_a_failed_health_check_keeps_the_node_out_and_requeues_without_it(run_dir):
    res = subprocess.run(  # the worker would be `true`: it must not even start
        [*LAUNCHER, "--ft-run-dir", str(run_dir), "--ft-health-check", "true",
         "--ft-health-check", "echo gpu 3 is sad; exit 4", "--ft-health-check-timeout", "5",
         "--no-python", "true"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=os.environ)
    events = Nodes(run_dir.parent, []).events(run_dir.name)
    names = [e["event"] for e in events]
    failed = [e for e in events if e["event"] == "health_check_failed"]
    assert len(failed) == 1, names
    assert failed[0]["check"] == "echo gpu 3 is sad; exit 4"
    assert failed[0]["exit_code"] == 4 and "gpu 3 is sad" in failed[0]["output"]
    assert "workers_started" not in names and "rendezvous_done" not in names
    assert res.returncode == 1, res.stderr[-2000:]
    summary = Nodes(run_dir.parent, []).summary(run_dir.name)
    assert summary["next_action"]["requeue"] is True
    assert summary["next_action"]["exclude_nodes"] == [socket.gethostname()]
    assert "health check failed" in summary["reason"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_node_that_turns_sick_leaves_and_a_spare_takes_its_place(etcd3_cluster, nodes):
    # etcd: with c10d the sick node might host the store and take it along. Here the sick
    # node coordinates (it came first): the spare elects itself when it leaves.
    nodes.common = ["--nnodes", "1:1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                    "--rdzv-endpoint", etcd3_cluster.endpoints, "--rdzv-id",
                    f"sick-{time.time_ns()}", "--max-restarts", "3",
                    "--workers-stop-timeout", "2"]
    sick = nodes.out / "a_is_sick"
    nodes.start("a", "--ft-health-check", f"test ! -e {sick}")
    wait_until(lambda: [s for s in nodes.steps() if s["node"] == "a"], 120, "a to train")
    nodes.start("b")
    wait_until(lambda: nodes.events("b", "spare_waiting"), 60, "b to wait as a spare")

    sick.touch()
    worker = nodes.events("a", "workers_started")[-1]["pids"][0]
    os.kill(worker, 9)  # a restarts, checks itself before the rendezvous, and leaves
    failed = wait_until(lambda: nodes.events("a", "health_check_failed"), 20, "a's check")
    assert failed[0]["check"] == f"test ! -e {sick}" and failed[0]["exit_code"] == 1
    assert nodes.wait("a", 60) == 1
    assert nodes.summary("a")["next_action"]["exclude_nodes"] == [socket.gethostname()]
    wait_until(lambda: nodes.events("b", "spare_admitted"), 60, "b to be admitted")
    wait_until(lambda: [s for s in nodes.steps() if s["node"] == "b"], 120, "b to train")
    nodes.stop_training()
    assert nodes.wait("b", 60) == 0, nodes.log("b")

