"""ft_launcher's CUDA paths on a real GPU, end to end (scripts/gpu_check.sh runs these).

Real launchers start real CUDA workers (tests/gpu/cuda_job.py, tests/gpu/rerun_cuda_job.py,
examples/train_ddp.py). What the tests assert is observed from outside the code under test:
GPU UUIDs and CUDA contexts from NVML (or nvidia-smi), the launcher's events and summary,
the workers' own logs. Skipped, with a reason starting "no CUDA device", where torch sees no
GPU. Each module-scoped job runs once and is checked by several tests, one per property, so
a failure says which property broke.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gpu_support import (
    cuda_device_count,
    gpu_context_pids,
    gpu_device_files,
    gpu_uuids,
    require_cuda,
)
from launch_helpers import (
    EXAMPLES,
    ROOT,
    events,
    launcher_cmd,
    named,
    processes_of,
    run_launcher,
    summary,
    wait_for,
)

from ft_launcher.hang import nccl_trace

require_cuda()

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
CUDA_JOB = str(HERE / "cuda_job.py")
RERUN_JOB = str(HERE / "rerun_cuda_job.py")
STEP_LINE = re.compile(r"^CUDA_STEP cycle=(\d+) step=(\d+) t=(\S+) pid=(\d+)$", re.M)
HANG_TIMEOUT_S = 15.0


# -- helpers -------------------------------------------------------------------------------


@dataclass
class Job:
    """A launcher started in the background, with what the test observed while it ran."""

    run_dir: Path
    proc: subprocess.Popen
    output: str = ""
    seen: dict = field(default_factory=dict)

    def log(self, cycle: int, rank: int = 0) -> str:
        path = self.run_dir / "logs" / f"cycle_{cycle}" / f"rank_{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def steps(self, cycle: int) -> list[tuple[int, float, int]]:
        """(step, time.time() after the step, pid) of each CUDA step of the cycle."""
        return [(int(s), float(t), int(p)) for c, s, t, p in STEP_LINE.findall(self.log(cycle))
                if int(c) == cycle]

    def finish(self, timeout: float) -> int:
        try:
            self.output, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"ft_launcher still running after {timeout} s:\n{self.output[-3000:]}")
        return self.proc.returncode

    def stop(self) -> None:
        """Kill the launcher and anything of this run still alive (a test that failed)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.output, _ = self.proc.communicate()
        for p in processes_of(self.run_dir):
            try:
                p.kill()
            except Exception:  # already gone
                pass


