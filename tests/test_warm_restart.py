"""Warm restart (--ft-warm-restart): standby interpreters that become the next cycle's workers.

Real launchers, real standby processes, real DDP training on gloo; standbys are found and
killed by the pids the launcher reports in its ``standby_ready`` events.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from launch_helpers import (
    EXAMPLES,
    ROOT,
    SCRIPTS,
    events,
    launcher_cmd,
    named,
    processes_of,
    run_launcher,
    summary,
    wait_for,
)

from ft_launcher.process import cold_exit
from ft_launcher.warm.standby_process import PythonEntry, encode_record
from ft_launcher.warm.worker_side import activation

pytestmark = pytest.mark.timeout(180)

LOSS_LINE = re.compile(r"^rank (\d+) cycle (\d+) step (\d+) loss (\S+)$", re.M)


def _gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
               for p in pids)


def _ready(run_dir: Path, cycle: int | None = None) -> list[dict]:
    return [e for e in named(events(run_dir), "standby_ready")
            if cycle is None or e["cycle"] == cycle]


def _spares(run_dir: Path) -> list[dict]:
    """``standby_ready`` of the standbys not taken as workers, the latest per local rank
    (after learned preloads a new standby replaces an older one). The first cycle's workers
    are standbys too, each reported ready just before ``workers_started`` is written, so
    nothing before that event is a spare."""
    evs = events(run_dir)
    started = [i for i, e in enumerate(evs) if e["event"] == "workers_started"]
    if not started:
        return []
    taken = {pid for e in evs[started[0]:] if e["event"] == "workers_started"
             for pid in e["pids"]}
    latest = {e["local_rank"]: e for e in named(evs[started[0]:], "standby_ready")
              if e["pid"] not in taken}
    return list(latest.values())


# -- 1. same training results, warm or cold -----------------------------------------------


def _train_and_kill_rank1(run_dir: Path, warm: bool) -> dict[tuple[int, int], str]:
    """train_ddp with 2 ranks; SIGKILL rank 1 once a checkpoint exists (and, warm, once both
    spare standbys are ready); return (rank, step) -> loss over every cycle's log."""
    flags = ["--ft-warm-restart"] if warm else ["--no-ft-warm-restart"]
    cmd = launcher_cmd(run_dir, "--nproc-per-node", "2", "--max-restarts", "1", *flags,
                       str(EXAMPLES / "train_ddp.py"), "--steps", "300", "--ckpt-every", "10",
                       "--step-time", "0.03")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    try:
        wait_for((run_dir / "ckpt" / "iteration").exists, 60, "the first checkpoint")
        if warm:
            wait_for(lambda: len(_spares(run_dir)) == 2, 60, "two ready standbys")
        pid = named(events(run_dir), "workers_started")[0]["pids"][1]
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert summary(run_dir)["restarts"] == 1
    started = named(events(run_dir), "workers_started")
    # Warm: the first cycle's workers are the zygote's forks too.
    assert [e["warm"] for e in started] == [[warm, warm], [warm, warm]]
    losses: dict[tuple[int, int], set[str]] = {}
    for log in sorted((run_dir / "logs").glob("cycle_*/rank_*.log")):
        for rank, _cycle, step, loss in LOSS_LINE.findall(log.read_text()):
            losses.setdefault((int(rank), int(step)), set()).add(loss)
    # A step computed twice (after the checkpoint, before the kill, then again) agrees.
    assert all(len(v) == 1 for v in losses.values()), losses
    cycle1 = (run_dir / "logs" / "cycle_1" / "rank_1.log").read_text()
    assert " cycle 1 step 300 loss " in cycle1
    return {k: v.pop() for k, v in losses.items()}


@pytest.mark.slow  # two 300-step trainings: about 2 minutes on 2 busy cores
def test_warm_restart_trains_exactly_like_a_cold_restart(tmp_path, run_dir):
    warm_dir = run_dir
    cold_dir = tmp_path / "cold_run"
    try:
        cold = _train_and_kill_rank1(cold_dir, warm=False)
    finally:
        wait_for(lambda: not processes_of(cold_dir), 10, "the cold run's processes to end")
    warm = _train_and_kill_rank1(warm_dir, warm=True)
    # Every step of the warm run (forked workers in both cycles) was computed by the cold
    # run too (before or after its own restart): the losses must be the same to the digit.
    warm_cycle1 = {(int(r), int(s)) for log in (warm_dir / "logs" / "cycle_1").glob("*.log")
                   for r, _c, s, _l in LOSS_LINE.findall(log.read_text())}
    assert len(warm_cycle1) >= 20
    assert {k: warm[k] for k in warm_cycle1} == {k: cold[k] for k in warm_cycle1}
    assert set(warm) == set(cold) and warm == cold
    result = [json.loads((d / "ckpt" / "result.json").read_text()) for d in (cold_dir, warm_dir)]
    assert result[0] == result[1] and result[0]["steps"] == 300


# -- 2. a warm worker is indistinguishable from a fresh process --------------------------

PRELOAD = '''
"""Preloaded by the standby: misbehaves in every way a standby must undo."""
import os
import signal

print("preload says hi", flush=True)
os.environ["FT_LEFTOVER_FROM_PRELOAD"] = "1"
signal.signal(signal.SIGTERM, lambda *a: print("preload's SIGTERM handler", flush=True))
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
os.chdir("/")
'''

