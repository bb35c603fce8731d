"""Keeps the benchmark driver working; never a benchmark (no figure is judged on speed).

The smoke run starts real launchers (ours, ours-warm and torchrun; NVRx needs its own
virtualenv, too slow to build in the test suite) with the workload's torch-free training
variant, puts each measure through once with tiny counts, and checks the JSON it writes and
that no process of it is left behind. ours-warm's standbys preload ``json`` there instead of
torch (seconds per standby here), so its real warm restarts stay cheap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "scripts" / "bench"
BENCH = BENCH_DIR / "bench.py"
SMOKE_TIMEOUT_S = 150

sys.path.insert(0, str(BENCH_DIR))
import bench  # noqa: E402
import measures  # noqa: E402
import report  # noqa: E402


def _procs_mentioning(text: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(text in part for part in p.info["cmdline"] or []):
                found.append(p.info["pid"])
        except psutil.Error:
            pass
    return found


def _kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still runs (never leave a process behind)."""
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One smoke run of the driver, shared by the checks below."""
    work = tmp_path_factory.mktemp("bench")
    out = work / "out"
    # The driver's run directories go under TMPDIR, so every process it starts has this
    # test's folder in its command line: that is how leftovers are found below.
    env = {**os.environ, "TMPDIR": str(work)}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--launchers", "ours,ours-warm,torchrun",
         "--out", str(out)],
        capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=env, cwd=REPO)
    leftovers = _procs_mentioning(str(work))
    _kill(leftovers)  # even when the check below fails
    assert not leftovers, f"processes left behind: {leftovers}"
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), out


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_smoke_json_has_every_measure(smoke: tuple[dict, Path]) -> None:
    doc, out = smoke
    for key in ("version", "date", "machine", "command", "settings", "launchers", "metrics",
                "targets", "raw", "leftover_processes", "method"):
        assert key in doc, key
    assert doc["launchers"] == ["ours", "ours-warm", "torchrun"]
    assert doc["leftover_processes"] == []
    assert set(doc["raw"]) == {"heartbeat", "hang", "crash", "startup", "footprint",
                               "training", "goodput"}
    # torchrun has no heartbeat client and no monitor process; ours-warm runs only where it
    # starts or restarts differently.
    assert set(doc["raw"]["heartbeat"]) == {"ours"}
    assert set(doc["raw"]["footprint"]) == {"ours"}
    for measure in ("hang", "training"):
        assert set(doc["raw"][measure]) == {"ours", "torchrun"}, measure
    for measure in ("crash", "startup", "goodput"):
        assert set(doc["raw"][measure]) == {"ours", "ours-warm", "torchrun"}, measure
    for measure in ("hang", "crash", "startup", "goodput"):
        for runs in doc["raw"][measure].values():
            assert len(runs) == doc["settings"]["repeat"] == 1
    text = (out / "RESULTS.md").read_text()
    assert "| measure | unit | ours | ours-warm | torchrun | ours ahead of torchrun |" in text
    assert "| measure | unit | ours-warm | ours-warm ahead of ours (cold) | " \
           "ours-warm ahead of torchrun |" in text
    assert doc["command"] in text


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_smoke_values_are_sane(smoke: tuple[dict, Path]) -> None:
    raw = smoke[0]["raw"]
    hb = raw["heartbeat"]["ours"][0]
    assert 0 < hb["p50_us"] <= hb["p99_us"] < 10_000
    # Back to back, ours folds all but one heartbeat in 0.04 s: a folded call sends nothing.
    assert 0 < hb["fold_p50_us"] < hb["p50_us"]

    ours_hang, torchrun_hang = raw["hang"]["ours"][0], raw["hang"]["torchrun"][0]
    assert 1.5 < ours_hang["detect_s"] < 5.0  # a 2 s timeout; generous for a loaded machine
    assert abs(ours_hang["excess_ms"] - (ours_hang["detect_s"] - 2) * 1000) < 1
    assert 0 <= ours_hang["lag_ms"] < 3000  # read from the launcher's hang_detected record
    assert torchrun_hang["detect_s"] is None and "not detected" in torchrun_hang["note"]

    assert 0 < raw["crash"]["ours"][0]["recovery_s"] < 15
    tr_crash = raw["crash"]["torchrun"][0]
    assert tr_crash["recovery_s"] is None or tr_crash["recovery_s"] > 0

    for launcher in ("ours", "torchrun"):
        assert 0 < raw["startup"][launcher][0]["startup_s"] < 30

    fp = raw["footprint"]["ours"][0]
    # The launcher and its guardian (which kills the worker groups if the launcher dies),
    # and with warm restart on by default the zygote and up to one standby per local rank.
    ranks = bench.PROFILES["smoke"].footprint_ranks
    assert 3 <= fp["processes"] <= 3 + ranks, fp
    assert fp["cpu_pct"] >= 0 and 0 < fp["pss_mb"] <= fp["rss_mb"]

    ours_training, torchrun_training = raw["training"]["ours"][0], raw["training"]["torchrun"][0]
    for key in ("cpu_pct", "sections_cpu_pct"):
        assert isinstance(ours_training.get(key), float), ours_training
    assert isinstance(torchrun_training.get("cpu_pct"), float), torchrun_training
    assert "sections_cpu_pct" not in torchrun_training

    # ours-warm: a real warm restart after ready standbys, verified from workers_started.
    warm_crash = raw["crash"]["ours-warm"][0]
    assert warm_crash["warm"] == [True, True], warm_crash
    assert 0 < warm_crash["recovery_s"] < 15 and warm_crash["standby_wait_s"] >= 0
    assert warm_crash["standby_pss_mb"] > 0
    warm_gp = raw["goodput"]["ours-warm"][0]
    assert warm_gp["faults"] == ["SIGKILL", "SIGSTOP"], warm_gp
    assert warm_gp["warm"] == [[True, True], [True, True]], warm_gp
    assert warm_gp["bounded"] == [] and 0 < warm_gp["goodput"] <= 1.5
    row = next(r for r in smoke[0]["metrics"] if r["metric"] == "recovery_s")
    assert "ours-warm" not in row["ratio_vs_ours"]  # it has its own ratios
    assert row["ratio_vs_ours_warm"]["ours"]["n"] == 1

    ours_gp, tr_gp = raw["goodput"]["ours"][0], raw["goodput"]["torchrun"][0]
    assert ours_gp["faults"] == ["SIGKILL", "SIGSTOP"], ours_gp
    assert ours_gp["bounded"] == [] and 0 < ours_gp["goodput"] <= 1.5
    assert ours_gp["faulted_wall_s"] > ours_gp["clean_wall_s"] * 0.5
    # torchrun never notices the stopped rank: its faulted run always reaches the bound.
    assert tr_gp["bounded"] == ["faulted_wall_s", "goodput", "goodput_pair"]
    # against the fastest fault-free run of the repeat, whichever launcher ran it
    fastest = min(rows[0]["clean_wall_s"] for rows in raw["goodput"].values()
                  if rows[0]["clean_wall_s"])
    assert ours_gp["goodput_pair"] == round(fastest / ours_gp["faulted_wall_s"], 4)
    assert tr_gp["faulted_wall_s"] == smoke[0]["settings"]["goodput_bound_s"]


def test_summary_pairs_runs_and_orients_ratios() -> None:
    """Ratios are taken per pair of runs (same repeat), > 1 when ours is better."""
    lower = report.Metric("crash", "recovery_s", "x", "s")
    raw = {"ours": [{"recovery_s": 1.0}, {"recovery_s": 2.0}, {"recovery_s": None}],
           "nvrx": [{"recovery_s": 3.0}, {"recovery_s": 2.0}, {"recovery_s": 9.0}]}
    row = report.summarize(lower, raw)
    assert row["summary"]["ours"]["n_ok"] == 2
    assert row["summary"]["nvrx"]["median"] == 3.0
    ratio = row["ratio_vs_ours"]["nvrx"]
    assert ratio["samples"] == [3.0, 1.0] and ratio["median"] == 2.0  # the None pair dropped

    higher = report.Metric("goodput", "goodput", "x", "", better="higher")
    row = report.summarize(higher, {"ours": [{"goodput": 0.8}],
                                    "torchrun": [{"goodput": 0.2, "bounded": ["goodput"]}]})
    assert row["ratio_vs_ours"]["torchrun"]["median"] == pytest.approx(4.0)
    assert row["ratio_vs_ours"]["torchrun"]["bounded"] is True


def test_warm_variant_wiring() -> None:
    """ours-warm = ours + warm restart with the preload; only where a restart happens."""
    lnch = measures.Launchers(ours=["ft_launcher"])
    ours = lnch.argv("ours", 2, 1, Path("/w"), ["--x"])
    warm = lnch.argv("ours-warm", 2, 1, Path("/w"), ["--x"], preload="torch,torch._dynamo")
    i = warm.index("--ft-warm-restart")
    assert warm[:i] == ours[:i] and warm[i:i + 3] == [
        "--ft-warm-restart", "--ft-preload", "torch,torch._dynamo"]
    assert warm[i + 3:] == ours[i:]
    assert measures.Settings().warm_preload == "torch,torch._dynamo"
    every = list(bench.ALL_LAUNCHERS)
    assert every == ["ours", "ours-cold", "ours-warm", "torchrun", "nvrx"]
    for kind in ("crash", "faulted", "clean"):  # clean: the start-up and goodput runs
        assert bench.launchers_for(kind, every) == every, kind
    for kind in ("heartbeat", "hang", "footprint", "training"):
        assert not {"ours-warm", "ours-cold"} & set(bench.launchers_for(kind, every)), kind


def test_ours_means_the_defaults_and_ours_cold_turns_warm_restart_off() -> None:
    lnch = measures.Launchers(ours=["ft_launcher"])
    ours = lnch.argv("ours", 2, 1, Path("/w"), ["--x"])
    assert not [a for a in ours if "warm-restart" in a or a == "--ft-preload"]
    cold = lnch.argv("ours-cold", 2, 1, Path("/w"), ["--x"])
    i = cold.index("--no-ft-warm-restart")
    assert cold[:i] + cold[i + 1:] == ours
    store = lnch.argv("ours-store", 2, 1, Path("/w"), ["--x"])
    assert "--no-ft-warm-restart" in store and "--ft-agent-store" in store
    smoke = lnch.argv("ours", 2, 1, Path("/w"), ["--x"], ours_preload="json")
    assert smoke[smoke.index("--ft-preload") + 1] == "json"
    assert bench.PROFILES["smoke"].ours_preload == "json" and \
        bench.PROFILES["full"].ours_preload is None


def test_ready_standbys_follows_take_over_and_death() -> None:
    """A standby counts as ready until a restart takes it over or it dies."""
    def ev(event: str, **kw: object) -> dict:
        return {"event": event, **kw}

    records = [ev("workers_started", cycle=0, pids=[10, 11]),
               ev("standby_ready", cycle=0, local_rank=0, pid=20),
               ev("standby_ready", cycle=0, local_rank=1, pid=21)]
    assert measures.ready_standbys(records) == {0: 20, 1: 21}
    records.append(ev("standby_died", cycle=0, local_rank=1, pid=21))
    assert measures.ready_standbys(records) == {0: 20}
    records += [ev("standby_ready", cycle=0, local_rank=1, pid=22),
                ev("workers_started", cycle=1, pids=[20, 22], warm=[True, True])]
    assert measures.ready_standbys(records) == {}  # both became cycle 1's workers
    records.append(ev("standby_ready", cycle=1, local_rank=0, pid=30))
    assert measures.ready_standbys(records) == {0: 30}
    records.append(ev("warm_restart_disabled", cycle=1, reason="x"))
    assert measures.ready_standbys(records) == {}


def test_bad_option_is_one_clear_line() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--only", "heartbeat,speed"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --only: expected a comma-separated subset of "
        "heartbeat,hang,crash,startup,footprint,training,goodput,verdict,compiled, got "
        "'heartbeat,speed'"]


def test_a_heartbeat_mark_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    mark = tmp_path / "hb_mark_1"
    assert measures.read_mark(mark) is None  # not written yet
    mark.write_text(f"{7:12d} 1700000000.250000 1700000000.250100\n")
    assert measures.read_mark(mark) == (7, 1700000000.25, 1700000000.2501)
    mark.write_text(f"{8:12d} 1700000000.2")  # torn: being rewritten
    assert measures.read_mark(mark) is None


@pytest.mark.timeout(120)
def test_the_verdict_measure_stops_a_rank_right_after_a_heartbeat(tmp_path: Path) -> None:
    """--only verdict (not in the default set): the driver SIGSTOPs rank 1 right after a
    send_heartbeat() call returned and times the verdict from that call."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--only", "verdict", "--launchers",
         "ours,torchrun", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=100, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(doc["raw"]["verdict"]) == {"ours"}  # torchrun has no heartbeat client
    run = doc["raw"]["verdict"]["ours"][0]
    assert run["late_stop"] is False, run
    # Never before the timeout has passed since that call. Not ordered against the stop's
    # delay: when the call was folded into one sent up to HEARTBEAT_FOLD_S before it, the
    # verdict may come a fraction of a millisecond after the call's timeout.
    assert run["stop_after_return_ms"] >= 0 and 0 <= run["excess_ms"] < 2000, run
    assert 1.5 < run["detect_s"] < 5.0, run


