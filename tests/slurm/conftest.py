"""A real Slurm 22.05 cluster (three slurmd: node1 to node3) for the tests of scripts/slurm.

The session fixture ``slurm_cluster`` runs ``scripts/slurm/slurm-up.sh`` (installs Debian's
slurmctld, slurmd, slurm-client and munge when missing, starts the daemons without
systemd) and stops it with ``slurm-down.sh`` at the end if it started it. Without root or
without the packages the Slurm tests are skipped, except when the CI variable is set:
there they must run, so they fail instead.

This folder is a package (``__init__.py``) on purpose: a second top-level module named
``conftest`` would shadow ``tests/conftest.py`` for the tests that import from it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "scripts" / "slurm"
WRAPPER = SLURM_DIR / "ft_sbatch.sh"
TRAIN = Path(__file__).resolve().parent / "slurm_train.py"
NODES = ("node1", "node2", "node3")  # three: a 2-node job can have a spare, or lose a node
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker here rather than in pyproject.toml (this folder owns it)."""
    config.addinivalue_line("markers", "slurm: needs the real local Slurm cluster "
                            "(root; started by scripts/slurm/slurm-up.sh)")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"{reason} (CI is set, so the Slurm tests must run)", pytrace=False)
    pytest.skip(reason)


def _packages_installed() -> bool:
    for pkg in PACKAGES:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True,
                             text=True, timeout=30)
        if "install ok installed" not in out.stdout:
            return False
    return True


def _cluster_up() -> bool:
    """slurmctld answers and every test node exists."""
    if shutil.which("scontrol") is None:
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True,
                               text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "is UP" in ping.stdout and set(NODES) <= set(nodes.stdout.split())


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """Bring the 3-node cluster up once per session; take it down if this started it."""
    if os.geteuid() != 0:
        _unavailable("the Slurm tests need root (slurm-up.sh installs packages, starts daemons)")
    if shutil.which("dpkg-query") is None:
        _unavailable("the Slurm tests need a Debian system (dpkg, apt)")
    # One session owns the cluster: a second one (another xdist worker, when the grouping
    # in tests/conftest.py fails) would start the daemons twice and take them down under
    # the first one's jobs. Fail at once and say why instead.
    owner = open("/run/ft-launcher-slurm-tests.lock", "w")  # noqa: SIM115 - held to the end
    try:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner.close()
        pytest.fail("another pytest session holds the Slurm cluster: every Slurm case must "
                    "run on one xdist worker (tests/conftest.py, GroupScheduling)",
                    pytrace=False)
    was_up = _cluster_up()
    env = {**os.environ, "SLURM_UP_NODES": str(len(NODES))}
    if not was_up:
        # The jobs a cluster we start would recover belong to a session that is gone (one
        # interrupted mid-case, say): recovered, they hold the nodes a 3-node case needs.
        env["SLURM_UP_CLEAN"] = "1"
    try:
        up = subprocess.run(["bash", str(SLURM_DIR / "slurm-up.sh")], env=env,
                            capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("slurm-up.sh did not finish within 300 s", pytrace=False)
    if up.returncode != 0:
        tail = "\n".join((up.stdout + up.stderr).splitlines()[-15:])
        if not _packages_installed():
            _unavailable(f"apt could not install {' '.join(PACKAGES)}:\n{tail}")
        pytest.fail(f"slurm-up.sh failed with {up.returncode}:\n{tail}", pytrace=False)
    yield
    if not was_up:
        subprocess.run(["bash", str(SLURM_DIR / "slurm-down.sh")], capture_output=True,
                       timeout=120, check=False)
    owner.close()


# --------------------------------------------------------------------- job helpers

def job_fields(job_id: str) -> dict[str, str]:
    """``scontrol -o show job`` as a dict (one line, KEY=VALUE pairs)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                         text=True, timeout=15)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


@dataclass
class SlurmJobs:
    """Submits the wrapper for one test and remembers the jobs to clean up after it."""

    workdir: Path
    ids: list[str] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """The submit environment (sbatch exports it): venv bin on PATH, wrapper helpers."""
        venv_bin = str(Path(sys.executable).parent)
        launcher = shutil.which("ft_launcher", path=venv_bin) or "ft_launcher"
        return {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
                "FT_LAUNCHER": launcher, "FT_SLURM_DIR": str(SLURM_DIR), **extra}

    def submit(self, *args: str, sbatch: tuple[str, ...] = (), env: dict[str, str] | None
               = None, script: Path = WRAPPER) -> str:
        """sbatch the wrapper (or ``script``) with private output; returns the job id."""
        cmd = ["sbatch", "--parsable", "--open-mode=append", "-c", "1", "--chdir",
               str(self.workdir), "-o", str(self.workdir / "job-%j.out"), *sbatch,
               str(script), "--run-dir", str(self.workdir / "runs"), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                             env=env or self.env())
        assert out.returncode == 0, f"sbatch failed: {out.stderr}"
        job_id = out.stdout.strip().split(";")[0]
        self.ids.append(job_id)
        return job_id

    def output(self, job_id: str) -> str:
        path = self.workdir / f"job-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        """Poll every 0.1 s until the job is in one of ``states``; fail at the deadline."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = job_fields(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.1)
        pytest.fail(f"job {job_id} not in {sorted(states)} after {timeout} s "
                    f"(JobState={fields.get('JobState')}):\n{self.output(job_id)[-3000:]}")

    def wait_done(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait for a final state (a requeued job passes through PENDING, not a final one)."""
        return self.wait_state(job_id, TERMINAL, timeout)

    def wait_file(self, path: Path, timeout: float, job_id: str) -> None:
        self.wait_for(path.exists, timeout, job_id, f"{path} to appear")

    def wait_for(self, predicate: Callable[[], Any], timeout: float, job_id: str,
                 what: str) -> Any:
        """Poll ``predicate`` every 0.1 s until it returns something true; return that."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            time.sleep(0.1)
        pytest.fail(f"no {what} within {timeout} s:\n{self.output(job_id)[-3000:]}")

    def wait_gone(self, timeout: float) -> list[str]:
        """Wait until no process of this test is left; returns what is left at the end."""
        deadline = time.monotonic() + timeout
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = []
        for p in self.leftovers():
            try:
                left.append(f"{p.pid}: {' '.join(p.cmdline())}")
            except psutil.Error:
                continue
        return left

    def leftovers(self) -> list[psutil.Process]:
        """Live processes whose command line names this test's directory."""
        key = str(self.workdir)
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if p.info["status"] != psutil.STATUS_ZOMBIE and \
                        any(key in part for part in p.info["cmdline"] or []):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found


@pytest.fixture
def slurm_jobs(slurm_cluster: None, tmp_path: Path) -> Iterator[SlurmJobs]:
    """Per-test job helper; cancels what is still queued and checks no process is left."""
    jobs = SlurmJobs(tmp_path)
    yield jobs
    live = [j for j in jobs.ids if job_fields(j).get("JobState") not in TERMINAL]
    if live:
        subprocess.run(["scancel", *live], capture_output=True, timeout=30, check=False)
        for j in live:
            jobs.wait_state(j, TERMINAL, 30)
    left = jobs.wait_gone(10)
    assert not left, f"processes left behind: {left}"
