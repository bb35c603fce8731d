"""End-to-end tests of the launcher core: real launchers, real workers, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from launch_helpers import (
    EXAMPLES,
    NO_PRELOADS,
    ROOT,
    SCRIPTS,
    TORCH_PRELOAD,
    events,
    freeze,
    launcher_cmd,
    named,
    run_launcher,
    summary,
    wait_for,
)

from ft_launcher.process.workers import handles_signal

pytestmark = pytest.mark.timeout(180)

TORCHRUN_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID"]


def test_clean_run_exits_0_with_torchrun_environment(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--rdzv-id", "job42",
                       str(SCRIPTS / "env_dump.py"), "--flag", "x y")
    assert res.returncode == 0, res.stdout
    assert "[rank1]: rank 1 says hello" in res.stdout
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["restarts"] == 0 and s["next_action"]["requeue"] is False
    for rank in (0, 1):
        dumped = json.loads((run_dir / "env" / f"cycle_0_rank_{rank}.json").read_text())
        env = dumped["env"]
        assert dumped["argv"][1:] == ["--flag", "x y"]
        for var in TORCHRUN_VARS + ["FT_ENDPOINT", "FT_TOKEN", "FT_RUN_DIR", "FT_CYCLE",
                                    "FT_DEVICE_ID"]:
            assert var in env, var
        assert env["RANK"] == env["LOCAL_RANK"] == env["FT_DEVICE_ID"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["TORCHELASTIC_RUN_ID"] == "job42"
        assert env["OMP_NUM_THREADS"] == "1" and env["FT_CYCLE"] == "0"
        assert env["FT_ENDPOINT"].startswith("ipc://")
        assert (run_dir / "logs" / "cycle_0" / f"rank_{rank}.log").read_text().strip() \
            == f"rank {rank} says hello"
        # A warm worker (the default) shows the zygote's environment in /proc/PID/environ,
        # without RANK: workers.json is where outside tools find its rank.
        assert dumped["workers_json"] == {"rank": rank, "local_rank": rank, "cycle": 0,
                                          "warm": True}
        assert dumped["rank_in_proc_environ"] is False
    assert json.loads((run_dir / "workers.json").read_text()) == \
        {"cycle": None, "workers": {}}, "emptied once the cycle ended"
    exited = named(events(run_dir), "worker_exited")
    assert sorted((e["rank"], e["exit_code"], e["stopped_by_launcher"]) for e in exited) == \
        [(0, 0, False), (1, 0, False)]
    names = [e["event"] for e in events(run_dir)]
    for name in ("launcher_started", "rendezvous_done", "workers_started", "worker_exited",
                 "launcher_exited"):
        assert name in names
    assert oct(os.stat(run_dir / "ipc").st_mode & 0o777) == "0o700"


def test_killed_worker_restarts_and_resumes_from_checkpoint(run_dir):
    """SIGKILL a rank once a checkpoint exists: the group restarts, resumes, finishes 0."""
    cmd = launcher_cmd(run_dir, "--nproc-per-node", "2", "--max-restarts", "2",
                       "--ft-snapshot-every", "off",  # the disk checkpoint is what is tested
                       str(EXAMPLES / "train_ddp.py"), "--steps", "60", "--ckpt-every", "10",
                       "--step-time", "0.03")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    try:
        iteration = run_dir / "ckpt" / "iteration"
        wait_for(iteration.exists, 60, "the first checkpoint")
        pid = named(events(run_dir), "workers_started")[0]["pids"][1]
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    s = summary(run_dir)
    assert s["restarts"] == 1 and s["cycles"] == 2
    killed = [w for w in s["workers"] if w["cycle"] == 0 and not w["stopped_by_launcher"]]
    assert killed == [{"cycle": 0, "rank": 1, "local_rank": 1, "pid": pid, "exit_code": None,
                       "signal": "SIGKILL", "stopped_by_launcher": False,
                       "warm": True}]  # the default: the first cycle's workers are forks too
    resumed = (run_dir / "logs" / "cycle_1" / "rank_0.log").read_text()
    start = int(resumed.split("resumed from step ")[1].split()[0])
    assert start >= 10, "the restart lost checkpointed progress"
    assert f"cycle 1 step {start} " not in resumed and f"cycle 1 step {start + 1} " in resumed
    assert json.loads((run_dir / "ckpt" / "result.json").read_text())["steps"] == 60
    restart = named(events(run_dir), "restart")[0]
    assert restart["cycle"] == 1 and restart["restarts"] == 1


def test_restarts_exhausted_exits_1_and_keeps_worker_codes(run_dir):
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--max-restarts", "1",
                       str(SCRIPTS / "env_dump.py"), env={"EXIT_CODE": "3"})
    assert res.returncode == 1, res.stdout
    s = summary(run_dir)
    assert "restarts exhausted" in s["reason"] and s["cycles"] == 2 and s["restarts"] == 1
    assert s["next_action"]["requeue"] is True
    codes = {(w["cycle"], w["rank"]): w["exit_code"] for w in s["workers"]
             if not w["stopped_by_launcher"]}
    assert 3 in codes.values()
    # Both ranks exit 3 at once: the one that failed first wrote its environment; the other
    # may be stopped before it does.
    dumped = sorted((run_dir / "env").glob("cycle_1_rank_*.json"))
    assert dumped, sorted(p.name for p in (run_dir / "env").iterdir())
    env1 = json.loads(dumped[0].read_text())["env"]
    assert env1["TORCHELASTIC_RESTART_COUNT"] == "1" and env1["FT_CYCLE"] == "1"


def _worker_pids(run_dir, n=2):
    """The pids the sleepers wrote, once all ``n`` files are written (not just created)."""
    pids_dir = run_dir / "pids"

    def written():
        if not pids_dir.exists():
            return None
        texts = [p.read_text() for p in sorted(pids_dir.iterdir())]
        return texts if len(texts) == n and all(t.strip() for t in texts) else None

    return [int(t) for t in wait_for(written, 60, "workers to start")]


def _gone(pids):
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
               for p in pids)


@pytest.mark.parametrize(("signum", "stop_one"),
                         [(signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["sigint-running", "sigterm-one-sigstopped"])
def test_signal_stops_every_worker_within_grace(run_dir, signum, stop_one):
    proc = subprocess.Popen(
        launcher_cmd(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--term-timeout", "20",
                     str(SCRIPTS / "sleeper.py")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        pids = _worker_pids(run_dir)
        if stop_one:
            freeze(pids[1])
        t0 = time.monotonic()
        proc.send_signal(signum)
        proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum
    # A stopped worker is continued first, so it does not cost the 20 s grace.
    assert elapsed < 5, f"teardown took {elapsed:.1f} s"
    assert _gone(pids)
    s = summary(run_dir)
    assert s["exit_code"] == 128 + signum and signal.Signals(signum).name in s["reason"]
    # Slurm's SIGTERM before a time limit or preemption: the job is not finished.
    assert s["next_action"]["requeue"] is (signum == signal.SIGTERM)


def test_worker_ignoring_sigterm_is_killed_after_term_timeout(run_dir):
    proc = subprocess.Popen(
        launcher_cmd(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--term-timeout", "1.5",
                     str(SCRIPTS / "sleeper.py"), "ignore-term"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        pids = _worker_pids(run_dir)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert 1.4 < elapsed < 6, elapsed
    assert _gone(pids)
    exits = {w["rank"]: w["signal"] for w in summary(run_dir)["workers"]}
    assert exits == {0: "SIGKILL", 1: "SIGKILL"}


def test_sigkill_of_launcher_leaves_no_worker(run_dir):
    proc = subprocess.Popen(launcher_cmd(run_dir, *NO_PRELOADS, "--nproc-per-node", "2",
                                         str(SCRIPTS / "sleeper.py")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    pids = _worker_pids(run_dir)
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: _gone(pids), 2.0, "workers to die with their launcher")


# The first restarts come before the launcher has spare standbys (fresh interpreters, as a
# rule); the rest are forked from them. A fresh worker imports torch (~1.3 CPU s), so the
# script waits for the spares in all but the first COLD cycles.
COLD = 2


@pytest.mark.timeout(240)
def test_twenty_crash_restarts_in_a_row(run_dir):
    """torchrun's own restart of a 2-rank gloo job often fails to re-form the group."""
    res = run_launcher(run_dir, *TORCH_PRELOAD, "--nproc-per-node", "2", "--max-restarts", "20",
                       str(SCRIPTS / "crash_loop.py"), "20", "--cold", str(COLD), timeout=220)
    assert res.returncode == 0, res.stdout[-3000:]
    s = summary(run_dir)
    assert s["restarts"] == 20 and s["cycles"] == 21
    evs = events(run_dir)
    ports = [e["master_port"] for e in named(evs, "rendezvous_done")]
    assert len(ports) == 21
    # Picked anew each cycle (test_master_port.py): the kernel picks a free port at random,
    # so one repeat among 21 happens by chance (p ~ 1.5 %), two almost never (p ~ 1e-4).
    assert len(set(ports)) >= 20, ports
    # Cycle 0's workers are the zygote's first forks; every cycle after one whose rank 1
    # waited for spare standbys is forked from them.
    warm = [e["warm"] for e in named(evs, "workers_started")]
    assert len(warm) == 21 and warm[0] == [True, True], warm
    assert all(w == [True, True] for w in warm[COLD + 1:]), warm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_launchers_on_loopback_form_one_world_and_restart_together(tmp_path, run_dir):
    """Two nodes through torch's c10d rendezvous; a worker failure on node B restarts both."""
    port = _free_port()
    out = tmp_path / "results"
    common = [*TORCH_PRELOAD, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "twonode",
              "--max-restarts", "3", "--monitor-interval", "0.2"]
    dirs = [run_dir / "node_a", run_dir / "node_b"]
    procs = [subprocess.Popen(launcher_cmd(d, *common, str(SCRIPTS / "allreduce.py"), str(out)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=ROOT, env={**os.environ, "FAIL_RANK": "1"})
             for d in dirs]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=200)[0])
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    results = {f.name: json.loads(f.read_text()) for f in out.iterdir()}
    assert results["cycle_0_rank_0.json"]["sum"] == 3.0  # 1 + 2: both nodes in one world
    assert results["cycle_0_rank_0.json"]["world"] == 2
    last = max(int(n.split("_")[1]) for n in results)
    assert last >= 1, "the group was not restarted"
    assert results[f"cycle_{last}_rank_0.json"]["sum"] == 3.0
    assert results[f"cycle_{last}_rank_1.json"]["sum"] == 3.0
    for d in dirs:
        started = named(events(d), "workers_started")
        assert len(started) >= 2, f"{d.name} did not restart"
        # Warm restart, the default, on several nodes too: each node's first cycle is
        # forked from its own zygote.
        assert started[0]["warm"] == [True], (d.name, started)


