"""Fixtures shared by every test folder."""

from __future__ import annotations

import compileall
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from launch_helpers import processes_of
from xdist.scheduler import LoadScopeScheduling

ROOT = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project to bytecode once (the controller only, before the xdist workers
    start): the hundreds of launchers and workers the tests start import it from source, and
    with PYTHONDONTWRITEBYTECODE set (as on many CI images) each would compile it again."""
    if not hasattr(session.config, "workerinput"):
        for package in ("ft_launcher", "ft_agent", "rerun"):
            compileall.compile_dir(ROOT / package, quiet=1)


# -- what a test run inherits from the shell that started it ---------------------------------
# Every test starts from the same signal dispositions and mask, umask and environment
# variables, not from whatever the caller's shell passed on (`nohup` ignores SIGHUP, a
# background job SIGINT and SIGQUIT; a user's shell may export OMP_NUM_THREADS,
# CUDA_VISIBLE_DEVICES or FT_*, or set a umask of 000).
# Signals this run ignores by inheritance, as handled by Python itself or not ours to change.
_KEEP_IGNORED = {signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD}
# Variables the launcher, its workers or ft_agent read from their environment.
CALLER_ENV_PREFIXES = ("FT_", "TORCHELASTIC_", "SLURM_", "TORCH_NCCL_", "NCCL_")
CALLER_ENV_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                    "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"}
GPU_MACHINE_ENV = ("CUDA_VISIBLE_DEVICES", "NCCL_", "TORCH_NCCL_")


def _inherited_ignored() -> list[int]:
    return [int(s) for s in signal.valid_signals()
            if s not in _KEEP_IGNORED and signal.getsignal(s) == signal.SIG_IGN]


def _no_op(signum, frame) -> None:
    """Stands in for an inherited SIG_IGN: the run still shrugs the signal off, and what it
    starts begins at the default (a handler, unlike SIG_IGN, does not survive exec)."""


def _own_process_state(ignored: list[int]) -> None:
    for signum in ignored:
        signal.signal(signum, _no_op)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # Directories the tests and launchers make are 0755: under a umask of 000 the launcher
    # refuses a run dir whose parent it made itself (world-writable, no sticky bit).
    os.umask(0o022)


_IGNORED_AT_START = _inherited_ignored()


def pytest_configure(config: pytest.Config) -> None:
    # xdist workers are started with the controller's handlers reset to the default, so
    # they are told what the controller was started ignoring (a SIGHUP would end them).
    workerinput = getattr(config, "workerinput", None)
    ignored = workerinput.get("ft_ignored_signals", []) if workerinput else _IGNORED_AT_START
    _own_process_state(ignored)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput["ft_ignored_signals"] = _IGNORED_AT_START


@pytest.fixture(autouse=True)
def caller_environment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Unsets, for each test, what the caller's shell may have exported that the project
    reads. GPU tests keep CUDA_VISIBLE_DEVICES and NCCL's settings: the machine's own."""
    gpu = request.node.path.parent.name == "gpu"
    for name in list(os.environ):
        if gpu and name.startswith(GPU_MACHINE_ENV):
            continue
        if name in CALLER_ENV_NAMES or name.startswith(CALLER_ENV_PREFIXES):
            monkeypatch.delenv(name)


@pytest.fixture
def run_dir(tmp_path: Path):
    """A run directory; at teardown, asserts no process of this run is left (and kills any)."""
    path = tmp_path / "run"
    yield path
    deadline = time.monotonic() + 5
    left = processes_of(path)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes_of(path)
    for p in left:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {[(p.pid, p.info['cmdline']) for p in left]}"


# The slow tier: every case of these modules starts a Slurm cluster, several launchers, a
# browser, a long real training or a flood; and the heaviest single cases elsewhere.
# `pytest -m "not slow"` is the fast tier: the unit tests (rules on fake clocks, parsers,
# the policy) and one end-to-end proof per mechanism. CI runs both tiers.
SLOW_MODULES = {
    "test_ft_sbatch.py", "test_bench_smoke.py", "test_rerun_e2e.py", "test_warm_restart.py",
    "test_hostile.py", "test_rerun_multiprocess.py", "test_megatron_loop.py",
    "test_lightning.py", "test_rundir.py", "test_nccl_trace_launcher.py", "test_nodes.py",
    "test_etcd.py", "test_wiring.py", "test_rerun_bench_smoke.py", "test_nvrx_compat.py",
    "test_frozen.py", "test_straggler_nodes.py",
}
SLOW_TESTS = {
    "test_twenty_crash_restarts_in_a_row", "test_rank_killed_is_recovered_from_the_checkpoint",
    "test_rank_hung_is_detected_and_recovered", "test_random_fault_is_seeded_and_recovered",
    "test_rank_exit_16_rotates_devices_then_requeues_elsewhere",
    "test_calculated_timeouts_survive_a_restart_and_a_new_job",
    "test_python_sleep_hang_stack_names_the_function", "test_no_false_verdict_in_a_long_clean_run",
    "test_ft_report_shows_intervals_and_cycles",
}
# The fast tier's end-to-end proof of a mechanism whose other cases are slow: warm restart
# (a zygote forks the standbys and refills them after each restart) and the record's disk
# reserve. Several nodes, the guardian, health checks and metrics have theirs in fast modules.
FAST_TESTS = {
    "test_zygote_forks_standbys_fast_and_refills_them_after_each_restart",
    "test_a_run_dir_disk_filled_by_a_rank_keeps_room_for_the_record",
}


# The suite runs on two pytest-xdist workers (`-n 2` in pyproject.toml): most end-to-end
# cases wait on timeouts rather than compute. Tests that share something costly or global
# stay on one worker: a module-scoped fixture's module, and every Slurm case (one cluster per
# session, on fixed ports). The scheduler below does the grouping itself: xdist's own
# `xdist_group` marks work by renaming each test's node id, which pytest 9 no longer lets a
# plugin do, so with them every group was silently spread over both workers.
SHARED_FIXTURE_MODULES = {"test_bench_smoke.py", "test_megatron_loop.py", "test_gpu_launcher.py"}


def worker_group(path: Path) -> str | None:
    """The group whose tests must all run on one worker, or None for a test of its own."""
    if path.parent.name == "slurm":
        return "slurm"
    if path.name in SHARED_FIXTURE_MODULES:
        return path.name
    return None


class GroupScheduling(LoadScopeScheduling):
    """xdist's load scheduling, except that each group goes whole to one worker."""

    def _split_scope(self, nodeid: str) -> str:
        return worker_group(Path(nodeid.split("::", 1)[0])) or nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> GroupScheduling | None:
    """Group the default `--dist load`; any other mode asked for on the command line stands."""
    return GroupScheduling(config, log) if config.getvalue("dist") == "load" else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        slow = item.path.name in SLOW_MODULES and item.originalname not in FAST_TESTS
        if slow or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