SEMANTICS = '''
"""Records what it sees; cycle 0 and 1 fail once spare standbys are ready, cycle 2 ends 0
(so does a run whose last argument is "cold")."""
import sys

MODULES = sorted(m for m in sys.modules if m.startswith(("json", "ft_", "preload_")))

import json
import os
import signal
import sys
import time
from pathlib import Path

facts = {
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    # what ps and pgrep -f read (NULs between arguments, or one string after setproctitle)
    "cmdline": Path("/proc/self/cmdline").read_bytes().decode().replace("\\0", " ").split(),
    "name": __name__,
    "main_file": sys.modules["__main__"].__file__,
    "spec": getattr(__spec__, "name", None),
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "sigint": getattr(signal.getsignal(signal.SIGINT), "__name__", None),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "stdin": sys.stdin.read(),
    "path0": sys.path[0],
    "modules": MODULES,
    "pid": os.getpid(),
}
run_dir = Path(os.environ["FT_RUN_DIR"])
cycle, rank = int(os.environ["FT_CYCLE"]), int(os.environ["RANK"])
(run_dir / f"facts_{cycle}_{rank}.json").write_text(json.dumps(facts))
print(f"hello from rank {rank} cycle {cycle}", flush=True)
print(f"stderr of rank {rank} cycle {cycle}", file=sys.stderr, flush=True)
if cycle == 2 or sys.argv[-1] == "cold":
    sys.exit(0)

from ft_agent import RankMonitorClient  # noqa: E402

ft = RankMonitorClient()
ft.init_workload_monitoring()
ft.send_heartbeat()  # every rank training: the launcher may spawn standbys now
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # spares: ready and not taken as a worker
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    taken = {p for e in evs if e["event"] == "workers_started" for p in e["pids"]}
    if len([e for e in evs if e["event"] == "standby_ready" and e["pid"] not in taken]) >= 2:
        break
    time.sleep(0.05)
if rank == 1:
    if cycle == 1:
        raise RuntimeError("boom from a warm worker")
    sys.exit(1)
time.sleep(60)  # rank 0 waits to be stopped with SIGTERM
'''