# -- bad input: one clear line, non-zero exit, no traceback ------------------------------


def _launch_error(args: list[str], cwd=ROOT) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "ft_launcher.cli", *args], capture_output=True,
                         text=True, timeout=60, cwd=cwd)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr + res.stdout
    return res


def test_bad_input_is_one_clear_error(tmp_path):
    script = str(SCRIPTS / "env_dump.py")
    assert "training script 'nope.py' not found" in _launch_error(["nope.py"]).stderr
    assert "--nnodes" in _launch_error(["--nnodes", "two", script]).stderr
    assert "No such option" in _launch_error(["--bogus", script]).stderr
    assert "--nproc-per-node" in _launch_error(["--nproc-per-node", "0", script]).stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _launch_error(["--master-port", str(port), "--ft-run-dir", str(tmp_path / "r"),
                             script]).stderr
        assert f"--master-port {port}: port in use" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _launch_error(["--ft-run-dir", str(blocker / "sub"), script]).stderr
    assert "run directory" in err
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("fault_tolerance:\n  rank_heartbeat_timout: 5\n")
    err = _launch_error(["--ft-cfg-path", str(cfg), script]).stderr
    assert "unknown key fault_tolerance.rank_heartbeat_timout" in err
    assert "did you mean 'rank_heartbeat_timeout'" in err
    err = _launch_error(["--ft-simulated-fault", "rank_exploded", script]).stderr
    assert "unknown fault type 'rank_exploded'" in err
    err = _launch_error(["--ft-rank-heartbeat-timeout", "-3", script]).stderr
    assert "--ft-rank-heartbeat-timeout: must be greater than 0" in err
    for res_err in (err,):
        assert len(res_err.strip().splitlines()) == 1