def start(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> Job:
    proc = subprocess.Popen(launcher_cmd(run_dir, *args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    return Job(run_dir, proc)


def no_leftovers(run_dir: Path) -> None:
    wait_for(lambda: not processes_of(run_dir), 10, "every process of the run to end")


def record(record_property, name: str, value) -> None:
    """A figure for the junit report (scripts/gpu_check.sh prints it) and the console."""
    record_property(name, value)
    print(f"{name} = {value}")


# -- 2. exit 16 -> rotated CUDA_VISIBLE_DEVICES -> the re-run lands where the policy said ----


@pytest.fixture(scope="module")
def exit16_job(tmp_path_factory):
    """rerun_cuda_job.py under the launcher: step 3 is NaN on the first GPU it runs on."""
    run_dir = tmp_path_factory.mktemp("exit16") / "run"
    res = run_launcher(run_dir, "--nproc-per-node", "1", "--max-restarts", "2",
                       RERUN_JOB, "--steps", "5", "--at", "3", timeout=240)
    no_leftovers(run_dir)
    lines = [json.loads(x) for x in (run_dir / "rerun_cuda.jsonl").read_text().splitlines()]
    return run_dir, res, lines


def test_launcher_gives_each_rank_its_gpu(exit16_job):
    run_dir, _res, lines = exit16_job
    first = lines[0]
    assert first["cuda_visible_devices"] is not None, (
        "the launcher set no CUDA_VISIBLE_DEVICES: it did not see the GPUs "
        f"(/proc/driver/nvidia/gpus exists: {os.path.isdir('/proc/driver/nvidia/gpus')}, "
        f"CUDA_VISIBLE_DEVICES here: {os.environ.get('CUDA_VISIBLE_DEVICES')})")
    assert first["ft_device_id"] == "0"
    assert first["uuid"] == first["visible"][0], "cuda:0 is the rank's device"


def test_exit_16_lands_on_the_device_the_policy_chose(exit16_job):
    run_dir, res, lines = exit16_job
    first = lines[0]
    uuids = gpu_uuids()
    assert first["uuid"] in uuids, f"identity {first['uuid']} is not a GPU of {uuids}"
    s = summary(run_dir)
    asked = [d for d in s["diagnoses"] if d.get("exit_code") == 16]
    assert asked, f"no diagnosis announced the exit 16: {s['diagnoses']}"
    assert asked[0]["device"] == first["uuid"] and asked[0]["suspicious_device"] == first["uuid"]
    if cuda_device_count() == 1:
        # One GPU: no untried rotation is left, so the launcher stops with 16 and asks the
        # scheduler to requeue elsewhere (README, "Exit codes and the policy").
        assert res.returncode == 16, f"launcher exit {res.returncode}:\n{res.stdout[-3000:]}"
        assert s["cycles"] == 1 and s["restarts"] == 0
        assert s["next_action"]["requeue"] is True
        assert s["next_action"]["exclude_nodes"] == [s["host"]]
        assert "no other device" in s["reason"]
        return
    # Several GPUs: the restart rotates devices and the re-run runs on the chosen GPU.
    restart = named(events(run_dir), "restart")[0]
    chosen = first["visible"][restart["device_map"][0]]
    second = lines[1]
    assert second["uuid"] == chosen != first["uuid"], (first, second, restart)
    verdicts = [d for d in s["diagnoses"] if d.get("diagnostic")]
    assert verdicts and verdicts[0]["diagnostic"] == "PERSISTENT_ERROR", s["diagnoses"]
    assert verdicts[0]["suspicious_device"] == first["uuid"]
    assert verdicts[0]["device"] == second["uuid"]
    # A spare GPU exists (nproc 1): the policy restarts without the suspicious device.
    decisions = named(events(run_dir), "decision")
    assert decisions[1]["restart"] is True and "excluding" in decisions[1]["reason"], decisions


# -- 3. warm restart: standbys hold no CUDA context; kill -> first CUDA step, cold and warm ---


def _kill_and_recover(tmp_path_factory, warm: bool) -> Job:
    run_dir = tmp_path_factory.mktemp("warm" if warm else "cold") / "run"
    # Warm: the defaults (warm restart, preloads torch and torch._dynamo); cold: turned off.
    flags = [] if warm else ["--no-ft-warm-restart"]
    baseline = gpu_context_pids()  # contexts that exist before this job (this pytest's own)
    # The first cycle's worker is a fork of the zygote too (CUDA first initialised after
    # the fork), whatever OMP_NUM_THREADS; set here as before, so both runs compare.
    job = start(run_dir, "--nproc-per-node", "1", "--max-restarts", "1", *flags, CUDA_JOB,
                "--nccl", "--steps", "100000", "--steps-after-restart", "3",
                "--step-time", "0.05", env={"OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: job.steps(0), 180, "the first CUDA step of cycle 0")
        worker = named(events(run_dir), "workers_started")[0]["pids"][0]
        if warm:
            ready = wait_for(lambda: [e for e in named(events(run_dir), "standby_ready")
                                      if e["pid"] != worker], 180,
                             "a spare standby (torch and torch._dynamo imported)")
            standby = ready[0]["pid"]
            job.seen.update(baseline=baseline, worker=worker, standby=standby,
                            contexts=gpu_context_pids(), worker_files=gpu_device_files(worker),
                            standby_files=gpu_device_files(standby))
        else:
            time.sleep(2)  # a few steps, as in the warm run
        job.seen["killed_at"] = time.time()
        os.kill(worker, signal.SIGKILL)
        job.seen["rc"] = job.finish(180)
    finally:
        job.stop()
    no_leftovers(run_dir)
    return job


@pytest.fixture(scope="module")
def warm_job(tmp_path_factory):
    return _kill_and_recover(tmp_path_factory, warm=True)


@pytest.fixture(scope="module")
def cold_job(tmp_path_factory):
    return _kill_and_recover(tmp_path_factory, warm=False)


def test_warm_standby_holds_no_cuda_context(warm_job, record_property):
    """Observed two ways, each with the worker as positive control: NVML's process list and
    the /dev/nvidia* files each process holds open. At least one must be able to see the
    worker's context, and neither may see one in the standby."""
    seen = warm_job.seen
    contexts, worker, standby = seen["contexts"], seen["worker"], seen["standby"]
    new = contexts - seen["baseline"]
    record(record_property, "nvml_context_pids", sorted(contexts))
    methods = []
    if worker in contexts:
        # NVML shows this pid namespace's pids: the worker is there, the standby is not.
        assert standby not in contexts, f"standby {standby} holds a CUDA context: {contexts}"
        methods.append("NVML process list by pid")
    elif new:
        # NVML reports the host's pids (a container): count contexts instead. The job added
        # exactly one, the worker's; a standby with a context would add a second.
        assert len(new) == 1, f"{len(new)} new CUDA contexts for 1 worker + 1 standby: {new}"
        methods.append("NVML process list by count (host pids)")
    if seen["worker_files"]:
        assert seen["standby_files"] == [], f"the standby holds {seen['standby_files']}"
        methods.append("/dev/nvidia* files held open")
    record(record_property, "standby_checked_by", "; ".join(methods) or "nothing")
    assert methods, (f"cannot see the worker's own CUDA context here (NVML pids "
                     f"{sorted(contexts)}, worker {worker} holds no /dev/nvidia* file): "
                     "the standby could not be checked")


def _recovery(job: Job, record_property, name: str) -> float:
    assert job.seen["rc"] == 0, f"launcher exit {job.seen['rc']}:\n{job.output[-3000:]}"
    steps = job.steps(1)
    assert steps, f"cycle 1 made no CUDA step:\n{job.log(1)[-2000:]}"
    took = steps[0][1] - job.seen["killed_at"]
    record(record_property, name, round(took, 3))
    return took


def test_warm_restart_reaches_its_first_cuda_step(warm_job, record_property):
    evs = events(warm_job.run_dir)
    started = named(evs, "workers_started")
    # Both cycles' workers are forks of the zygote, unless it found forking unsafe here (a
    # CUDA driver mapped by the preloads): then the first starts cold, the second from a
    # spawned standby.
    fallback = named(evs, "zygote_fallback")
    record(record_property, "zygote_fallback", fallback[0]["reason"] if fallback else "none")
    assert [e["warm"] for e in started] == [[not fallback], [True]], started
    assert _recovery(warm_job, record_property, "warm_kill_to_first_cuda_step_s") < 60


def test_cold_restart_reaches_its_first_cuda_step(cold_job, record_property):
    started = named(events(cold_job.run_dir), "workers_started")
    assert [e["warm"] for e in started] == [[False], [False]], started
    assert _recovery(cold_job, record_property, "cold_kill_to_first_cuda_step_s") < 90


# -- 4. a rank hung inside a CUDA kernel ----------------------------------------------------


@pytest.fixture(scope="module")
def hang_job(tmp_path_factory):
    """One NCCL rank spins in a CUDA kernel at step 5 of cycle 0, with the flight recorder on.

    While it hangs (before the launcher's verdict) the test itself asks for the flight
    recorder's dump and collects it with ft_launcher.hang.nccl_trace, to prove torch writes where
    that module looks; the launcher's own collection is checked separately.
    """
    run_dir = tmp_path_factory.mktemp("hang") / "run"
    (run_dir / "ipc").mkdir(parents=True, mode=0o700)
    nccl_trace.trace_dir(run_dir / "ipc")
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}  # all a user sets
    env = {**user, **nccl_trace.worker_env(user, run_dir / "ipc")}  # what the launcher adds
    job = start(run_dir, "--nproc-per-node", "1", "--max-restarts", "1",
                "--ft-initial-rank-heartbeat-timeout", "180",
                "--ft-rank-heartbeat-timeout", str(HANG_TIMEOUT_S),
                CUDA_JOB, "--nccl", "--steps", "20", "--steps-after-restart", "3",
                "--step-time", "0.05", "--hang-in-kernel-at", "5", env=env)
    try:
        wait_for(lambda: "HANG_IN_KERNEL" in job.log(0), 180, "the rank to enter the kernel")
        settings = nccl_trace.trace_settings(env)
        (run_dir.parent / "probe").mkdir()  # as the launcher's stacks/ exists before a hang
        asked_at = time.time()
        job.seen["asked"] = nccl_trace.request_dumps(settings, [0])
        job.seen["probe"] = nccl_trace.collect_traces(
            run_dir.parent / "probe", 0, settings.dump_prefix, [0], since=asked_at, wait_s=8)
        job.seen["probe_s"] = time.time() - asked_at
        job.seen["rc"] = job.finish(180)
    finally:
        job.stop()
    no_leftovers(run_dir)
    return job


def test_kernel_hang_is_detected_at_its_timeout_and_the_job_restarts(hang_job):
    evs = events(hang_job.run_dir)
    (hang,) = named(evs, "hang_detected")
    assert hang["rank"] == 0 and hang["cycle"] == 0 and hang["timeout_kind"] == "heartbeat"
    assert HANG_TIMEOUT_S <= hang["expired_silence_s"] < HANG_TIMEOUT_S + 5, hang
    killed = named(evs, "rank_killed")
    assert killed and killed[0]["reason"] == "hang"
    assert hang_job.seen["rc"] == 0, (
        f"launcher exit {hang_job.seen['rc']}:\n{hang_job.output[-3000:]}")
    assert len(hang_job.steps(1)) == 3, "the restarted cycle trains on the GPU"


def test_kernel_hang_python_stack_is_dumped(hang_job):
    path = hang_job.run_dir / "stacks" / "cycle_0_rank_0.txt"
    assert path.exists(), sorted(p.name for p in (hang_job.run_dir / "stacks").iterdir())
    text = path.read_text()
    assert "hang_in_kernel" in text and "synchronize" in text, text[-2000:]


def _is_flight_recorder_dump(data: bytes) -> bool:
    # torch's dump is a pickled dict with "version", "pg_config" and "entries"; read as
    # bytes only (never unpickled here).
    return data[:1] == b"\x80" and b"entries" in data and b"pg_config" in data


def test_torch_writes_the_flight_recorder_where_nccl_trace_collects_it(hang_job,
                                                                       record_property):
    seen = hang_job.seen
    record(record_property, "flight_recorder_probe_s", round(seen["probe_s"], 3))
    assert seen["asked"] == [0], "no NCCL dump pipe to write into (TORCH_NCCL_DEBUG_INFO_PIPE_FILE)"
    probe = seen["probe"]
    assert 0 in probe.collected, f"no dump collected: {probe.missing}"
    data = probe.collected[0].read_bytes()
    record(record_property, "flight_recorder_bytes", len(data))
    assert _is_flight_recorder_dump(data), data[:200]
    assert b"all_reduce" in data or b"allreduce" in data, "DDP's all-reduces are recorded"


def test_flight_recorder_dump_reads_with_torchfrtrace(hang_job, tmp_path):
    probe = hang_job.seen["probe"]
    assert 0 in probe.collected, f"no dump collected: {probe.missing}"
    # torchfrtrace wants <prefix><rank> files in one folder (the README shows the same).
    folder = tmp_path / "fr"
    folder.mkdir()
    (folder / "rank_0").write_bytes(probe.collected[0].read_bytes())
    res = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                          str(folder), "--prefix", "rank_", "-j"],
                         capture_output=True, text=True, timeout=120)
    said = res.stdout + res.stderr  # its report goes to stderr (logging) in newer torch
    assert res.returncode == 0, said[-4000:]
    assert "all_reduce" in said or "allreduce" in said, said[-4000:]


def test_launcher_collects_the_nccl_trace_next_to_the_python_stacks(hang_job):
    path = hang_job.run_dir / "stacks" / "cycle_0_rank_0.nccl_trace"
    assert path.exists(), (
        "no flight-recorder dump in stacks/: the supervisor does not call "
        "ft_launcher.hang.nccl_trace (request_dumps / collect_traces) on a hang yet; found "
        f"{sorted(p.name for p in (hang_job.run_dir / 'stacks').iterdir())}")
    assert _is_flight_recorder_dump(path.read_bytes())


# -- 5. examples/train_ddp.py on NCCL with a simulated kill ---------------------------------


def test_train_ddp_on_nccl_resumes_from_its_cuda_snapshot_after_a_kill(run_dir):
    """The model and optimizer live on the GPU: each step's snapshot goes through pinned host
    memory, and the restarted rank loads it back onto the GPU at the step it was killed at
    (no disk checkpoint before the end)."""
    res = run_launcher(run_dir, "--nproc-per-node", "1", "--max-restarts", "2",
                       "--ft-snapshot-every", "1",
                       "--ft-simulated-fault", "rank_killed:base_delay=20,rank=0",
                       str(EXAMPLES / "train_ddp.py"), "--device", "cuda", "--steps", "900",
                       "--ckpt-every", "100000", "--step-time", "0.02", timeout=240)
    assert res.returncode == 0, f"launcher exit {res.returncode}:\n{res.stdout[-3000:]}"
    log0 = (run_dir / "logs" / "cycle_0" / "rank_0.log").read_text()
    log1 = (run_dir / "logs" / "cycle_1" / "rank_0.log").read_text()
    assert "backend nccl" in log0 and "device cuda" in log0, log0[:2000]
    evs = events(run_dir)
    faults = named(evs, "fault_injected")
    assert faults and faults[0]["fault_type"] == "rank_killed"
    last = max(e["iteration"] for e in named(evs, "last_progress") if e["cycle"] == 0)
    resumed = re.search(r"resumed from snapshot step (\d+)", log1)
    assert resumed and last - 1 <= int(resumed.group(1)) <= last + 1, (last, log1[:2000])
    (restored,) = [e for e in named(evs, "snapshot_restored") if e["cycle"] == 1]
    assert restored["source"] == "local" and restored["iteration"] == int(resumed.group(1))
    assert (run_dir / "ckpt" / "result.json").exists()
    assert summary(run_dir)["restarts"] == 1