@pytest.mark.parametrize("mode", ["path", "module"])
def test_warm_worker_sees_a_fresh_process(tmp_path, run_dir, mode):
    work = tmp_path / "work"
    work.mkdir()
    (work / "preload_misbehaves.py").write_text(PRELOAD)
    (work / "semantics_mod.py").write_text(SEMANTICS)
    if mode == "path":  # run from the repository root, the script by a relative path
        cwd, target = ROOT, os.path.relpath(work / "semantics_mod.py", ROOT)
        entry = [target]
        main_file = str(work / "semantics_mod.py")
    else:  # python -m semantics_mod, from the script's directory
        cwd, target = work, "semantics_mod"
        entry = ["-m", target]
        main_file = str(work / "semantics_mod.py")
    # What a fresh process sees: the same launch without warm restart (it exits at once).
    cold_dir = tmp_path / "cold_run"
    cold_run = subprocess.run(launcher_cmd(cold_dir, "--nproc-per-node", "2",
                                           "--no-ft-warm-restart", *entry, "cold"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=cwd, timeout=60)
    assert cold_run.returncode == 0, cold_run.stdout
    cmd = launcher_cmd(run_dir, "--nproc-per-node", "2", "--max-restarts", "2",
                       "--ft-warm-restart", "--ft-preload", "json,preload_misbehaves",
                       # the modules each cycle's worker finds are the preloads alone
                       "--no-ft-preload-learn",
                       "--workers-stop-timeout", "5", *entry, "--flag", "x y")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert "[rank1]: hello from rank 1 cycle 1" in proc.stdout  # echoed like a cold worker's
    assert "preload says hi" not in proc.stdout
    evs = events(run_dir)
    # Every cycle's workers are the zygote's forks, the first cycle's too.
    assert [e["warm"] for e in named(evs, "workers_started")] == [[True, True]] * 3
    ready = named(evs, "standby_ready")
    for rank in (0, 1):
        cold = json.loads((cold_dir / f"facts_0_{rank}.json").read_text())
        assert "json" not in cold["modules"]
        for cycle in (0, 1, 2):
            f = json.loads((run_dir / f"facts_{cycle}_{rank}.json").read_text())
            assert f["argv"] == [main_file if mode == "module" else target, "--flag", "x y"]
            assert f["orig_argv"] == [*cold["orig_argv"][:-1], "--flag", "x y"]
            assert cold["orig_argv"] == [sys.executable, "-u", *entry, "cold"]
            assert f["cmdline"] == [*cold["cmdline"][:-1], "--flag", "x", "y"]
            assert f["name"] == "__main__" and f["main_file"] == main_file
            assert f["spec"] == (target if mode == "module" else None)
            assert f["cwd"] == str(cwd) and f["path0"] == os.path.realpath(work)
            assert set(f["env"]) == set(cold["env"]), "leftover or missing variables"
            assert f["env"]["RANK"] == str(rank) and f["env"]["FT_CYCLE"] == str(cycle)
            # As a cold worker's, however the launcher was started (a shell's background job
            # starts it with SIGINT ignored; the preload above ignores it too).
            assert f["sigint"] == cold["sigint"] == "default_int_handler"
            assert f["sigterm_default"]
            assert f["blocked"] == cold["blocked"] == []
            assert f["stdin"] == ""
            # Warm: the preloads are there, nothing of the launcher is.
            assert f["modules"][:2] == ["json", "json.decoder"]
            assert "preload_misbehaves" in f["modules"]
            assert not [m for m in f["modules"] if m.startswith("ft_launcher")]
            assert f["pid"] in {e["pid"] for e in ready if e["local_rank"] == rank}
            log = (run_dir / "logs" / f"cycle_{cycle}" / f"rank_{rank}.log").read_text()
            assert f"hello from rank {rank} cycle {cycle}" in log
            assert f"stderr of rank {rank} cycle {cycle}" in log
            assert "preload says hi" not in log
    # Cycle 1: rank 1's uncaught exception is exit code 1 with the script's traceback;
    # rank 0 dies of the launcher's SIGTERM (the preload's handler is gone).
    exits = {(w["cycle"], w["rank"]): w for w in summary(run_dir)["workers"]}
    assert exits[(1, 1)]["exit_code"] == 1
    assert exits[(1, 0)]["signal"] == "SIGTERM" and exits[(1, 0)]["stopped_by_launcher"]
    log = (run_dir / "logs" / "cycle_1" / "rank_1.log").read_text()
    tb = log[log.index("Traceback (most recent call last):"):].splitlines()
    assert tb[1].strip().startswith(f'File "{main_file}", line ') and "<module>" in tb[1]
    assert tb[-1] == "RuntimeError: boom from a warm worker"
    assert "preload's SIGTERM handler" not in log
    every_log = "".join(p.read_text() for p in (run_dir / "logs").rglob("*.log"))
    assert "@@ft-standby" not in every_log
    # The preloads ran once, in the zygote; its output has a log of its own.
    assert "preload says hi" in (run_dir / "logs" / "standby" / "zygote.log").read_text()
    assert all(e["forked"] for e in ready)
    # A normal exit leaves no standby behind.
    assert _gone([e["pid"] for e in ready])


# -- 3 and 4. a dead standby is replaced; none outlives the launcher ----------------------

HEARTBEATS = '''
import time
from ft_agent import RankMonitorClient

ft = RankMonitorClient()
ft.init_workload_monitoring()
for _ in range(1200):
    ft.send_heartbeat()
    time.sleep(0.05)
'''


def test_dead_standby_is_replaced_and_none_survives_launcher_sigkill(tmp_path, run_dir):
    script = tmp_path / "heartbeats.py"
    script.write_text(HEARTBEATS)
    # Without learned preloads: their replacements of the standbys would race the kill.
    cmd = launcher_cmd(run_dir, "--nproc-per-node", "2", "--ft-warm-restart",
                       "--ft-preload", "json", "--no-ft-preload-learn", str(script))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        first = wait_for(lambda: sorted(_spares(run_dir), key=lambda e: e["local_rank"])
                         if len(_spares(run_dir)) == 2 else None, 30, "two ready standbys")
        assert all(e["rss_mb"] > 0 and e["pss_mb"] > 0 for e in first)
        # The launcher's environment, no rank yet; the workers' thread count (libraries read
        # it when they load, before activation could change it).
        standby_env = psutil.Process(first[0]["pid"]).environ()
        assert "RANK" not in standby_env and "FT_CYCLE" not in standby_env
        assert standby_env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS", "1")
        victim = first[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        died = wait_for(lambda: named(events(run_dir), "standby_died"), 10, "standby_died")
        assert died == [{**died[0], "local_rank": 1, "pid": victim, "signal": "SIGKILL",
                         "exit_code": None, "was_ready": True}]
        again = wait_for(lambda: [e for e in _spares(run_dir)
                                  if e["local_rank"] == 1 and e["pid"] != victim],
                         30, "a replacement standby")
        assert again[0]["pid"] != victim and psutil.pid_exists(again[0]["pid"])
        standbys = [first[0]["pid"], again[0]["pid"]]
        workers = named(events(run_dir), "workers_started")[0]["pids"]
        zygote = named(events(run_dir), "zygote_ready")[0]["pid"]
        # Forked by the zygote, adopted by the launcher: the launcher is their parent.
        assert psutil.Process(standbys[0]).ppid() == proc.pid
        assert psutil.Process(zygote).ppid() == proc.pid
        proc.kill()  # SIGKILL: no finally runs; PDEATHSIG takes every process along
        proc.wait(timeout=10)
        wait_for(lambda: _gone([zygote, *standbys, *workers]), 2,
                 "the zygote, standbys and workers to die")
    finally:
        proc.kill()
        proc.communicate()


# -- the feature turns itself off, with one event, and the job runs cold ---------------

WAIT_FOR_DISABLED = '''
import json, os, time
from pathlib import Path
from ft_agent import RankMonitorClient

ft = RankMonitorClient()
ft.init_workload_monitoring()
ft.send_heartbeat()
path = Path(os.environ["FT_RUN_DIR"]) / "events.jsonl"
deadline = time.monotonic() + 30
while time.monotonic() < deadline and "warm_restart_disabled" not in path.read_text():
    time.sleep(0.05)
'''


# -- the zygote: standbys in milliseconds, refilled after each restart; unsafe -> spawned --

KILL_ME = '''
import time
from ft_agent import RankMonitorClient

ft = RankMonitorClient()
ft.init_workload_monitoring()
for _ in range(2400):
    ft.send_heartbeat()
    time.sleep(0.05)
'''


def test_zygote_forks_standbys_fast_and_refills_them_after_each_restart(tmp_path, run_dir):
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_ME)
    # Without learned preloads, the spares followed here are the refills alone (standbys
    # replaced after learning: test_learned_preloads.py).
    cmd = launcher_cmd(run_dir, "--nproc-per-node", "2", "--max-restarts", "2",
                       "--ft-warm-restart", "--ft-preload", "json", "--no-ft-preload-learn",
                       str(script))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        zygote = wait_for(lambda: named(events(run_dir), "zygote_ready"), 60, "the zygote")
        assert zygote[0]["threads"] == 1
        pids: list[int] = [zygote[0]["pid"]]
        # The first cycle's workers are the zygote's first forks.
        first = wait_for(lambda: named(events(run_dir), "workers_started"), 30, "cycle 0")
        assert first[0]["warm"] == [True, True]
        for cycle in (0, 1, 2):
            # Once a cycle's ranks train, the standbys it used are replaced at once, so a
            # second fault soon after a restart finds standbys again.
            ready = wait_for(lambda: _spares(run_dir) if len(_spares(run_dir)) >= 2 else None,
                             10, f"spare standbys in cycle {cycle}")
            assert {e["cycle"] for e in ready} == {cycle}
            assert sorted(e["local_rank"] for e in ready) == [0, 1]
            assert all(e["forked"] and e["ready_s"] < 1.0 for e in ready), ready
            pids += [e["pid"] for e in ready]
            if cycle == 2:
                break
            victim = named(events(run_dir), "workers_started")[cycle]["pids"][1]
            pids += named(events(run_dir), "workers_started")[cycle]["pids"]
            os.kill(victim, signal.SIGKILL)
            started = wait_for(lambda c=cycle: named(events(run_dir), "workers_started")[c + 1:],
                               30, f"the restart after cycle {cycle}")[0]
            assert started["warm"] == [True, True]
            assert sorted(started["pids"]) == sorted(e["pid"] for e in ready)
        warm_workers = named(events(run_dir), "workers_started")[2]["pids"]
        assert all(psutil.Process(p).ppid() == proc.pid for p in warm_workers)
        # Found as the run's processes (a cold worker by FT_RUN_DIR in /proc/PID/environ,
        # which for a warm one is the zygote's, given FT_RUN_DIR for that): the suite's
        # leftover check sees them.
        assert set(warm_workers) <= {p.pid for p in processes_of(run_dir)}
        proc.kill()  # SIGKILL: the zygote, the standbys and the warm workers die with it
        proc.communicate(timeout=30)
        wait_for(lambda: _gone(pids + warm_workers), 5,
                 "the zygote, every standby and the warm workers to die")
    finally:
        proc.kill()
        proc.communicate()


EXIT_WHEN_READY = '''
import json, os, sys, time
from pathlib import Path
from ft_agent import RankMonitorClient

ft = RankMonitorClient()
ft.init_workload_monitoring()
ft.send_heartbeat()
path = Path(os.environ["FT_RUN_DIR"]) / "events.jsonl"
deadline = time.monotonic() + 60
while os.environ["FT_CYCLE"] == "0" and time.monotonic() < deadline:
    evs = [json.loads(line) for line in path.read_text().splitlines()]
    if len([e for e in evs if e["event"] == "standby_ready"]) >= 2:
        sys.exit(int(os.environ["RANK"]))  # rank 1 fails: a restart
    time.sleep(0.05)
'''


def test_preload_that_starts_a_thread_falls_back_to_spawned_standbys(tmp_path, run_dir):
    script = tmp_path / "exit_when_ready.py"
    script.write_text(EXIT_WHEN_READY)
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--ft-warm-restart", "--ft-preload", "json,thread_on_import",
                       str(script), timeout=90, env={"PYTHONPATH": str(SCRIPTS)})
    assert res.returncode == 0, res.stdout
    evs = events(run_dir)
    fallback = named(evs, "zygote_fallback")
    assert len(fallback) == 1 and "started threads" in fallback[0]["reason"], fallback
    assert not named(evs, "zygote_ready")
    ready = named(evs, "standby_ready")
    assert len(ready) >= 2 and not any(e["forked"] for e in ready)
    assert [e["warm"] for e in named(evs, "workers_started")] == [[False, False], [True, True]]


