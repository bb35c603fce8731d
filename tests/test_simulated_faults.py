"""``ft_launcher --ft-simulated-fault``: every fault type end to end, plus the option's parsing.

Real launchers, real workers, real signals. rank_killed and rank_hung run the real DDP
example (gloo) and must be recovered from its checkpoint; random and rank_exit run a small
heartbeating worker (no torch: the zygote preloads nothing), which is all they need and keeps
the file fast.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch_helpers import (
    EXAMPLES,
    LAUNCHER,
    NO_PRELOADS,
    ROOT,
    SCRIPTS,
    events,
    named,
    run_launcher,
    summary,
)

from ft_launcher import faults
from ft_launcher.config import ConfigError

pytestmark = pytest.mark.timeout(150)

TRAIN_DDP = str(EXAMPLES / "train_ddp.py")
FAST_STOP = ("--workers-stop-timeout", "2")

# A worker that records its environment, heartbeats for argv[1] seconds and exits 0.
WORKER = """
import json, os, sys, time
from pathlib import Path
from ft_agent import RankMonitorClient

run = Path(os.environ["FT_RUN_DIR"])
(run / "env").mkdir(exist_ok=True)
keys = ("RANK", "FT_CYCLE", "FT_DEVICE_ID", "FT_SIMULATED_FAULT")
name = f"cycle_{os.environ['FT_CYCLE']}_rank_{os.environ['RANK']}.json"
(run / "env" / name).write_text(json.dumps({k: os.environ.get(k) for k in keys}))
client = RankMonitorClient()
client.init_workload_monitoring()
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    client.send_heartbeat()
    time.sleep(0.05)
