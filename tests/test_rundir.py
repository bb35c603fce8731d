"""The run directory: trust (owner, mode, symlinks), one launcher at a time, attempts, and
writes that never end the job (a full disk: real tmpfs mounts when root, /dev/full).

The other-user cases run with a real second user (``ft-other``, created with useradd when
missing) where the tests run as root, and are skipped with a reason otherwise."""

from __future__ import annotations

import getpass
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from launch_helpers import (
    NO_PRELOADS,
    ROOT,
    SCRIPTS,
    events,
    launcher_cmd,
    mounted_tmpfs,
    named,
)

from ft_launcher.rundir import RunDir, RunDirError, read_events

IO_CASES = str(SCRIPTS / "io_cases.py")
OTHER_USER = "ft-other"
IS_ROOT = os.geteuid() == 0


# -- helpers -----------------------------------------------------------------------------


def other_user() -> pwd.struct_passwd:
    """The second user (created when missing); skips the test when not root."""
    if not IS_ROOT:
        pytest.skip("needs root to act as a second user (useradd/runuser)")
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        pass
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: cannot create a second user")
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    OTHER_USER], check=True, capture_output=True, timeout=30)
    return pwd.getpwnam(OTHER_USER)


def as_other(*argv: str) -> None:
    """Run a command as the second user (a real uid switch, no shell)."""
    subprocess.run(["runuser", "-u", OTHER_USER, "--", *argv], check=True, timeout=30,
                   capture_output=True)


@pytest.fixture
def shared_dir():
    """A world-writable sticky directory every user can reach, like /tmp (pytest's own
    tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="ft_shared_", dir="/tmp"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs():
    """A real 1 MiB tmpfs."""
    yield from mounted_tmpfs("1m")


@pytest.fixture
def tmpfs_2m():
    """A real 2 MiB tmpfs."""
    yield from mounted_tmpfs("2m")


def fill(directory: Path) -> None:
    """Fill a file system to the last byte."""
    with open(directory / "ballast", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass


def launch(run_dir: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """The real launcher; stdout and stderr apart."""
    return subprocess.run(launcher_cmd(run_dir, *args), capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


# -- one launcher at a time, attempts ---------------------------------------------------------


def test_a_second_launcher_on_the_same_run_dir_stops_naming_the_holder(run_dir: Path):
    first = RunDir(run_dir)
    try:
        with pytest.raises(RunDirError, match=rf"in use by another launcher \(pid {os.getpid()}\)"):
            RunDir(run_dir)
        res = launch(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", IO_CASES, "exit_code", "0")
        assert res.returncode == 1
        assert f"in use by another launcher (pid {os.getpid()})" in res.stderr
        assert "Traceback" not in res.stderr
    finally:
        first.close()
    RunDir(run_dir).close()  # released with its holder


def test_a_reused_run_dir_is_a_new_attempt(run_dir: Path):
    for expected in (1, 2, 3):
        rd = RunDir(run_dir)
        assert rd.attempt == expected
        rd.event("launcher_started", 0, pid=os.getpid())
        rd.event("launcher_exited", 0, exit_code=0)
        rd.close()
    started = [e for e in read_events(run_dir) if e["event"] == "launcher_started"]
    assert [e["attempt"] for e in started] == [1, 2, 3]


def test_a_finished_run_dir_reused_by_the_launcher_records_attempt_2(run_dir: Path):
    for _ in range(2):
        res = launch(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", IO_CASES, "exit_code", "0")
        assert res.returncode == 0, res.stderr[-2000:]
    started = named(events(run_dir), "launcher_started")
    assert [e["attempt"] for e in started] == [1, 2]


# -- trust: modes, symlinks, other users ------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o757, 0o1777])
def test_a_run_dir_writable_by_others_is_refused(run_dir: Path, mode: int):
    run_dir.mkdir()
    os.chmod(run_dir, mode)
    with pytest.raises(RunDirError, match="is writable by others"):
        RunDir(run_dir)


def test_a_group_writable_run_dir_of_ours_is_made_private(run_dir: Path):
    """A umask of 002 (mkdir -p in a batch script) makes run dirs group-writable."""
    run_dir.mkdir()
    os.chmod(run_dir, 0o775)
    RunDir(run_dir).close()
    assert run_dir.stat().st_mode & 0o777 == 0o755


def test_a_parent_writable_by_all_without_sticky_bit_is_refused(tmp_path: Path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(RunDirError, match="without the sticky bit"):
        RunDir(parent / "run")
    assert not (parent / "run").exists()


def test_a_symlinked_events_file_is_never_followed(run_dir: Path, tmp_path: Path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    run_dir.mkdir()
    (run_dir / "events.jsonl").symlink_to(target)
    res = launch(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", IO_CASES, "exit_code", "0")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "events.jsonl" not in res.stderr or "run directory" in res.stderr
    assert target.read_text() == "keep me\n"


def test_a_symlinked_rank_log_is_never_followed(run_dir: Path, tmp_path: Path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (run_dir / "logs" / "cycle_0").mkdir(parents=True)
    (run_dir / "logs" / "cycle_0" / "rank_0.log").symlink_to(target)
    res = launch(run_dir, *NO_PRELOADS, "--nproc-per-node", "1", IO_CASES, "exit_code", "0")
    assert res.returncode != 0
    assert target.read_text() == "keep me\n"


def test_a_run_dir_made_by_another_user_is_refused(shared_dir: Path):
    """Issue 11, item 12: another user pre-created the run dir in a shared sticky directory,
    with their own ipc/ and events.jsonl as a symlink to a root-only file."""
    other_user()
    precious = Path(tempfile.mkdtemp(prefix="ft_root_only_")) / "secret"
    precious.write_text("root only\n")
    os.chmod(precious, 0o600)
    try:
        run = shared_dir / "run"
        as_other("mkdir", "-m", "0755", str(run))
        as_other("mkdir", "-m", "0700", str(run / "ipc"))
        as_other("ln", "-s", str(precious), str(run / "events.jsonl"))
        res = launch(run, *NO_PRELOADS, "--nproc-per-node", "1", IO_CASES, "exit_code", "0")
        assert res.returncode == 1, res.stderr[-2000:]
        assert f"is owned by {OTHER_USER}" in res.stderr and "Traceback" not in res.stderr
        assert precious.read_text() == "root only\n"
        assert not (run / "summary.json").exists()
    finally:
        shutil.rmtree(precious.parent, ignore_errors=True)


def test_an_ipc_dir_of_another_user_is_refused(run_dir: Path, shared_dir: Path):
    """Our own run dir, but the other user's ipc/ in it (made while it was open to them)."""
    user = other_user()
    run = shared_dir / "mine"
    run.mkdir(mode=0o755)
    (run / "ipc").mkdir(mode=0o700)
    os.chown(run / "ipc", user.pw_uid, user.pw_gid)
    with pytest.raises(RunDirError, match=f"ipc directory .* is owned by {OTHER_USER}"):
        RunDir(run)