def test_sigterm_while_the_first_cycle_waits_for_the_zygote(tmp_path, run_dir):
    """The first cycle waits for the zygote's forks; a scheduler's SIGTERM during that wait
    ends the launcher at once (exit 143), with no worker started and no process left."""
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('started')\n")
    cmd = launcher_cmd(run_dir, "--nproc-per-node", "2", "--ft-warm-restart",
                       "--ft-preload", "json,slow_import", str(script))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(SCRIPTS)})
    try:
        wait_for(lambda: (run_dir / "logs" / "standby" / "zygote.log").exists(), 30,
                 "the zygote")
        zygote = wait_for(lambda: [p for p in processes_of(run_dir)
                                   if "worker_side.zygote" in " ".join(p.info["cmdline"])],
                          30, "the zygote's process")[0].pid
        # Importing at full speed: the first cycle waits for it.
        assert os.sched_getscheduler(zygote) == os.SCHED_OTHER
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, out
    evs = events(run_dir)
    assert [e["signal"] for e in named(evs, "signal_received")] == ["SIGTERM"]
    assert not named(evs, "workers_started") and not named(evs, "rendezvous_done")
    wait_for(lambda: _gone([zygote]), 5, "the zygote to die")


def test_the_first_cycle_waits_for_the_zygote_whatever_omp_num_threads(tmp_path, monkeypatch):
    """The zygote imports with OMP_NUM_THREADS=1 whatever the workers get (torch's OpenMP
    pool would make it unsafe to fork), so the first cycle waits for its forks with one
    local rank and the variable unset too, and the zygote imports at full priority."""
    from ft_launcher.config import FaultToleranceConfig, LaunchConfig
    from ft_launcher.warm.standby_pool import StandbyPool

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")  # read before OMP_NUM_THREADS by torch
    for nproc, preload, omp in ((2, ["torch"], None), (1, ["torch"], None),
                                (1, ["torch"], "4"), (1, ["json"], None)):
        if omp is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
        cfg = LaunchConfig(entrypoint=[sys.executable, "-u", str(script)], script_args=[],
                           nproc_per_node=nproc, run_dir=tmp_path / "run",
                           ft=FaultToleranceConfig(preload=preload))
        pool = StandbyPool(cfg, tmp_path / "standby", lambda name, **f: None)
        try:
            case = (nproc, preload, omp)
            assert pool.warm_first_cycle and pool.first_cycle_waits(), case
            pid = pool.zygote.proc.pid
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER, case
            environ = psutil.Process(pid).environ()
            assert environ["OMP_NUM_THREADS"] == environ["MKL_NUM_THREADS"] == "1", case
            pool.cycle_started()
            assert not pool.first_cycle_waits()  # later cycles never wait
        finally:
            pool.close()