@pytest.mark.timeout(90)
def test_sigterm_to_the_driver_ends_every_process(tmp_path: Path) -> None:
    """Stopping the driver mid-run still ends the launcher and workers it started."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    driver = subprocess.Popen(
        [sys.executable, str(BENCH), "--smoke", "--only", "hang", "--launchers", "ours",
         "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline and not workers:
            workers = [pid for pid in _procs_mentioning(str(tmp_path))
                       if pid != driver.pid and _is_workload(pid)]
            time.sleep(0.05)
        assert workers, "the driver never started a worker"
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=30)
        assert driver.returncode == 130, err[-2000:]
        assert "stopped by SIGTERM" in err
        assert not (tmp_path / "out" / "results.json").exists()
        assert _procs_mentioning(str(tmp_path)) == []
    finally:
        _kill([driver.pid, *_procs_mentioning(str(tmp_path))])
        driver.wait(10)


def _is_workload(pid: int) -> bool:
    try:
        return any(part.endswith("workload.py") for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def test_render_rebuilds_the_same_files(smoke: tuple[dict, Path], tmp_path: Path) -> None:
    """--render recomputes summaries from the raw figures alone, running nothing."""
    _, out = smoke
    proc = subprocess.run([sys.executable, str(BENCH), "--render", str(out / "results.json"),
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "RESULTS.md").read_text() == (out / "RESULTS.md").read_text()
    again = json.loads((tmp_path / "results.json").read_text())
    assert again["metrics"] == json.loads((out / "results.json").read_text())["metrics"]


RDZV_SCALE = BENCH_DIR / "rdzv_scale.py"


@pytest.mark.timeout(420)
def test_rdzv_scale_fills_every_measure_for_c10d(tmp_path: Path) -> None:
    """scripts/bench/rdzv_scale.py at 20 simulated nodes and a 2 s fault-free window: the
    JSON has its machine, command and cells, every measure of c10d has a figure, and no
    simulator process is left."""
    out = tmp_path / "rdzv_scale.json"
    driver = subprocess.Popen(
        [sys.executable, str(RDZV_SCALE), "--nodes", "20", "--backends", "c10d",
         "--fault-free-s", "2", "--bound-s", "60", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        _, err = driver.communicate(timeout=400)
    finally:
        left = [pid for tag in "abc" for pid in _procs_mentioning(f"scale-{tag}-{driver.pid}")]
        _kill([driver.pid, *left])
    assert driver.returncode == 0, err[-4000:]
    assert not left, f"simulator processes left behind: {left}"
    doc = json.loads(out.read_text())
    for key in ("machine", "commands", "timings", "targets", "method", "cells"):
        assert key in doc, key
    cell = doc["cells"]["c10d"]["20"]
    for key in ("date", "command", "loadavg_start", "loadavg_end", "settings"):
        assert key in cell, key
    figures = {
        "formation": cell["formation"]["s"],
        "requests/s": cell["fault_free"]["requests_per_s"],
        "bytes/s": cell["fault_free"]["bytes_per_s"],
        "wire bytes/s": cell["fault_free"]["wire_bytes_per_s"],
        "store host CPU": cell["fault_free"]["store_host_cpu_pct"],
        "frozen: dropped by every survivor": cell["frozen"]["dropped_by_every_survivor"]["s"],
        "frozen: new round": cell["frozen"]["new_round"]["s"],
        "loss": cell["loss"]["s"],
        "spare": cell["spare"]["spare_s"],
    }
    for what, value in figures.items():
        assert isinstance(value, (int, float)) and value >= 0, (what, value, cell)
    for what in ("requests/s", "bytes/s", "wire bytes/s"):
        assert figures[what] > 0, (what, cell["fault_free"])
    for key in ("rounds_opened", "nodes_dropped"):
        assert isinstance(cell["fault_free"][key], int), cell["fault_free"]


# -- scripts/scale_nodes.py: N launchers on loopback, one node lost ----------------------

SCALE = REPO / "scripts" / "scale_nodes.py"
SCALE_TIMEOUT_S = 400


@pytest.mark.timeout(SCALE_TIMEOUT_S + 30)
def test_scale_nodes_wiring_and_json_shape(tmp_path: Path) -> None:
    """Three real launchers per backend with the torch-free worker: the driver forms the
    world, watches it, kills a node, writes its JSON and leaves no process behind; the
    docs renderer reads that JSON. Shapes and causal order only: nothing is timed here."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCALE), "--nodes", "3", "--backends", "c10d,torch-c10d",
         "--worker", "light", "--cases", "nospare", "--fault-free-s", "2",
         "--form-attempts", "3",
         "--env", "TORCH_CPP_LOG_LEVEL=ERROR", "--out", str(tmp_path / "out"),
         "--name", "smoke"],
        capture_output=True, text=True, timeout=SCALE_TIMEOUT_S, env=env, cwd=REPO)
    leftovers = _procs_mentioning(str(tmp_path))
    _kill(leftovers)
    assert not leftovers, f"processes left behind: {leftovers}"
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "out" / "smoke.json").read_text())
    for key in ("version", "date", "command", "machine", "settings", "load_start",
                "load_end", "results"):
        assert key in doc, key
    assert doc["settings"]["env"] == {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    assert "--no-ft-warm-restart" in doc["settings"]["ours_extra"]
    assert [r["backend"] for r in doc["results"]] == ["c10d", "torch-c10d"]
    for r in doc["results"]:
        _check_scale_result(r)
    render = _render_module()
    lines = render._scale_run("smoke.json", "smoke", doc)
    assert sum(1 for line in lines if line.startswith("| 3 | `")) == 3 * 2  # 3 tables


def _check_scale_result(r: dict) -> None:
    assert r["nnodes"] == "2:3" and "error" not in r and "leftovers" not in r, r
    assert r["worker_torch"]["checked"] >= 3 and r["worker_torch"]["imported"] == 0, r
    assert r["start"]["rounds"] >= 1 and isinstance(r["failed_starts"], list)
    ff = r["fault_free"]
    assert set(ff["per_node"]) == {"n00", "n01", "n02"}
    for node in ff["per_node"].values():
        roles = sorted(c["role"] for c in node["children"])
        assert roles == ["guardian", "worker"], node
        assert node["cpu_pct"] >= 0 and 0 < node["pss_mb"] <= node["rss_mb"], node
    for key in ("restarts", "rounds", "nodes_dropped", "machine_cpu_pct", "driver_cpu_pct"):
        assert isinstance(ff[key], (int, float)), key
    loss = r["loss"]
    survivors = {"n00", "n01", "n02"} - {loss["target"]}
    assert loss["target"] != "n00" and loss["settle_s"] >= 0  # never the store's host
    for key in ("knew_s", "rendezvous_s", "workers_started_s", "new_worker_s"):
        assert set(loss[key]) == survivors, (key, loss)
    for n in survivors:  # the order of cause and effect, not a speed
        assert 0 < loss["knew_s"][n] <= loss["rendezvous_s"][n] \
            <= loss["workers_started_s"][n] <= loss["new_worker_s"][n], loss
    assert abs(loss["every_new_worker_s"] - max(loss["new_worker_s"].values())) <= 0.01
    assert loss["survivors_whose_worker_failed"] == []


def _render_module():
    sys.path.insert(0, str(REPO))
    from scripts.docs import render

    return render