def test_a_run_dir_symlink_of_another_user_is_refused(shared_dir: Path, tmp_path: Path):
    other_user()
    mine = tmp_path / "mine"
    mine.mkdir()
    as_other("ln", "-s", str(mine), str(shared_dir / "run"))
    with pytest.raises(RunDirError, match="symlink owned by"):
        RunDir(shared_dir / "run")


def test_cjk_run_dir(run_dir: Path):
    """Issue 11, item 15: a run dir whose socket path is under 100 characters but over the
    AF_UNIX limit in bytes (3 bytes per CJK character) runs normally."""
    room = 99 - len(str(run_dir / "ipc" / "monitor.sock")) - 1
    assert room >= 15, f"tmp path too long for this case: {run_dir}"
    run = run_dir / ("运" * room)
    sock = run / "ipc" / "monitor.sock"
    assert len(str(sock)) < 100 and len(os.fsencode(sock)) > 107
    res = launch(run, *NO_PRELOADS, "--nproc-per-node", "1", IO_CASES, "exit_code", "0")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 0


def test_a_long_run_dir_in_a_long_tmpdir(run_dir: Path):
    """The socket leaves a run dir too long for AF_UNIX for TMPDIR, and TMPDIR for /tmp when
    TMPDIR is that long too (the benchmark's smoke test ran into it)."""
    deep = run_dir / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(deep)}
    res = subprocess.run(launcher_cmd(deep / "run", "--nproc-per-node", "1", IO_CASES,
                                      "exit_code", "0"),
                         capture_output=True, text=True, cwd=ROOT, timeout=90, env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    # Nothing of the launcher's left in TMPDIR. The zygote's import of torch._dynamo (a
    # default preload) makes torch's own inductor cache there, as any DDP worker's does.
    left = {p.name for p in deep.iterdir()} - {f"torchinductor_{getpass.getuser()}"}
    assert left == {"run"}


# -- writes never end the job -----------------------------------------------------------------


def test_events_survive_a_full_device(run_dir: Path, caplog):
    """Writes to /dev/full fail with ENOSPC like a full disk: counted, logged once, no raise,
    and the summary records how many were lost."""
    rd = RunDir(run_dir)
    rd.event("launcher_started", 0)
    os.close(rd._events_fd)
    rd._events_fd = os.open("/dev/full", os.O_WRONLY)
    for i in range(5):
        assert rd.event("worker_exited", 0, rank=i)["rank"] == i
    assert rd.events_dropped == 5
    assert sum("cannot write events" in r.message for r in caplog.records) == 1
    assert rd.write_summary({"exit_code": 0})
    assert json.loads((run_dir / "summary.json").read_text())["events_dropped"] == 5
    rd.close()


def test_event_fields_cannot_forge_the_record_and_nan_stays_valid_json(run_dir: Path):
    rd = RunDir(run_dir)
    rec = rd.event("diagnosis", 3, ts=1.0, event="hang_detected", value=float("nan"),
                   nested={"x": float("inf")})
    rd.close()
    line = (run_dir / "events.jsonl").read_text().splitlines()[-1]
    parsed = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in events.jsonl"))
    assert (parsed["event"], parsed["cycle"]) == ("diagnosis", 3) and parsed["ts"] != 1.0
    assert parsed["value"] == "nan" and parsed["nested"] == {"x": "inf"}
    assert rec["event"] == "diagnosis"


def test_summary_that_cannot_be_written_goes_to_stderr(small_tmpfs: Path, capsys):
    rd = RunDir(small_tmpfs / "run")
    fill(small_tmpfs)
    assert rd.write_summary({"exit_code": 17, "reason": "why"}) is False
    err = capsys.readouterr().err
    assert "cannot write" in err and "summary.json" in err
    assert json.loads(err.split("the summary follows:\n", 1)[1])["exit_code"] == 17
    assert not (small_tmpfs / "run" / "summary.json").exists()
    assert not [p for p in (small_tmpfs / "run").iterdir() if p.name.startswith(".summary")]
    rd.close()


@pytest.mark.timeout(120)
def test_a_full_log_disk_does_not_kill_training(small_tmpfs: Path, run_dir: Path):
    """--log-dir on a 1 MiB tmpfs, a worker printing 8 MB: it keeps running and exits 0
    (its pipe never closed), the drop is reported once, the job ends with exit 0."""
    res = launch(run_dir, *NO_PRELOADS, "--log-dir", str(small_tmpfs / "logs"),
                 "--nproc-per-node", "1",
                 "--redirects", "3", IO_CASES, "chatty", "2.5")
    assert res.returncode == 0, res.stderr[-3000:]
    exits = named(events(run_dir), "worker_exited")
    assert [(e["exit_code"], e["signal"]) for e in exits] == [(0, None)], exits
    assert res.stderr.count("log file cannot be written (No space left on device)") == 1
    assert json.loads((run_dir / "summary.json").read_text())["exit_code"] == 0


@pytest.mark.timeout(120)
def test_a_full_run_dir_disk_keeps_the_exit_code_and_prints_the_summary(small_tmpfs: Path):
    """The whole run dir on a 1 MiB tmpfs that fills up: the worker still exits 0, the
    launcher exits 0, and the summary is on disk or, if it cannot be, on stderr."""
    run = small_tmpfs / "run"
    # The disk fills up during the run (the start-up health check would refuse 1 MiB).
    res = launch(run, *NO_PRELOADS, "--nproc-per-node", "1", "--redirects", "3",
                 "--ft-min-free-space", "0", IO_CASES, "chatty", "2.5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    if (run / "summary.json").exists():
        summary = json.loads((run / "summary.json").read_text())
    else:
        summary = json.loads(res.stderr.split("the summary follows:\n", 1)[1].split("\n}\n")[0]
                             + "\n}")
    assert summary["exit_code"] == 0
    assert summary["workers"][0]["exit_code"] == 0, summary["workers"]


@pytest.mark.timeout(120)
def test_a_run_dir_disk_filled_by_a_rank_keeps_room_for_the_record(tmpfs_2m: Path):
    """The run dir on a 2 MiB tmpfs, a (warm) rank printing far more than that: its log
    stops first (output_dropped, in events.jsonl, and the bytes in worker_exited), every
    event after it is still written, and summary.json is on disk with the exit code."""
    run = tmpfs_2m / "run"
    res = launch(run, *NO_PRELOADS, "--nproc-per-node", "1", "--redirects", "3",
                 "--ft-min-free-space", "0", IO_CASES, "chatty", "2.5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run / "summary.json").exists(), res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_code"] == 0 and "events_dropped" not in summary, summary
    assert summary["workers"][0]["exit_code"] == 0, summary["workers"]
    assert summary["workers"][0]["warm"] is True  # the default: a standby became the rank
    assert summary["workers"][0]["output_dropped_bytes"] > 0, summary["workers"]
    evs = events(run)
    dropped = named(evs, "output_dropped")
    assert [d["rank"] for d in dropped] == [0], dropped
    assert "No space left on device" in dropped[0]["reason"]
    names = [e["event"] for e in evs]
    assert names.index("output_dropped") < names.index("worker_exited")
    assert names[-1] == "launcher_exited"
    log_size = (run / "logs" / "cycle_0" / "rank_0.log").stat().st_size
    assert 256 * 1024 < log_size < 2 * 1024 * 1024  # it wrote until the reserve, not beyond


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("Linux: flock, O_NOFOLLOW semantics, tmpfs")