def test_the_pool_asks_the_loop_to_wake_only_for_what_it_waits_for():
    """The rule of the pool's wake-ups (injected times): the zygote's socket is polled every
    interval while its answer is due; a refill is due REFILL_DELAY_S after the cycle
    started, spawning and the idle zygote's raise SPAWN_DELAY_S after it; a full pool asks
    for nothing; a step past its time is retried every interval, never in a busy loop."""
    from ft_launcher.warm.standby_pool import (
        REFILL_DELAY_S,
        SPAWN_DELAY_S,
        TickWants,
        next_tick,
    )

    def due(now: float, **wants: bool) -> float | None:
        flags = {"zygote_answer": False, "refill": False, "spawn": False,
                 "raise_zygote": False, **wants}
        return next_tick(TickWants(**flags), now, 100.0, 0.1)

    assert due(100.5) is None  # full: only news (a wake, SIGCHLD) wakes the loop
    assert due(100.5, zygote_answer=True) == pytest.approx(100.6)
    assert due(100.5, refill=True) == 100.0 + REFILL_DELAY_S
    assert due(100.5, spawn=True) == due(100.5, raise_zygote=True) == 100.0 + SPAWN_DELAY_S
    assert due(100.5, refill=True, spawn=True, zygote_answer=True) == pytest.approx(100.6)
    assert due(100.0 + REFILL_DELAY_S + 3, refill=True) == pytest.approx(
        100.0 + REFILL_DELAY_S + 3.1)  # overdue and not taken: polled, not at once


def test_a_full_pool_costs_no_wake_up_and_a_standbys_news_wakes_the_loop(tmp_path):
    """A real zygote (preloading json, fast) and the pool's delays on a fake clock: polled
    while the zygote imports; once full, no tick is due; a standby taken for a cycle is
    refilled REFILL_DELAY_S after the cycle started, not before; the fork's messages call
    ``wake`` (the loop sleeps meanwhile)."""
    import threading

    from ft_launcher.config import FaultToleranceConfig, LaunchConfig
    from ft_launcher.process.workers import WorkerGroup, WorkerSpec
    from ft_launcher.warm.standby_pool import REFILL_DELAY_S, StandbyPool

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    # Learned preloads add a few looks after each activation (test_learned_preloads.py).
    cfg = LaunchConfig(entrypoint=[sys.executable, "-u", str(script)], script_args=[],
                       nproc_per_node=2, run_dir=tmp_path / "run", monitor_interval=0.1,
                       ft=FaultToleranceConfig(preload=["json"], preload_learn=False))
    now = [100.0]
    woken = threading.Event()
    pool = StandbyPool(cfg, tmp_path / "standby", lambda name, **f: None, wake=woken.set,
                       clock=lambda: now[0])
    worker = None
    try:
        assert pool.tick_due(100.0) == pytest.approx(100.1)  # the zygote's ready: polled
        wait_for(lambda: pool.tick(True) or not pool.first_cycle_waits(), 60,
                 "a ready standby per local rank")
        assert woken.is_set() and pool.tick_due(100.0) is None
        spec = WorkerSpec(0, 0, cfg.entrypoint, dict(os.environ), tmp_path / "rank_0.log",
                          False)
        worker = pool.take(spec, WorkerGroup().sink)
        assert worker is not None and worker.warm
        pool.cycle_started()
        assert pool.tick_due(100.2) == 100.0 + REFILL_DELAY_S
        pool.tick(False)
        assert 0 not in pool.standbys  # not before its time
        woken.clear()
        now[0] = 100.0 + REFILL_DELAY_S
        pool.tick(False)
        assert 0 in pool.standbys and pool.tick_due(now[0]) is None  # forked: news awaited
        assert woken.wait(30), "the fork's messages did not wake the loop"
        wait_for(lambda: pool.tick(False) or pool.standbys[0].reported, 30,
                 "the replacement standby to be ready")
        assert pool.tick_due(now[0]) is None
        assert worker.proc.wait(30) == 0
    finally:
        pool.close()


THREADS = """import os, sys, torch
x = torch.randn(256, 256)
(x @ x).sum()  # a parallel region: OpenMP's pool starts here
print("num_threads", torch.get_num_threads())
print("preloaded", "torch" in sys.modules)
print(torch.__config__.parallel_info())
"""