def test_sigusr1_is_passed_to_workers_which_checkpoint_and_exit(run_dir):
    """Slurm's --signal=B:USR1@N: the job goes on, the training checkpoints and stops."""
    proc = subprocess.Popen(
        launcher_cmd(run_dir, "--nproc-per-node", "2", str(EXAMPLES / "train_ddp.py"),
                     "--steps", "100000", "--ckpt-every", "1000", "--step-time", "0.01"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        log = run_dir / "logs" / "cycle_0" / "rank_1.log"
        wait_for(lambda: log.exists() and " step 20 " in log.read_text(), 60, "training")
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert named(events(run_dir), "signal_forwarded")[0]["signal"] == "SIGUSR1"
    step = int((run_dir / "ckpt" / "iteration").read_text())
    assert 20 <= step < 100000
    assert f"SIGUSR1, checkpointed step {step}" in log.read_text()


def test_sigusr1_waits_for_each_ranks_handler(run_dir):
    """A SIGUSR1 that comes while the ranks are still starting (during a restart, or while
    they import) must not kill them by its default action: each rank gets it once it has
    installed a handler, and the job goes on."""
    proc = subprocess.Popen(
        launcher_cmd(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--max-restarts", "0",
                     str(SCRIPTS / "usr1_late.py")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        wait_for(lambda: all((run_dir / f"started_{r}").exists() for r in (0, 1)), 60,
                 "the ranks to start")
        proc.send_signal(signal.SIGUSR1)
        held = wait_for(lambda: named(events(run_dir), "signal_held"), 30,
                        "the launcher to hold the signal")
        (run_dir / "go").write_text("")  # now the ranks install their handlers
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert (held[0]["signal"], held[0]["ranks"]) == ("SIGUSR1", [0, 1])
    forwarded = named(events(run_dir), "signal_forwarded")
    assert sorted(r for e in forwarded for r in e["ranks"]) == [0, 1], forwarded
    assert "rank 0: got SIGUSR1" in out and "rank 1: got SIGUSR1" in out


def test_handles_signal_reads_the_process_own_dispositions():
    # The child sets every disposition asserted on (a shell started with nohup passes SIGHUP
    # on ignored, a background job SIGINT; SIG_IGN survives exec).
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time\n"
         "for s in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):\n"
         "    signal.signal(s, signal.SIG_DFL)\n"
         "print('ready', flush=True)\n"
         "sys.stdin.readline()\n"
         "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
         "signal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
         "print('set', flush=True)\n"
         "time.sleep(60)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert not handles_signal(child.pid, signal.SIGUSR1)
        assert not handles_signal(child.pid, signal.SIGUSR2)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "set"
        assert handles_signal(child.pid, signal.SIGUSR1)  # a handler
        assert handles_signal(child.pid, signal.SIGUSR2)  # ignored: harmless to send
        assert not handles_signal(child.pid, signal.SIGHUP)
    finally:
        child.kill()
        child.wait()
    assert not handles_signal(child.pid, signal.SIGUSR1)  # gone


def test_a_rank_that_traps_sigterm_but_keeps_working_does_not_hold_the_restart(run_dir):
    """--workers-stop-timeout is grace for a rank that shuts down, not for one that carries
    on: a rank still heartbeating half a second after SIGTERM is killed at once."""
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", "--max-restarts", "1",
                       "--workers-stop-timeout", "30",
                       "--ft-simulated-fault", "rank_killed:base_delay=1,rank=1",
                       str(SCRIPTS / "sigterm_trapper.py"), timeout=120)
    assert res.returncode == 0, res.stdout[-3000:]
    evs = events(run_dir)
    died = next(e for e in evs if e["event"] == "worker_exited" and e["cycle"] == 0
                and e["rank"] == 1)
    trapper = next(e for e in evs if e["event"] == "worker_exited" and e["cycle"] == 0
                   and e["rank"] == 0)
    restart = next(e for e in evs if e["event"] == "restart")
    assert trapper["signal"] == "SIGKILL"
    # 0.5 s of grace plus the next heartbeat; generous for a loaded machine, far below 30 s.
    assert restart["ts"] - died["ts"] < 5.0, (died, restart)


@pytest.mark.parametrize("mode", ["stall", "advance"])
def test_no_progress_in_the_checkpoint_iteration_file_stops_with_18(run_dir, tmp_path, mode):
    """Every cycle fails; the training's checkpoint-iteration file says 5 after each (stall):
    exit 18 after --ft-max-no-progress-cycles 2 such cycles, not a requeue. When the file
    advances each cycle the job is not stopped for it: the restarts run out instead."""
    ckpt = tmp_path / "latest_checkpointed_iteration.txt"
    res = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", "--max-restarts", "3",
                       "--ft-max-no-progress-cycles", "2",
                       "--ft-checkpoint-iteration-file", str(ckpt),
                       str(SCRIPTS / "ckpt_file_crash.py"), str(ckpt), mode, timeout=120)
    s = summary(run_dir)
    if mode == "stall":
        assert res.returncode == 18, res.stdout[-3000:]
        assert s["exit_code"] == 18 and s["cycles"] == 3 and s["restarts"] == 2, s
        assert s["reason"] == "no progress past iteration 5 in 2 cycles", s["reason"]
        assert s["next_action"]["requeue"] is False
    else:
        assert res.returncode == 1, res.stdout[-3000:]
        assert s["cycles"] == 4 and "restarts exhausted" in s["reason"], s
        assert ckpt.read_text() == "8\n"