client.shutdown_workload_monitoring()
"""


@pytest.fixture
def worker(tmp_path: Path) -> str:
    path = tmp_path / "hb_worker.py"
    path.write_text(WORKER)
    return str(path)


def worker_env(run_dir: Path, cycle: int, rank: int) -> dict:
    return json.loads((run_dir / "env" / f"cycle_{cycle}_rank_{rank}.json").read_text())


def one(evs: list[dict], name: str, **match) -> dict:
    found = [e for e in named(evs, name) if all(e.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one {name} {match}, got {found}"
    return found[0]


# -- parsing -----------------------------------------------------------------------------


def test_parse_keys_and_defaults():
    plan = faults.parse_fault("rank_exit:base_delay=1.5,rand_delay=2,rank=3,cycles=1-2,"
                              "seed=9,code=17")
    assert (plan.fault_type, plan.base_delay, plan.rand_delay, plan.rank, plan.seed,
            plan.code) == ("rank_exit", 1.5, 2.0, 3, 9, 17)
    assert [plan.fires_in(c) for c in range(4)] == [False, True, True, False]
    default = faults.parse_fault("rank_killed")
    assert default.rank is None and [default.fires_in(c) for c in range(3)] == [True, False,
                                                                                 False]
    assert all(faults.parse_fault("rank_hung:cycles=all").fires_in(c) for c in range(50))


@pytest.mark.parametrize("text, words", [
    ("bogus", "unknown fault type 'bogus'"),
    ("rank_killed:delay=3", "unknown key 'delay'"),
    ("rank_killed:base_delay", "unknown key 'base_delay'"),
    ("rank_killed:base_delay=soon", "base_delay='soon' is not a number"),
    ("rank_killed:base_delay=-1", "base_delay='-1' must be a finite number >= 0"),
    ("rank_hung:rand_delay=nan", "rand_delay='nan' must be a finite number >= 0"),
    ("rank_killed:cycles=3-1", "cycles='3-1' is an empty range"),
    ("rank_killed:cycles=first", "expected N, A-B or all"),
    ("rank_exit", "rank_exit needs code=N"),
    ("rank_exit:code=0", "code=0 is not an exit code"),
    ("rank_exit:code=300", "code=300 is not an exit code"),
    ("rank_killed:code=16", "code= applies to rank_exit only"),
])
def test_parse_errors_name_the_option(text, words):
    with pytest.raises(ConfigError) as err:
        faults.parse_fault(text)
    assert str(err.value).startswith("--ft-simulated-fault: ")
    assert words in str(err.value)


def test_victim_outside_the_world_is_rejected():
    plan = faults.parse_fault("rank_killed:rank=2")
    faults.validate_world(plan, 3)
    with pytest.raises(ConfigError, match="rank=2 but the world has 2 ranks"):
        faults.validate_world(plan, 2)
    with pytest.raises(ConfigError, match="rank=2 but the world has 2 ranks"):
        faults.arm(plan, 0, 2, "run")


def test_arm_is_the_same_on_every_node_and_seeded():
    plan = faults.parse_fault("random:base_delay=2,rand_delay=3,cycles=all")
    draws = {(a.rank, a.fault_type) for a in (faults.arm(plan, 0, 8, "job-1") for _ in range(5))}
    assert len(draws) == 1, "every node must arm the same victim and type"
    victims = {faults.arm(plan, 0, 8, f"job-{i}").rank for i in range(200)}
    types = {faults.arm(plan, 0, 8, f"job-{i}").fault_type for i in range(200)}
    assert len(victims) == 8 and types == {"rank_killed", "rank_hung"}
    seeded = faults.parse_fault("random:seed=5,cycles=all")
    assert faults.arm(seeded, 3, 8, "a").rank == faults.arm(seeded, 3, 8, "b").rank
    armed = faults.arm(plan, 0, 8, "job-1")
    assert armed is not None and armed.fault_type in ("rank_killed", "rank_hung")
    assert faults.arm(faults.parse_fault("rank_hung"), 1, 8, "x") is None  # first cycle only


def _armed(delay: float = 4) -> faults.ArmedFault:
    plan = faults.parse_fault(f"rank_killed:base_delay={delay:g},rank=0")
    armed = faults.arm(plan, 0, 2, "r")
    assert armed is not None
    return armed


def test_a_plain_script_counts_from_spawn_until_a_rank_says_hello_then_from_training():
    spawn = 1000.0
    quiet = _armed()  # a script that never talks to ft_agent: from the spawn, imports included
    quiet.start_clock(spawn, None, connected=False, now=spawn + 0.1)
    assert (quiet.at, quiet.counted_from, quiet.due()) == (spawn + 4, "spawn", spawn + 4)
    quiet.start_clock(spawn, None, connected=False, now=spawn + 3)
    assert quiet.at == spawn + 4, "the same deadline on every pass"
    a = _armed()
    a.start_clock(spawn, None, connected=False, now=spawn + 1)  # still importing
    assert a.at == spawn + 4
    a.start_clock(spawn, None, connected=True, now=spawn + 2)  # hello: re-based on training
    assert (a.at, a.agent, a.counted_from, a.due()) == (None, True, "training", None)
    a.start_clock(spawn, None, connected=True, now=spawn + 20)  # process-group setup
    assert a.at is None, "a connected rank that is not training yet holds the clock"
    a.start_clock(spawn, spawn + 21, connected=True, now=spawn + 21)
    assert a.at == spawn + 25
    a.start_clock(spawn, spawn + 99, connected=True, now=spawn + 99)
    assert a.at == spawn + 25, "fixed once"
    a.start_clock(spawn, spawn + 99, connected=False, now=spawn + 99)  # a hello stays said
    assert (a.at, a.counted_from) == (spawn + 25, "training")
    late = _armed(45)  # a long delay for a plain script: no floor and no cap
    late.start_clock(spawn, None, connected=False, now=spawn)
    assert late.at == spawn + 45
    zero = _armed(0)
    zero.start_clock(spawn, None, connected=False, now=spawn)
    assert zero.at == spawn
    fired = _armed()
    fired.fired = True
    assert fired.due() is None


def test_a_script_that_never_says_hello_is_hit_from_its_spawn_whatever_it_imports():
    spawn = 1000.0
    mute = _armed()  # e.g. imports ft_agent behind a flag that this run does not set
    for now in (spawn, spawn + 3.9, spawn + 60):
        mute.start_clock(spawn, None, connected=False, now=now)
        assert (mute.at, mute.clock_at, mute.counted_from) == (spawn + 4, spawn, "spawn")
    slow = _armed()  # its imports outlast base_delay: the hello comes too late to re-base
    slow.start_clock(spawn, None, connected=False, now=spawn + 4.5)
    assert slow.due() == spawn + 4
    slow.fired = True
    slow.start_clock(spawn, None, connected=True, now=spawn + 5)
    assert slow.due() is None


@dataclass
class _Exited:
    rank: int
    started_at: float
    exit_code: int | None


def test_a_fault_that_never_fired_is_named_with_its_wait_and_the_cycle_length():
    workers = [_Exited(0, 1000.0, 0), _Exited(1, 1000.5, 0)]
    armed = _armed(60)
    armed.start_clock(1000.5, None, connected=False, now=1000.5)
    assert faults.not_fired(armed, workers, 1003.0) == {
        "fault_type": "rank_killed", "rank": 0, "delay": 60.0, "counted_from": "spawn",
        "waited_s": 2.5, "cycle_s": 2.5}
    said_hello = _armed(60)  # a hello re-based the clock on training, which started at 1001
    said_hello.start_clock(1000.5, None, connected=True, now=1000.6)
    said_hello.start_clock(1000.5, 1001.0, connected=True, now=1001.0)
    assert faults.not_fired(said_hello, workers, 1003.0) == {
        "fault_type": "rank_killed", "rank": 0, "delay": 60.0, "counted_from": "training",
        "waited_s": 2.0, "cycle_s": 2.5}
    never_trained = _armed(60)  # a hello, but the ranks never all started training
    never_trained.start_clock(1000.5, None, connected=True, now=1000.6)
    assert faults.not_fired(never_trained, workers, 1003.0)["waited_s"] is None
    armed.fired = True
    assert faults.not_fired(armed, workers, 1003.0) is None
    assert faults.not_fired(None, workers, 1003.0) is None
    exit_fault = faults.arm(faults.parse_fault("rank_exit:code=16,rank=1"), 0, 2, "r")
    missed = faults.not_fired(exit_fault, workers, 1003.0)
    assert missed is not None and missed["counted_from"] == "connection"
    carried_out = [_Exited(0, 1000.0, -9), _Exited(1, 1000.0, 16)]
    assert faults.not_fired(exit_fault, carried_out, 1003.0) is None, "its exit is the fault"


def test_a_fault_that_never_fired_is_one_event_and_one_warning(caplog):
    said: list[tuple[str, dict]] = []
    with caplog.at_level(logging.INFO, logger="ft_launcher"):
        faults.report_not_fired(_armed(60), [_Exited(0, 1000.0, 0)], 1002.0, 3,
                                lambda name, **f: said.append((name, f)))
        faults.report_not_fired(None, [_Exited(0, 1000.0, 0)], 1002.0, 3,
                                lambda name, **f: said.append((name, f)))
    assert [name for name, _ in said] == ["fault_not_fired"]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "cycle 3: simulated rank_killed for rank 0 never fired: due 60 s "
                          "after spawn, it waited 2 s on that clock; the cycle ended 2 s "
                          "after the spawn")]


def test_cli_rejects_a_bad_fault_in_one_line(tmp_path: Path):
    proc = subprocess.run([*LAUNCHER, "--ft-run-dir", str(tmp_path / "run"),
                           "--ft-simulated-fault", "rank_exit:code=16,when=now", TRAIN_DDP],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == ("Error: --ft-simulated-fault: unknown key 'when'; expected key=value "
                         "with key one of base_delay, rand_delay, rank, cycles, seed, code")


# -- rank_killed and rank_hung: real DDP training recovered from its checkpoint ----------


def test_rank_killed_is_recovered_from_the_checkpoint(run_dir: Path):
    proc = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP,
                        "--ft-snapshot-every", "off",  # the disk checkpoint is what is tested
                        "--ft-simulated-fault", "rank_killed:base_delay=7,rank=1",
                        TRAIN_DDP, "--steps", "160", "--step-time", "0.05",
                        "--ckpt-every", "5", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    evs = events(run_dir)
    injected = one(evs, "fault_injected")
    assert (injected["cycle"], injected["rank"], injected["fault_type"]) == (0, 1, "rank_killed")
    assert abs(injected["ts"] - injected["at"]) < 0.5, "delivered at the planned time"
    died = one(evs, "worker_exited", cycle=0, rank=1)
    assert died["signal"] == "SIGKILL" and not died["stopped_by_launcher"]
    assert 0 <= died["ts"] - injected["ts"] < 2.0
    restart = one(evs, "restart")
    assert restart["ts"] > died["ts"] and "rank 1 failed (signal SIGKILL)" in restart["reason"]
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["cycles"]) == (0, 1, 2)
    assert {"cycle": 0, "kind": "injected", "fault_type": "rank_killed", "rank": 1} in s["faults"]
    # Cycle 1 resumed from the last checkpoint of cycle 0 (every 5 steps) and finished.
    log0 = (run_dir / "logs" / "cycle_0" / "rank_0.log").read_text()
    log1 = (run_dir / "logs" / "cycle_1" / "rank_0.log").read_text()
    last0 = max((int(line.split(" step ")[1].split()[0]) for line in log0.splitlines()
                 if " cycle 0 step " in line), default=0)
    resumed = int(log1.split("resumed from step ")[1].split()[0]) if "resumed" in log1 else 0
    assert resumed % 5 == 0 and last0 - 10 < resumed <= last0, (resumed, last0)
    assert f"cycle 1 step {resumed + 1} loss" in log1
    result = json.loads((run_dir / "ckpt" / "result.json").read_text())
    assert result == {**result, "steps": 160, "cycle": 1}
    # ft_report pairs the fault with its detection and the restart.
    report = json.loads(subprocess.run(
        [str(Path(sys.executable).parent / "ft_report"), "--json", str(run_dir)],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=True).stdout)
    row = report["cycles"][0]
    assert row["faults"][0] == "injected rank_killed rank 1"
    assert 0 <= row["detection_s"] < 2.0 and row["restart_s"] is not None


def test_rank_hung_is_detected_and_recovered(run_dir: Path):
    proc = run_launcher(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", *FAST_STOP,
                        "--ft-rank-heartbeat-timeout", "3",
                        "--ft-initial-rank-heartbeat-timeout", "60",
                        "--ft-simulated-fault", "rank_hung:base_delay=3,rand_delay=1,rank=0",
                        TRAIN_DDP, "--steps", "140", "--step-time", "0.05",
                        "--ckpt-every", "5", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    evs = events(run_dir)
    injected = one(evs, "fault_injected")
    assert (injected["cycle"], injected["rank"], injected["fault_type"]) == (0, 0, "rank_hung")
    hang = one(evs, "hang_detected")
    # The fault's delay counts from the moment both ranks are training, so the stop lands
    # after the first heartbeat. Rank 0 is stopped and rank 1 waits for it in a collective:
    # both go silent, and the stopped one is blamed.
    assert hang["cycle"] == 0 and hang["timeout_kind"] == "heartbeat"
    assert hang["rank"] == 0 and hang["blame"] == "stopped"
    assert hang["timeout_s"] == 3.0
    assert 2.5 < hang["detected_at"] - injected["ts"] < 3.0 + 2.0
    assert one(evs, "restart")["ts"] > hang["ts"]
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"]) == (0, 1)
    assert f"hung ({hang['timeout_kind']} timeout)" in one(evs, "decision", cycle=0)["reason"]
    result = json.loads((run_dir / "ckpt" / "result.json").read_text())
    assert result["steps"] == 140 and result["cycle"] == 1


# -- random and rank_exit: any script ----------------------------------------------------


def test_random_fault_is_seeded_and_recovered(run_dir: Path, worker: str):
    spec = "random:base_delay=1.5,rand_delay=1,seed=11"
    expected = faults.arm(faults.parse_fault(spec), 0, 2, "unused")
    proc = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", *FAST_STOP,
                        "--max-restarts", "1",
                        "--ft-rank-heartbeat-timeout", "2", "--ft-simulated-fault", spec,
                        worker, "5", timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:]
    evs = events(run_dir)
    injected = one(evs, "fault_injected")
    assert (injected["rank"], injected["fault_type"]) == (expected.rank, expected.fault_type)
    # The delay counts from the moment every rank is training (its first heartbeat).
    started = one(evs, "training_started", cycle=0)["at"]
    assert 1.5 - 0.1 <= injected["at"] - started <= 2.5 + 0.1
    if expected.fault_type == "rank_hung":
        assert one(evs, "hang_detected")["rank"] == expected.rank
    else:
        assert one(evs, "worker_exited", cycle=0, rank=expected.rank)["signal"] == "SIGKILL"
    assert summary(run_dir)["restarts"] == 1
    assert not named([e for e in evs if e["cycle"] == 1], "fault_injected")


def test_rank_exit_16_rotates_devices_then_requeues_elsewhere(run_dir: Path, worker: str):
    # Cycle 0: a 16 with two local devices is resolved here, on rotated devices.
    # Cycle 1: no device left to rotate to, so the launcher exits 16 and excludes this host.
    proc = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", *FAST_STOP,
                        "--max-restarts", "3",
                        "--ft-simulated-fault", "rank_exit:code=16,base_delay=1,rank=1,"
                        "cycles=0-1", worker, "30", timeout=60)
    assert proc.returncode == 16, proc.stdout[-3000:]
    evs = events(run_dir)
    for cycle in (0, 1):
        injected = one(evs, "fault_injected", cycle=cycle)
        assert (injected["rank"], injected["fault_type"], injected["code"]) == (1, "rank_exit",
                                                                                16)
        exited = one(evs, "worker_exited", cycle=cycle, rank=1)
        assert exited["exit_code"] == 16 and not exited["stopped_by_launcher"]
    assert worker_env(run_dir, 0, 1)["FT_SIMULATED_FAULT"].startswith("rank_exit:code=16,")
    assert worker_env(run_dir, 0, 0)["FT_SIMULATED_FAULT"] is None
    assert [worker_env(run_dir, 0, r)["FT_DEVICE_ID"] for r in (0, 1)] == ["0", "1"]
    assert [worker_env(run_dir, 1, r)["FT_DEVICE_ID"] for r in (0, 1)] == ["1", "0"]
    assert "rotated devices" in one(evs, "decision", cycle=0)["reason"]
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["cycles"]) == (16, 1, 2)
    assert s["next_action"]["requeue"] is True
    assert s["next_action"]["exclude_nodes"] == [socket.gethostname()]


def test_rank_exit_16_with_one_local_rank_requeues_elsewhere(run_dir: Path, worker: str):
    proc = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", *FAST_STOP,
                        "--max-restarts", "3",
                        "--ft-simulated-fault", "rank_exit:code=16,base_delay=0.5",
                        worker, "30", timeout=60)
    assert proc.returncode == 16, proc.stdout[-3000:]
    s = summary(run_dir)
    assert (s["restarts"], s["next_action"]["requeue"]) == (0, True)
    assert s["next_action"]["exclude_nodes"] == [socket.gethostname()]
    assert one(events(run_dir), "fault_injected")["code"] == 16


def test_rank_exit_17_without_diagnosis_stops(run_dir: Path, worker: str):
    proc = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", *FAST_STOP,
                        "--max-restarts", "3",
                        "--ft-simulated-fault", "rank_exit:code=17,base_delay=0.5,rank=0",
                        worker, "30", timeout=60)
    assert proc.returncode == 17, proc.stdout[-3000:]
    evs = events(run_dir)
    injected = one(evs, "fault_injected")
    assert (injected["rank"], injected["code"]) == (0, 17)
    assert one(evs, "worker_exited", cycle=0, rank=0)["exit_code"] == 17
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["diagnoses"]) == (17, 0, [])
    assert s["next_action"] == {**s["next_action"], "requeue": False, "exclude_nodes": []}
    assert "without a diagnosis" in s["reason"]


# -- a script that never talks to ft_agent -----------------------------------------------

PLAIN = str(SCRIPTS / "plain_loop.py")


def test_a_plain_script_is_hit_base_delay_after_its_spawn_and_restarts(run_dir: Path):
    proc = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", *FAST_STOP,
                        "--max-restarts", "1",
                        "--ft-simulated-fault", "rank_killed:base_delay=3,rank=1",
                        PLAIN, "60", "1", timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:]
    evs = events(run_dir)
    started = one(evs, "workers_started", cycle=0)
    injected = one(evs, "fault_injected")
    assert (injected["cycle"], injected["rank"], injected["counted_from"]) == (0, 1, "spawn")
    # Counted from the spawn (just before workers_started), imports included; generous
    # above for a busy machine, where a pass of the watch loop may come late.
    assert 3.0 - 0.5 <= injected["ts"] - started["ts"] <= 3.0 + 10, (started, injected)
    assert injected["at"] <= started["ts"] + 3.0
    died = one(evs, "worker_exited", cycle=0, rank=1)
    assert died["signal"] == "SIGKILL" and not died["stopped_by_launcher"]
    assert one(evs, "restart")["ts"] > died["ts"]
    assert not named(evs, "training_started") and not named(evs, "fault_not_fired")
    s = summary(run_dir)
    assert (s["exit_code"], s["restarts"], s["cycles"]) == (0, 1, 2)


def test_a_job_that_ends_before_its_fault_fired_says_so(run_dir: Path):
    proc = run_launcher(run_dir, *NO_PRELOADS, "--nproc-per-node", "2", *FAST_STOP,
                        "--max-restarts", "1",
                        "--ft-simulated-fault", "rank_killed:base_delay=60,rank=0",
                        PLAIN, "2", timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:]
    evs = events(run_dir)
    assert not named(evs, "fault_injected")
    missed = one(evs, "fault_not_fired")
    assert missed == {**missed, "cycle": 0, "fault_type": "rank_killed", "rank": 0,
                      "delay": 60.0, "counted_from": "spawn"}
    assert 2.0 <= missed["cycle_s"] < 60.0
    warnings = [line for line in proc.stdout.splitlines() if "never fired" in line]
    assert len(warnings) == 1, proc.stdout[-3000:]  # a warning: see the test above
    assert "rank_killed for rank 0" in warnings[0] and "due 60 s after spawn" in warnings[0]
    waited = missed["waited_s"]
    assert 2.0 <= waited <= missed["cycle_s"] and f"it waited {waited:g} s" in warnings[0]
    assert summary(run_dir)["exit_code"] == 0
    report = subprocess.run([str(Path(sys.executable).parent / "ft_report"), str(run_dir)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    line = next(x for x in report.stdout.splitlines() if x.strip().startswith("cycle 0:"))
    assert "simulated rank_killed for rank 0 NOT FIRED: due 60 s after spawn" in line