@pytest.mark.parametrize("omp", [None, "1", "3"])
def test_one_local_rank_is_warm_with_the_threads_of_a_cold_worker(tmp_path, run_dir, omp):
    """One local rank, OMP_NUM_THREADS unset (torch then uses every core) or set: the
    default launch is warm from the first cycle, forked from a zygote with no thread but
    its own, and torch in the worker reports what it reports in a cold one: same thread
    counts for ATen, OpenMP and MKL."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    env = {} if omp is None else {"OMP_NUM_THREADS": omp}
    reports = {}
    for how, args in (("warm", []), ("cold", ["--no-ft-warm-restart"])):
        where = run_dir / how
        res = run_launcher(where, *args, str(script), timeout=120, env=env)
        assert res.returncode == 0, res.stdout
        evs = events(where)
        assert named(evs, "workers_started")[0]["warm"] == [how == "warm"]
        reports[how] = (where / "logs" / "cycle_0" / "rank_0.log").read_text()
        if how == "warm":
            zygote = named(evs, "zygote_ready")
            assert len(zygote) == 1 and zygote[0]["threads"] == 1, zygote
            # The default preloads: what DDP imports by its first step.
            assert zygote[0]["preload"] == ["torch", "torch._dynamo"]
            assert not named(evs, "zygote_fallback")
    assert reports["warm"] == reports["cold"]
    count = int(re.search(r"^num_threads (\d+)$", reports["cold"], re.M).group(1))
    assert count == 1 if omp == "1" else count >= 1


def test_cold_thread_count_reads_the_variables_as_torch_does():
    count = activation.cold_thread_count
    assert count({}, 8) == 8
    assert count({"OMP_NUM_THREADS": "3"}, 8) == 3
    assert count({"OMP_NUM_THREADS": "12"}, 8) == 8  # no more than the cores
    assert count({"OMP_NUM_THREADS": " 4,2"}, 8) == 4  # std::stoi: the leading integer
    assert count({"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "1"}, 8) == 1  # MKL's first
    assert count({"OMP_NUM_THREADS": "0", "MKL_NUM_THREADS": "5"}, 8) == 5
    assert count({"OMP_NUM_THREADS": "x", "MKL_NUM_THREADS": "-1"}, 8) == 8
    assert count({"MKL_NUM_THREADS": "+6"}, 8) == 6


class _FakeClock:
    """Time that moves only when the wait pauses (each pause: 0.5 s)."""

    def __init__(self):
        self.now, self.pauses = 1000.0, 0

    def __call__(self):
        return self.now

    def pause(self):
        self.pauses += 1
        self.now += 0.5


def test_the_first_cycle_wait_is_bounded_and_ends_on_a_signal():
    """A zygote stuck in its imports holds the first cycle exactly the limit (then its ranks
    start cold); a stop signal ends the wait at the next look; ready standbys end it at once."""
    from ft_launcher.warm.standby_pool import FirstCycleWait, await_first_cycle

    clock = _FakeClock()
    wait = await_first_cycle(lambda: True, clock.pause, lambda: None, 60.0, clock)
    assert wait == FirstCycleWait(timed_out=True)
    assert clock.now == 1060.0 and clock.pauses == 120

    clock = _FakeClock()
    signals = iter([None, None, None, signal.SIGTERM])
    wait = await_first_cycle(lambda: True, clock.pause, lambda: next(signals), 60.0, clock)
    assert wait == FirstCycleWait(signum=signal.SIGTERM) and clock.pauses == 3

    clock = _FakeClock()
    looks = iter([True, True, False])
    wait = await_first_cycle(lambda: next(looks), clock.pause, lambda: None, 60.0, clock)
    assert wait == FirstCycleWait() and clock.pauses == 2

    clock = _FakeClock()
    wait = await_first_cycle(lambda: False, clock.pause, lambda: signal.SIGTERM, 60.0, clock)
    assert wait == FirstCycleWait() and clock.pauses == 0  # nothing to wait for: no wait


def test_a_first_cycle_wait_that_times_out_is_said_in_an_event(tmp_path, monkeypatch):
    """Standbys never ready: the first cycle starts once the limit passed, and says so in
    one standbys_not_ready event (not only a log line)."""
    from ft_launcher import join
    from ft_launcher.config import LaunchConfig
    from ft_launcher.signals import SignalBox

    class NeverReady:
        ticks = 0

        def first_cycle_waits(self) -> bool:
            return True

        def tick(self, training_started: bool) -> None:
            self.ticks += 1

    monkeypatch.setattr(join, "FIRST_CYCLE_WAIT_S", 0.2)
    seen: list[tuple[str, dict]] = []
    cfg = LaunchConfig(entrypoint=[sys.executable, "-u", "t.py"], script_args=[],
                       run_dir=tmp_path / "run")
    standbys = NeverReady()
    joiner = join.Joiner(cfg, None, standbys, SignalBox(), lambda n, **f: seen.append((n, f)),
                         tmp_path, gpus=lambda: 0)
    assert joiner.await_standbys(0) is None
    assert seen == [("standbys_not_ready", {"waited_s": 0.2})] and standbys.ticks > 0


def test_failing_preload_disables_warm_restart_once(tmp_path, run_dir):
    script = tmp_path / "wait_disabled.py"
    script.write_text(WAIT_FOR_DISABLED)
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--ft-warm-restart",
                       "--ft-preload", "json,no_such_module_ft_xyz", str(script), timeout=60)
    assert res.returncode == 0, res.stdout
    disabled = named(events(run_dir), "warm_restart_disabled")
    assert len(disabled) == 1
    assert "no_such_module_ft_xyz" in disabled[0]["reason"]
    assert "ModuleNotFoundError" in disabled[0]["reason"]
    assert not named(events(run_dir), "standby_ready")


def test_no_python_runs_cold_with_one_event(tmp_path, run_dir):
    program = tmp_path / "program.sh"
    program.write_text("#!/bin/sh\necho plain program\n")
    program.chmod(0o755)
    res = run_launcher(run_dir, "--ft-warm-restart", "--no-python", str(program), timeout=60)
    assert res.returncode == 0, res.stdout
    disabled = named(events(run_dir), "warm_restart_disabled")
    assert len(disabled) == 1 and "--no-python" in disabled[0]["reason"]
    assert named(events(run_dir), "workers_started")[0]["warm"] == [False]


@pytest.mark.parametrize("how", ["flag", "yaml", "flag over yaml", "start method spawn"])
def test_turned_off_no_standby(tmp_path, run_dir, how):
    script = tmp_path / "hb.py"
    script.write_text("from ft_agent import RankMonitorClient\n"
                      "import time\nft = RankMonitorClient()\nft.init_workload_monitoring()\n"
                      "for _ in range(20):\n    ft.send_heartbeat()\n    time.sleep(0.05)\n")
    cfg = tmp_path / "ft.yaml"
    args = {"flag": ["--no-ft-warm-restart"],
            "yaml": ["--ft-cfg-path", str(cfg)],
            # --no-ft-warm-restart wins over the file's warm_restart
            "flag over yaml": ["--ft-cfg-path", str(cfg), "--no-ft-warm-restart"],
            "start method spawn": ["--start-method", "spawn"]}[how]
    cfg.write_text(f"fault_tolerance:\n  warm_restart: {'false' if how == 'yaml' else 'true'}\n")
    res = run_launcher(run_dir, "--nproc-per-node", "2", *args, str(script), timeout=60)
    assert res.returncode == 0, res.stdout
    names = {e["event"] for e in events(run_dir)}
    assert not names & {"standby_ready", "standby_died", "warm_restart_disabled", "zygote_ready",
                        "zygote_fallback", "store_taken"}
    assert not (run_dir / "logs" / "standby").exists()


# -- units ------------------------------------------------------------------------------


def test_python_entry_parsing():
    py = sys.executable
    assert PythonEntry.parse([py, "-u", "train.py"]) == PythonEntry([py, "-u"], False,
                                                                    "train.py")
    assert PythonEntry.parse([py, "-u", "-m", "pkg.train"]) == PythonEntry([py, "-u"], True,
                                                                           "pkg.train")
    assert PythonEntry.parse(["/usr/bin/train"]) is None  # --no-python
    assert PythonEntry.parse(["/other/python", "-u", "train.py"]) is None


def test_activation_record_round_trip():
    entry = PythonEntry([sys.executable, "-u"], False, "t.py")
    env = {"A": "1", "B": "x=y\nz", "EMPTY": ""}
    args = ["--flag", "x y", "", "ü"]
    r, w = os.pipe()
    try:
        os.write(w, encode_record("/some/dir", entry, args, env))
        fields = [os.fsdecode(f) for f in activation._read_record(r)]
    finally:
        os.close(r)
        os.close(w)
    assert fields == ["/some/dir", "path", "t.py", "4", *args, "A=1", "B=x=y\nz", "EMPTY="]


def test_standby_worker_imports_nothing_heavy():
    """What the standby adds to a fresh interpreter's sys.modules is only itself."""
    code = ("import sys; before = set(sys.modules); "
            "import ft_launcher.warm.worker_side.activation; "
            "print(','.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=30, check=True).stdout
    assert out.strip().split(",") == [
        "ft_launcher", "ft_launcher.warm", "ft_launcher.warm.worker_side",
        "ft_launcher.warm.worker_side.activation", "ft_launcher.warm.worker_side.learning",
        "ft_launcher.warm.worker_side.warmups"]


ADOPTION = '''
import os, time
from ft_launcher.warm.standby_process import ChildProcess, become_subreaper, reap_orphans

assert become_subreaper()
PARENT = os.getpid()


def orphan(leader: bool, code: int) -> int:
    """A grandchild whose parent exits at once, so this process adopts it."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()  # the orphan's session is not ours
        grandchild = os.fork()
        if grandchild == 0:
            if leader:
                os.setsid()  # as a forked standby does
            while os.getppid() != PARENT:
                time.sleep(0.001)
            os.write(w, b"x")
            time.sleep(0.2)
            os._exit(code)
        os.write(w, str(grandchild).encode().rjust(16))
        os._exit(0)
    os.waitpid(child, 0)
    pid = int(os.read(r, 16))
    os.read(r, 1)  # adopted
    return pid


plain = orphan(False, 3)
leader = orphan(True, 7)
time.sleep(0.6)
reaped = reap_orphans()  # the plain orphan only: the leader is left to its owner
print(reaped, ChildProcess(leader).wait(timeout=5))
'''


def test_adopted_standby_exit_code_and_orphan_reaping():
    """A session leader adopted by the launcher (a forked standby) keeps its exit status
    for ChildProcess; an adopted orphan that leads nothing is reaped by reap_orphans."""
    proc = subprocess.run([sys.executable, "-c", ADOPTION], capture_output=True, text=True,
                          cwd=ROOT, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "7"]


STORE_CLIENT = '''
import datetime, sys
from torch.distributed import TCPStore

store = TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, datetime.timedelta(seconds=20))
store.set("cycle", "1")
print(store.get("cycle").decode())
'''


def test_take_store_hands_over_a_listening_tcpstore_per_cycle(tmp_path):
    """The zygote keeps a spare TCPStore host; take_store() hands it over (a real TCPStore
    client connects at once), asks for the next, and ends the previous cycle's."""
    from ft_launcher.config import FaultToleranceConfig, LaunchConfig
    from ft_launcher.warm.standby_pool import StandbyPool
    from ft_launcher.warm.standby_process import parent_of

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cfg = LaunchConfig(entrypoint=[sys.executable, "-u", str(script)], script_args=[],
                       nproc_per_node=2, run_dir=tmp_path / "run",  # OMP_NUM_THREADS=1:
                       # without it, torch's OpenMP pool makes forking unsafe (a fallback)
                       ft=FaultToleranceConfig(warm_restart=True, preload=["torch"]))
    seen: list[tuple[str, dict]] = []
    pool = StandbyPool(cfg, tmp_path / "standby", lambda name, **f: seen.append((name, f)))
    try:
        def spare():
            pool.tick(True)
            return pool.stores.spare

        assert pool.take_store() is None  # nothing ready yet: rank 0 hosts the first store
        wait_for(spare, 90, "a spare store from the zygote")
        first = pool.take_store()
        assert first is not None and pool.stores.current is not None
        first_host = pool.stores.current.pid
        client = subprocess.run([sys.executable, "-c", STORE_CLIENT, str(first)],
                                capture_output=True, text=True, timeout=60)
        assert client.stdout.strip() == "1", client.stderr
        wait_for(spare, 30, "the next spare store")
        second = pool.take_store()
        assert second is not None and second != first
        wait_for(lambda: _gone([first_host]) or pool.tick(True), 5,
                 "the previous cycle's store to end")
        assert parent_of(pool.stores.current.pid) == os.getpid()  # adopted: the launcher's child
        pids = [pool.stores.current.pid, pool.zygote.proc.pid]
    finally:
        pool.close()
    assert _gone(pids)
    assert [name for name, _ in seen].count("store_taken") == 2


@pytest.mark.slow
def test_a_cold_restart_uses_a_cycle_store_that_listens_before_the_workers(tmp_path, run_dir):
    """Warm restart off, --ft-agent-store: the store-only zygote (torch alone) hosts cycle 1's
    TCPStore, so every rank of cycle 1 is its client (TORCHELASTIC_USE_AGENT_STORE=True,
    MASTER_PORT = the store's port) and the all-reduce still adds up; cycle 0 started before
    the zygote was ready, so rank 0 hosted its store."""
    out = tmp_path / "out"
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--no-ft-warm-restart", "--ft-agent-store",
                       str(SCRIPTS / "agent_store.py"), str(out), timeout=170)
    assert res.returncode == 0, res.stdout[-3000:]
    evs = events(run_dir)
    assert [e["preload"] for e in named(evs, "zygote_ready")] == [["torch"]]
    assert not named(evs, "standby_ready")
    taken = named(evs, "store_taken")
    assert [e["cycle"] for e in taken] == [1], taken
    seen = {(c, r): json.loads((out / f"cycle_{c}_rank_{r}.json").read_text())
            for c in (0, 1) for r in (0, 1)}
    assert {v["sum"] for v in seen.values()} == {3.0}
    assert {seen[0, r]["agent_store"] for r in (0, 1)} == {"False"}
    assert {(seen[1, r]["agent_store"], seen[1, r]["master_port"]) for r in (0, 1)} == {
        ("True", taken[0]["port"])}
    assert not processes_of(run_dir), "a store host or the zygote outlived the launcher"


