"""The long goodput schedule and ours-snap in the benchmark driver: settings, argv, the fault
times, the work lost per fault, the targets. Pure logic, nothing started."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
import bench  # noqa: E402
import loopback_nodes  # noqa: E402
import measures  # noqa: E402
import nodes_run  # noqa: E402
import report  # noqa: E402
import runner  # noqa: E402
import workload  # noqa: E402


def test_ours_snap_is_ours_with_a_snapshot_every_step() -> None:
    lnch = measures.Launchers(ours=["ft_launcher"])
    ours = lnch.argv("ours", 2, 3, Path("/w"), ["--mode", "train"])
    snap = lnch.argv("ours-snap", 2, 3, Path("/w"), ["--mode", "train"])
    i = snap.index("--ft-snapshot-every")
    assert snap[i:i + 2] == ["--ft-snapshot-every", "1"]
    assert snap[:i] == ours[:i]
    # the same workload and client, plus the workload's --snapshots
    assert snap[i + 2:] == [*ours[i:], "--snapshots"]
    assert "--client" in snap and snap[snap.index("--client") + 1] == "ours"
    # the smoke's preload for ours applies to ours-snap too (ours with its defaults)
    smoke = lnch.argv("ours-snap", 2, 3, Path("/w"), [], ours_preload="json")
    assert smoke[smoke.index("--ft-preload") + 1] == "json"
    # the others keep disk checkpoints only
    lnch.nvrx = ["nvrx_launcher"]
    for other in ("torchrun", "nvrx", "ours", "ours-warm"):
        argv = lnch.argv(other, 2, 3, Path("/w"), ["--mode", "train"])
        assert "--snapshots" not in argv and "--ft-snapshot-every" not in argv, other


def test_ours_snap_runs_only_in_the_fixed_training_and_only_when_asked() -> None:
    assert "ours-snap" not in bench.ALL_LAUNCHERS  # the default run is unchanged
    every = list(bench.LAUNCHER_CHOICES)
    for kind in ("clean", "faulted"):
        assert "ours-snap" in bench.launchers_for(kind, every), kind
    for kind in ("heartbeat", "hang", "crash", "footprint", "training", "verdict"):
        assert "ours-snap" not in bench.launchers_for(kind, every), kind


def _args(*argv: str) -> argparse.Namespace:
    return bench.parse_args(list(argv))


def test_long_selects_goodput_for_ours_snap_torchrun_and_nvrx() -> None:
    assert bench._selection(_args("--long")) == (
        ["goodput"], ["ours-snap", "torchrun", "nvrx"], "long")
    assert bench._selection(_args("--long", "--launchers", "nvrx,ours-snap,ours")) == (
        ["goodput"], ["ours", "ours-snap", "nvrx"], "long")
    assert bench._selection(_args()) == (list(bench.ALL_MEASURES), list(bench.ALL_LAUNCHERS),
                                         "full")
    with pytest.raises(SystemExit, match="choose one"):
        bench._selection(_args("--long", "--smoke"))


def test_the_long_profile_trains_five_minutes_with_faults_at_a_third_and_two_thirds() -> None:
    s = bench.PROFILES["long"]
    sleep_s = s.train_steps * s.step_time  # a lower bound of the fault-free training
    assert sleep_s >= 300
    kill, hang = s.fault_at_s
    # ~1/3 and ~2/3 of a training of ~26 ms a step (the sleep and the DDP step here)
    expected_s = s.train_steps * 0.026
    assert kill == pytest.approx(expected_s / 3, rel=0.1)
    assert hang == pytest.approx(2 * expected_s / 3, rel=0.1) and hang < sleep_s
    # a few disk checkpoints in the run, the first before the kill
    assert s.ckpt_every * s.step_time < kill and s.train_steps // s.ckpt_every >= 4
    # room for a slow launcher's restarts, yet torchrun (which never sees the hang) ends
    assert 1.3 * sleep_s < s.goodput_bound_s < 3 * sleep_s
    assert not bench.PROFILES["full"].fault_at_s  # the short measure keeps its schedule
    notes = " ".join(bench.method(s))
    assert "130 s after the first step of cycle 0" in notes and "260 s after it" in notes
    assert "A lost node needs --nodes 2" in notes and "Nodes (--nodes" not in notes
    # 200 MB per rank in every checkpoint and snapshot, ours-snap snapshotting once a second
    assert s.state_mb == 200 and "200 MB of extra state per rank" in notes
    assert "--ft-snapshot-every 1s" in notes
    args = measures.Context(measures.Launchers(ours=["ft"]), s, Path("/r")).train_args(9)
    assert args[args.index("--state-mb") + 1] == "200"
    assert "--state-mb" not in measures.Context(measures.Launchers(ours=["ft"]),
                                                bench.PROFILES["full"], Path("/r")).train_args(9)
    snap = measures.Launchers(ours=["ft"]).argv("ours-snap", 2, 3, Path("/w"), [],
                                                snapshot_every=s.snapshot_every)
    assert snap[snap.index("--ft-snapshot-every") + 1] == "1s"


def test_fault_times_fixed_from_cycle_0_or_after_each_cycle() -> None:
    fixed = measures.Settings(fault_at_s=(100.0, 200.0))
    assert measures.fault_time(fixed, 0, 1000.0, 1000.0) == 1100.0
    assert measures.fault_time(fixed, 1, 1000.0, 1105.0) == 1200.0
    # a cycle that took its first step after the planned time gets the fault at once
    assert measures.fault_time(fixed, 1, 1000.0, 1230.0) == 1230.0
    per_cycle = measures.Settings(fault_after_s=1.5)
    assert measures.fault_time(per_cycle, 1, 1000.0, 1105.0) == 1106.5


def _first(pid: int, rank: int, t: float, step: int, source: str) -> dict:
    return {"ev": "first_step", "pid": pid, "rank": rank, "t": t, "step": step,
            "source": source}


def test_work_lost_is_the_step_reached_less_where_the_next_cycle_resumed() -> None:
    firsts = [_first(10, 0, 1.0, 1, "none"), _first(11, 1, 1.0, 1, "none"),
              _first(20, 0, 9.0, 401, "disk"), _first(21, 1, 9.1, 401, "disk"),
              _first(30, 0, 20.0, 777, "snapshot"), _first(31, 1, 20.0, 777, "snapshot")]
    cycle0 = frozenset({10, 11})
    assert measures.work_lost(firsts, 460, cycle0) == {
        "reached": 460, "resumed_from": 400, "source": "disk", "redone": 60}
    assert measures.work_lost(firsts, 777, cycle0 | {20, 21}) == {
        "reached": 777, "resumed_from": 776, "source": "snapshot", "redone": 1}
    # no next cycle (torchrun never restarts a hung rank), or the step unknown
    assert measures.work_lost(firsts, 800, frozenset({10, 11, 20, 21, 30, 31})) is None
    assert measures.work_lost(firsts, None, cycle0) is None


def test_resume_point_falls_back_to_disk_then_to_the_start() -> None:
    no_client = workload._NoClient()  # torchrun's: no restore(), so never a snapshot
    assert workload.resume_point(no_client, True, lambda: ({"step": 50}, 50)) == (
        {"step": 50}, 50, "disk")
    assert workload.resume_point(no_client, False, lambda: None) == (None, 0, "none")
    workload.offer_snapshot(no_client, True, lambda: pytest.fail("state built"), 3)


def _goodput(samples: dict[str, list[float | None]], bounded: tuple[str, ...] = ()
             ) -> dict:
    metric = next(m for m in report.METRICS if m.key == "goodput")
    raw = {x: [{"goodput": v, "bounded": ["goodput"] if x in bounded else []} for v in vs]
           for x, vs in samples.items()}
    return report.summarize(metric, raw)


def test_ours_snap_has_its_own_ratios_and_targets() -> None:
    row = _goodput({"ours-snap": [0.97, 0.96], "torchrun": [0.4, 0.4], "nvrx": [0.8, 0.9]},
                   bounded=("torchrun",))
    assert row["ratio_vs_ours_snap"]["nvrx"]["samples"] == [pytest.approx(0.97 / 0.8, 1e-3),
                                                            pytest.approx(0.96 / 0.9, 1e-3)]
    assert "ours-snap" not in row["ratio_vs_ours"]
    got = {t["target"]: t for t in report.snapshot_targets(row)}
    assert [t["met"] for t in got.values()] == [True, True, True]
    worst = next(t for t in got.values() if "every run" in t["target"])
    assert worst["value"] == 0.96

    row = _goodput({"ours-snap": [0.97, None], "nvrx": [0.8, 0.9]})
    got = report.snapshot_targets(row)
    assert [t["met"] for t in got] == [False, False]  # a run without a figure fails both
    row = _goodput({"ours-snap": [0.94, 0.99], "nvrx": [0.95, 0.5]})
    assert [t["met"] for t in report.snapshot_targets(row)] == [False, False]
    assert report.snapshot_targets(_goodput({"ours": [0.9]})) == []


def test_the_page_shows_ours_snap_in_its_own_table() -> None:
    row = _goodput({"ours-snap": [0.97], "torchrun": [0.4], "nvrx": [0.8]})
    doc = {"launchers": ["ours-snap", "torchrun", "nvrx"], "settings": {"repeat": 1},
           "machine": {"cpu_model": "cpu", "cpus": 2, "memory_gib": 1, "os": "Linux",
                       "python": "3", "torch": "2", "loadavg_start": [0.0]},
           "date": "d", "command": "python scripts/bench/bench.py --long", "metrics": [row],
           "targets": report.targets([row]), "method": ["m"]}
    text = report.markdown(doc)
    assert "| measure | unit | ours-snap | torchrun | NVRx 0.4.1 |\n" in text  # no ours
    assert "## Snapshots: ours-snap against the others" in text
    assert "| measure | unit | ours-snap | ours-snap ahead of torchrun | " \
           "ours-snap ahead of NVRx 0.4.1 |" in text
    assert "| goodput with in-memory snapshots (ours-snap) ahead of NVRx 0.4.1 in every " \
           "pair (lowest ratio) | 1.21 | yes |" in text


def test_goodput_against_the_pair_charges_what_a_launcher_adds_to_every_step() -> None:
    def run(clean: float | None, faulted: float, bounded: bool = False) -> tuple[dict, dict]:
        return ({"wall_s": clean}, {"wall_s": faulted, "faults": [],
                                    "bounded": ["wall_s"] if bounded else []})

    runs = {"ours-snap": [run(105.0, 110.0), run(104.0, 112.0)],
            "torchrun": [run(100.0, 600.0, bounded=True), run(None, 300.0)],
            "nvrx": [run(101.0, 130.0), run(102.0, 120.0)]}
    raw = {kind: {x: [r[i] for r in rs] for x, rs in runs.items()}
           for i, kind in enumerate(("clean", "faulted"))}
    rows = bench._derive(raw, ["goodput"])["goodput"]
    snap, torchrun, nvrx = rows["ours-snap"], rows["torchrun"], rows["nvrx"]
    # own reference: the snapshots' cost cancels out; the pair's: it is charged
    assert snap[0]["goodput"] == round(105 / 110, 4)
    assert snap[0]["goodput_pair"] == round(100 / 110, 4)
    assert nvrx[0]["goodput_pair"] == round(100 / 130, 4)
    # the fastest fault-free run of each repeat, whoever ran it (one without a wall skipped)
    assert snap[1]["goodput_pair"] == round(102 / 112, 4)
    # a faulted run at its bound: both goodputs are upper bounds
    assert torchrun[0]["bounded"] == ["faulted_wall_s", "goodput", "goodput_pair"]
    assert torchrun[1]["goodput"] is None and torchrun[1]["goodput_pair"] == round(102 / 300, 4)
    metric = next(m for m in report.METRICS if m.key == "goodput_pair")
    summary = report.summarize(metric, rows)
    got = {t["target"]: t["met"] for t in report.targets([summary])}
    assert got == {
        "goodput_pair with in-memory snapshots (ours-snap) at least 0.95 in every run "
        "(worst run)": False,
        "goodput_pair with in-memory snapshots (ours-snap) ahead of torchrun in every pair "
        "(lowest ratio)": True,
        "goodput_pair with in-memory snapshots (ours-snap) ahead of NVRx 0.4.1 in every pair "
        "(lowest ratio)": True}


def test_steps_redone_per_fault_become_two_rows() -> None:
    lost = [{"reached": 460, "resumed_from": 400, "source": "disk", "redone": 60}, None]
    assert bench._redone(lost) == {"redone_kill": 60, "redone_hang": None}
    assert bench._redone(None) == {"redone_kill": None, "redone_hang": None}
    raw = {"clean": {"nvrx": [{"wall_s": 10.0, "ckpt_interval_s": 2.5}]},
           "faulted": {"nvrx": [{"wall_s": 12.5, "bounded": [], "faults": ["SIGKILL"],
                                 "lost": lost}]}}
    row = bench._derive(raw, ["goodput"])["goodput"]["nvrx"][0]
    assert row["goodput"] == 0.8 and row["redone_kill"] == 60 and row["lost"] == lost
    assert row["ckpt_interval_s"] == 2.5


# -- --nodes 2: the same goodput as two launchers on loopback, a spare and a lost node ----


def test_a_node_takes_the_rendezvous_options_instead_of_a_standalone_job() -> None:
    lnch = measures.Launchers(ours=["ft_launcher"], nvrx=["nvrx_launcher"])
    rdzv = loopback_nodes.rdzv_options("2:2", 29400, "job", is_host=False)
    assert rdzv == ["--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "127.0.0.1:29400", "--rdzv-id", "job", "--rdzv-conf", "is_host=false"]
    for name in ("ours", "ours-snap", "torchrun", "nvrx"):
        alone = lnch.argv(name, 2, 3, Path("/w"), ["--mode", "train"])
        node = lnch.argv(name, 1, 3, Path("/w/n1"), ["--mode", "train"], rdzv=rdzv,
                         hb_timeout_s=5.0)
        assert node[node.index("--rdzv-endpoint") + 1] == "127.0.0.1:29400", name
        assert not {"--standalone", "--master-addr", "--local-addr"} & set(node), name
        assert {"--standalone", "--master-addr"} & set(alone), name
        assert node[node.index("--nproc-per-node") + 1] == "1", name
        # each node its own events file (and ours its own run directory)
        assert node[node.index("--events") + 1] == "/w/n1/events.jsonl", name
        if name != "torchrun":
            assert node[node.index("--ft-rank-heartbeat-timeout") + 1] == "5.0", name
            assert alone[alone.index("--ft-rank-heartbeat-timeout") + 1] == "2.0", name
    # ours-snap replicates its snapshots to another node only when there is one
    snap = lnch.argv("ours-snap", 1, 3, Path("/w"), [], rdzv=rdzv)
    assert snap[snap.index("--ft-snapshot-replicas") + 1] == "1"
    assert "--ft-snapshot-replicas" not in lnch.argv("ours-snap", 2, 3, Path("/w"), [])
    assert "--ft-snapshot-replicas" not in lnch.argv("ours", 1, 3, Path("/w"), [], rdzv=rdzv)


def test_a_context_with_nodes_runs_one_launcher_per_node_with_the_world_split() -> None:
    s = measures.Settings(nodes=2, hb_timeout_s=5.0)
    ctx = measures.Context(measures.Launchers(ours=["ft"]), s, Path("/r"))
    run = ctx.run("t", "ours-snap", 2, 3, ["--mode", "train"])
    assert isinstance(run, nodes_run.NodesRun) and run.world == 2 and run.nodes == 2
    assert run.argv_for is not None
    argv = run.argv_for(Path("/r/t/n0"), ["--nnodes", "2:2"])
    assert argv[argv.index("--nproc-per-node") + 1] == "1"
    assert argv[argv.index("--ft-run-dir") + 1] == "/r/t/n0/ft_run"
    one = measures.Context(measures.Launchers(ours=["ft"]), measures.Settings(), Path("/r"))
    assert type(one.run("t", "ours", 2, 3, [])) is runner.Run


def _member(name: str, records: list[dict], exit_code: int | None = None) -> runner.Run:
    node = runner.Run(name=name, argv=[], workdir=Path("/nowhere"), env={})
    node.records = records
    if exit_code is not None:
        node.exit_code, node.t_exit = exit_code, 100.0 + len(name)
    return node


def _pid(pid: int, rank: int, t: float) -> dict:
    return {"ev": "pid", "pid": pid, "rank": rank, "t": t}


def test_a_nodes_job_ends_with_the_nodes_that_ran_workers_and_were_not_lost() -> None:
    job = nodes_run.NodesRun(name="j", argv=[], workdir=Path("/nowhere"), env={})
    job.members = {"n0": _member("n0", [_pid(10, 0, 1.0)]),
                   "n1": _member("n1", [_pid(11, 1, 1.0)]),
                   "spare": _member("spare", [])}
    job.records = sorted((r for m in job.members.values() for r in m.records),
                         key=lambda r: r["t"])
    # the rank to lose is the one whose node does not host the store
    assert job.pid_off_host() == 11 and job.node_of(10) == "n0"
    job._note_end()
    assert job.exit_code is None  # nobody has exited yet
    job.members["n0"].exit_code, job.members["n0"].t_exit = 0, 50.0
    job._note_end()
    assert job.exit_code is None  # n1 ran a worker and still runs
    # n1 is lost; the spare took its rank and exited 0: the job ended, n1 does not count
    job.lost.add("n1")
    job.members["spare"] = _member("spare", [_pid(12, 1, 5.0)], exit_code=0)
    job._note_end()
    assert job.exit_code == 0 and job.t_exit == 105.0
    # a spare that never ran a worker does not hold the end back; a failed node sets the code
    job = nodes_run.NodesRun(name="j", argv=[], workdir=Path("/nowhere"), env={})
    job.members = {"n0": _member("n0", [_pid(10, 0, 1.0)], exit_code=0),
                   "n1": _member("n1", [_pid(11, 1, 1.0)], exit_code=1),
                   "spare": _member("spare", [])}
    job._note_end()
    assert job.exit_code == 1
    # every node gone without a worker ever running: ended, with the first failure
    job = nodes_run.NodesRun(name="j", argv=[], workdir=Path("/nowhere"), env={})
    job.members = {"n0": _member("n0", [], exit_code=2), "n1": _member("n1", [], exit_code=0)}
    job._note_end()
    assert job.exit_code == 2


def test_nodes_mode_adds_the_lost_node_to_the_long_schedule_and_its_notes() -> None:
    with pytest.raises(SystemExit, match="--nodes 2: goodput only"):
        bench.on_nodes(bench.PROFILES["long"], 2, ["goodput", "hang"])
    s = bench.on_nodes(bench.PROFILES["long"], 2, ["goodput"])
    assert s.nodes == 2 and s.hb_timeout_s == 2.0 and bench.PROFILES["long"].nodes == 1
    # a schedule per cycle (--quick, --smoke) stays one: the lost node comes in cycle 2
    assert bench.on_nodes(bench.PROFILES["quick"], 2, ["goodput"]).fault_at_s == ()
    kill, hang, lose = s.fault_at_s
    # the lost node comes well before the end of a ~6.5 min training, after two checkpoints
    assert kill < hang < lose < 0.85 * s.train_steps * 0.026
    assert s.ckpt_every * 0.026 * 2 < lose
    notes = " ".join(bench.method(s))
    assert "with 3 faults" in notes and "the loss of a node 300 s after it" in notes
    assert "Nodes (--nodes 2)" in notes and "--ft-snapshot-replicas 1" in notes
    assert "Heartbeat timeout 2 s" in notes
    assert measures.FAULTS == ("SIGKILL", "SIGSTOP", measures.NODE_LOST)
    lost = [{"redone": 3}, {"redone": 1}, {"redone": 40}]
    assert bench._redone(lost, nodes=2) == {"redone_kill": 3, "redone_hang": 1,
                                            "redone_node": 40}
    assert bench._redone(lost[:1], nodes=2)["redone_node"] is None
    assert "redone_node" not in bench._redone(lost)
    # a figure no run has (the lost node's, on one node) is left out of the tables
    assert bench._recorded("redone_node", {"ours": [{"redone_node": None}]})
    assert not bench._recorded("redone_node", {"ours": [{"redone_kill": 3}]})


def test_the_snapshot_area_of_a_lost_node_is_removed_and_nothing_else(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    mine = shm / f"ft_snapshots-{os.getuid()}-job-abc"
    other_user = shm / f"ft_snapshots-{os.getuid() + 1}-job-abc"
    elsewhere = tmp_path / f"ft_snapshots-{os.getuid()}-job-abc"
    for d in (mine / "rank_1", other_user, elsewhere):
        d.mkdir(parents=True)
    node = tmp_path / "n1"
    (node / "ft_run").mkdir(parents=True)
    records = [{"event": "launcher_started"}, "not an object", {"event": "snapshots_ready"},
               *({"event": "snapshots_ready", "path": str(p)}
                 for p in (mine, other_user, elsewhere))]
    (node / "ft_run" / "events.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records) + "\n{torn")
    assert nodes_run.remove_snapshot_area(node, shm) == [mine]
    assert not mine.exists() and other_user.is_dir() and elsewhere.is_dir()
    # torchrun's and NVRx's nodes have no run directory: nothing to do
    assert nodes_run.remove_snapshot_area(tmp_path / "none", shm) == []
