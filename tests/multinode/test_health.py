"""Node health checks with real commands, a real directory and (as root) a real full tmpfs.

A GPU cannot exist here: its checks run against a stand-in ``nvidia-smi`` script and a
stand-in ``/proc/driver/nvidia/gpus`` directory, which is all the check reads.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ft_launcher.nodes.health import OUTPUT_LIMIT, check_gpus, count_gpus, run_health_checks


@pytest.fixture
def no_gpu(tmp_path: Path) -> Path:
    empty = tmp_path / "no_gpus"
    empty.mkdir()
    return empty


def _run(tmp_path: Path, no_gpu: Path, commands: list[str], timeout: float = 10,
         min_free: int = 0):
    return run_health_checks(commands, timeout, tmp_path / "run", min_free, gpu_proc=no_gpu)


def test_a_healthy_node_passes_every_check(tmp_path, no_gpu):
    res = _run(tmp_path, no_gpu, ["true", "test -d \"$FT_RUN_DIR\""], min_free=1 << 20)
    assert res.ok, res.checks
    assert [c.check for c in res.checks] == ["run_dir", "gpu", "true",
                                             "test -d \"$FT_RUN_DIR\""]
    gpu = res.checks[1]
    assert gpu.skipped and gpu.ok  # no GPU: skipped, not failed
    assert not list((tmp_path / "run").iterdir())  # the probe file is gone


def test_a_failing_command_is_reported_with_its_exit_code_and_output(tmp_path, no_gpu):
    res = _run(tmp_path, no_gpu, ["true", "false", "echo disk is sad; exit 3"])
    assert not res.ok
    assert [(f.check, f.exit_code) for f in res.failures] == \
        [("false", 1), ("echo disk is sad; exit 3", 3)]
    fields = res.failures[1].event_fields()
    assert fields["check"] == "echo disk is sad; exit 3"
    assert fields["exit_code"] == 3 and "disk is sad" in fields["output"]
    assert res.summary().startswith("health check failed: false (exit 1)")


def test_a_hung_check_is_killed_at_its_timeout_with_everything_it_started(tmp_path, no_gpu):
    start = time.monotonic()
    res = _run(tmp_path, no_gpu, ["sleep 30 & echo $!; wait"], timeout=0.5)
    took = time.monotonic() - start
    failed = res.failures[0]
    assert failed.exit_code is None and "timed out after 0.5 s" in failed.output
    assert took < 5, took
    child = int(failed.output.split()[0])
    time.sleep(0.2)
    assert not psutil.pid_exists(child) or \
        psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_plain_sleep_past_the_timeout_fails(tmp_path, no_gpu):
    res = _run(tmp_path, no_gpu, ["sleep 5"], timeout=0.5)
    assert [f.exit_code for f in res.failures] == [None]
    assert res.failures[0].duration_s < 3


def test_a_chatty_check_keeps_only_the_tail_of_its_output(tmp_path, no_gpu):
    res = _run(tmp_path, no_gpu, ["yes flood | head -c 5000000; echo the-end; exit 2"])
    out = res.failures[0].output
    assert len(out.encode()) <= OUTPUT_LIMIT and out.rstrip().endswith("the-end")


def test_a_run_dir_that_cannot_be_written_fails(tmp_path, no_gpu):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = run_health_checks([], 5, blocker / "run", 0, gpu_proc=no_gpu)
    assert [f.check for f in res.failures] == ["run_dir"]
    assert "not writable" in res.failures[0].output


def test_too_little_free_space_fails_naming_the_option(tmp_path, no_gpu):
    res = _run(tmp_path, no_gpu, [], min_free=1 << 60)
    assert [f.check for f in res.failures] == ["run_dir"]
    assert "--ft-min-free-space" in res.failures[0].output


def test_a_full_tmpfs_fails_the_run_dir_check(tmp_path, no_gpu):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        with open(mnt / "fill", "wb") as f:  # fill it to the last block
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        res_full = run_health_checks([], 5, mnt, 0, gpu_proc=no_gpu)
        assert [f.check for f in res_full.failures] == ["run_dir"], res_full.checks
        assert "No space left" in res_full.failures[0].output
        (mnt / "fill").unlink()
        assert run_health_checks([], 5, mnt, 512 << 10, gpu_proc=no_gpu).ok
        assert not run_health_checks([], 5, mnt, 2 << 20, gpu_proc=no_gpu).ok  # 1 MiB disk
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# -- GPUs, through a stand-in nvidia-smi (no GPU exists on this machine) ------------------


def _fake_smi(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/smi_args\n{body}\n")
    path.chmod(0o755)
    return str(path)


def _gpus(tmp_path: Path, n: int) -> Path:
    proc = tmp_path / "gpus"
    proc.mkdir()
    for i in range(n):
        (proc / f"0000:0{i}:00.0").mkdir()
    return proc


ROWS = 'echo "0, GPU-aaa, H100, 40, 1"; echo "1, GPU-bbb, H100, 41, 1"'


def test_every_visible_gpu_answering_passes(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    res = check_gpus(5, _fake_smi(tmp_path, ROWS), _gpus(tmp_path, 2))
    assert res.ok and not res.skipped, res
    assert "--query-gpu=" in (tmp_path / "smi_args").read_text()


def test_a_gpu_that_does_not_answer_fails(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    res = check_gpus(5, _fake_smi(tmp_path, 'echo "0, GPU-aaa, H100, 40, 1"'),
                     _gpus(tmp_path, 2))
    assert not res.ok and "1 of 2 GPUs answered" in res.output


def test_gpu_errors_and_a_hung_driver_fail(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    proc = _gpus(tmp_path, 2)
    res = check_gpus(5, _fake_smi(tmp_path, 'echo "1, GPU-bbb, H100, [Unknown Error], ERR!"'),
                     proc)
    assert not res.ok and "with errors" in res.output
    assert "-i 1" in (tmp_path / "smi_args").read_text()  # only the GPUs this node uses
    res = check_gpus(0.5, _fake_smi(tmp_path, "sleep 30"), proc)
    assert not res.ok and res.exit_code is None
    res = check_gpus(5, _fake_smi(tmp_path, "echo 'No devices were found'; exit 6"), proc)
    assert not res.ok and res.exit_code == 6


# -- options -----------------------------------------------------------------------------


def _ft(args: list[str], tmp_path: Path):
    from ft_launcher.cli import build_launch_config, cli

    script = Path(__file__).with_name("node_worker.py")
    ctx = cli.make_context("ft_launcher", [*args, str(script)])
    ctx.params.pop("verbose", None)
    return build_launch_config(ctx.params).ft


def test_health_check_options(tmp_path):
    ft = _ft(["--ft-health-check", "true", "--ft-health-check", "test -w /tmp",
              "--ft-health-check-timeout", "2.5", "--ft-min-free-space", "500MB"], tmp_path)
    assert ft.health_checks == ["true", "test -w /tmp"]
    assert ft.health_check_timeout == 2.5 and ft.min_free_space == 500 * 2**20
    ft = _ft([], tmp_path)
    assert (ft.health_checks, ft.health_check_timeout, ft.min_free_space) == \
        ([], 30.0, 100 * 2**20)
    assert _ft(["--ft-min-free-space", "4096"], tmp_path).min_free_space == 4096


@pytest.mark.parametrize("args, needle", [
    (["--ft-health-check-timeout", "0"], "--ft-health-check-timeout"),
    (["--ft-health-check-timeout", "nan"], "--ft-health-check-timeout"),
    (["--ft-min-free-space", "lots"], "--ft-min-free-space"),
    (["--ft-min-free-space", "-5MB"], "--ft-min-free-space"),
    (["--ft-health-check", " "], "--ft-health-check"),
])
def test_bad_health_check_options_name_the_option(args, needle, tmp_path):
    from ft_launcher.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        _ft(args, tmp_path)


def test_count_gpus_reads_the_listed_devices_then_the_driver_then_the_device_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    proc.mkdir()
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert count_gpus(proc, dev) == 2  # /proc hidden (empty): the device files count
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (proc / bus).mkdir()
    assert count_gpus(proc, dev) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1,2")  # CUDA stops at the invalid entry
    assert count_gpus(proc, dev) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert count_gpus(proc, dev) == 0