def test_no_agent_store_no_zygote(tmp_path):
    from ft_launcher.config import FaultToleranceConfig, LaunchConfig
    from ft_launcher.warm.standby_pool import StandbyPool

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cold = FaultToleranceConfig(warm_restart=False)
    for ft, nnodes, zygote in ((cold, 1, False),  # the agent store is off by default
                               (dataclasses.replace(cold, agent_store=True), 2, False),
                               (dataclasses.replace(cold, agent_store=True), 1, True)):
        cfg = LaunchConfig(entrypoint=[sys.executable, "-u", str(script)], script_args=[],
                           run_dir=tmp_path / "run", max_nodes=nnodes, ft=ft)
        pool = StandbyPool(cfg, tmp_path / "standby", lambda name, **f: None)
        try:
            assert (pool.zygote is not None) is zygote is pool.stores_only, (ft, nnodes)
            assert not pool.enabled  # never a standby
        finally:
            pool.close()


@pytest.mark.parametrize("code", [0, 1])
def test_a_script_that_leaves_its_group_up_has_it_destroyed_at_a_clean_exit_only(
        tmp_path, run_dir, code):
    """A script that never destroys its gloo group (a Hugging Face Trainer's) gets it
    destroyed after it exits with 0, before the interpreter's finalization, where a live
    group can abort the process (pytorch/pytorch#190489: with 4 cold ranks, this script
    died of SIGABRT at exit in 2 of 6 runs on the 2-core machine). After a failure the
    group is left alone."""
    out = tmp_path / "out"
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "0",
                       str(SCRIPTS / "leave_group.py"), str(out), "--code", str(code),
                       timeout=120)
    assert res.returncode == code, res.stdout[-3000:]
    exits = named(events(run_dir), "worker_exited")
    assert all(e["warm"] for e in exits), exits
    # After a failed rank the launcher stops the other, which may not have exited yet.
    own = [e for e in exits if not e["stopped_by_launcher"]]
    assert own and {e["exit_code"] for e in own} == {code}, exits
    destroyed = sorted(p.name for p in out.glob("destroyed_*"))
    if code == 0:
        assert destroyed == ["destroyed_0", "destroyed_1"]
        assert (out / "destroyed_0").read_text() == "initialized=True\n"
    else:
        assert destroyed == []


# -- cold workers end as warm ones do ------------------------------------------------------


@pytest.mark.parametrize("end, code", [("exit", 0), ("exit", 3), ("raise", None)])
def test_a_cold_script_ending_with_a_collective_in_flight_keeps_its_exit_code(
        tmp_path, run_dir, end, code):
    """Rank 0 of exit_with_group_up.py ends while its all-reduce completes and runs a
    Python callback: with its gloo group still up at the interpreter's finalization it
    dies of SIGABRT (every time, here). A cold worker's exit hook destroys the group after
    the script's own exit handlers, so the rank exits with its own status; after an
    uncaught exception it leaves the group alone. The script sees at start what a plain
    ``python`` sees: the hook takes itself out of PYTHONPATH, sys.path and sys.modules."""
    out = tmp_path / "out"
    ending = ["--raise"] if end == "raise" else ["--code", str(code)]
    res = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "0",
                       "--no-ft-warm-restart", str(SCRIPTS / "exit_with_group_up.py"),
                       str(out), *ending, timeout=120)
    exits = {e["rank"]: e for e in named(events(run_dir), "worker_exited")}
    assert not any(e["warm"] for e in exits.values()), exits
    if end == "raise":
        assert not (out / "destroyed_0").exists(), "left alone after a failure"
        return
    assert res.returncode == (0 if code == 0 else 1), res.stdout[-3000:]
    assert (exits[0]["exit_code"], exits[0]["signal"]) == (code, None), exits
    assert exits[1]["exit_code"] == 0, exits
    assert (out / "destroyed_0").exists()
    subprocess.run([sys.executable, "-u", str(SCRIPTS / "exit_with_group_up.py"), str(out)],
                   check=True, timeout=60, cwd=ROOT)
    plain = json.loads((out / "seen_plain.json").read_text())
    for rank in (0, 1):
        assert json.loads((out / f"seen_{rank}.json").read_text()) == plain


def test_the_exit_hook_goes_only_where_the_interpreter_loads_it():
    """A cold worker's PYTHONPATH gets the hook's directory first, and the value to put
    back beside it; not for a program that is not this interpreter, nor for one whose
    options make it skip ``site`` or the environment."""
    script = "/job/train.py"
    hooked = cold_exit.exit_hook_env([sys.executable, "-u", script], {"PYTHONPATH": "/lib"})
    assert hooked["PYTHONPATH"] == f"{cold_exit.HOOK_DIR}{os.pathsep}/lib"
    assert hooked[cold_exit.ORIGINAL] == "/lib"
    bare = cold_exit.exit_hook_env([sys.executable, "-u", "-m", "pkg.train"], {})
    assert (bare["PYTHONPATH"], bare[cold_exit.ORIGINAL]) == (cold_exit.HOOK_DIR, "-")
    for argv in ([sys.executable, "-I", script], [sys.executable, "-uE", script],
                 [sys.executable, "-S", script], ["/usr/bin/python3", script],
                 ["./train.sh"], []):
        assert cold_exit.exit_hook_env(argv, {"A": "1"}) == {"A": "1"}, argv
