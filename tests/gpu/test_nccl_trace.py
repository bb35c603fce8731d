"""ft_launcher.hang.nccl_trace on CPU: the file side of collecting NCCL flight-recorder dumps.

Real files, FIFOs and symbolic links in a temporary directory stand in for what torch's NCCL
heartbeat monitor creates (it needs a GPU); the GPU run in test_gpu_launcher.py checks that
torch really writes where these functions look.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from ft_launcher.hang import nccl_trace
from ft_launcher.hang.nccl_trace import TraceSettings, collect_traces, request_dumps, worker_env


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    private = tmp_path / "ipc"
    private.mkdir(mode=0o700)
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    return nccl_trace.trace_dir(private), stacks


# -- the worker environment ----------------------------------------------------------------


def test_worker_env_is_empty_unless_the_recorder_is_asked_for(tmp_path):
    assert worker_env({}, tmp_path) == {}
    assert worker_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, tmp_path) == {}
    assert worker_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "lots"}, tmp_path) == {}
    # torch reads TORCH_FR_BUFFER_SIZE first: 0 there turns the recorder off.
    assert worker_env({"TORCH_FR_BUFFER_SIZE": "0",
                       "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, tmp_path) == {}


def test_worker_env_points_dumps_and_pipes_into_the_private_dir(tmp_path):
    env = worker_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, tmp_path)
    where = tmp_path / nccl_trace.SUBDIR
    assert env == {
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(where / nccl_trace.DUMP_PREFIX),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(where / nccl_trace.PIPE_STEM),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    settings = nccl_trace.trace_settings({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", **env})
    assert settings == TraceSettings(2000, str(where / nccl_trace.DUMP_PREFIX),
                                     str(where / nccl_trace.PIPE_STEM))


def test_worker_env_keeps_what_the_user_chose(tmp_path):
    user = {"TORCH_FR_BUFFER_SIZE": "100", "TORCH_FR_DUMP_TEMP_FILE": "/data/fr_",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/data/pipe_",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert worker_env(user, tmp_path) == {}
    # TORCH_FR_DUMP_TEMP_FILE is the name torch reads first.
    settings = nccl_trace.trace_settings({**user, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x_"})
    assert settings == TraceSettings(100, "/data/fr_", "/data/pipe_")


def test_no_settings_without_a_known_dump_prefix():
    assert nccl_trace.trace_settings({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}) is None
    assert nccl_trace.trace_settings({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x_"}) is None


def test_trace_dir_is_private(tmp_path):
    path = nccl_trace.trace_dir(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert nccl_trace.trace_dir(tmp_path) == path  # idempotent


# -- collecting dumps ----------------------------------------------------------------------


def test_dumps_are_moved_next_to_the_python_stacks(dirs):
    trace, stacks = dirs
    prefix = str(trace / "dump_rank_")
    for rank in (0, 1):
        Path(f"{prefix}{rank}").write_bytes(b"\x80\x02fake pickle of rank %d" % rank)
    got = collect_traces(stacks, 3, prefix, [0, 1, 2])
    assert sorted(got.collected) == [0, 1]
    assert got.collected[1] == stacks / "cycle_3_rank_1.nccl_trace"
    assert got.collected[1].read_bytes() == b"\x80\x02fake pickle of rank 1"
    assert got.missing == {2: "no dump"}
    assert not Path(f"{prefix}0").exists(), "a collected dump is removed at its source"
    assert sorted(p.name for p in stacks.iterdir()) == [
        "cycle_3_rank_0.nccl_trace", "cycle_3_rank_1.nccl_trace"]


def test_a_symlink_is_never_followed(dirs, tmp_path):
    trace, stacks = dirs
    secret = tmp_path / "secret"
    secret.write_text("not yours")
    prefix = str(trace / "dump_rank_")
    os.symlink(secret, f"{prefix}0")
    got = collect_traces(stacks, 0, prefix, [0], wait_s=0.5)
    assert got.collected == {}
    assert got.missing == {0: "not a regular file"}
    assert list(stacks.iterdir()) == []
    assert secret.read_text() == "not yours" and os.path.islink(f"{prefix}0")


def test_a_fifo_or_directory_is_not_read(dirs):
    trace, stacks = dirs
    prefix = str(trace / "dump_rank_")
    os.mkfifo(f"{prefix}0")
    os.mkdir(f"{prefix}1")
    started = time.monotonic()
    got = collect_traces(stacks, 0, prefix, [0, 1], wait_s=5)
    assert time.monotonic() - started < 2, "nothing to wait for: both are final"
    assert got.missing == {0: "not a regular file", 1: "not a regular file"}


def test_an_oversized_dump_is_left_where_it_is(dirs):
    trace, stacks = dirs
    prefix = str(trace / "dump_rank_")
    Path(f"{prefix}0").write_bytes(b"x" * 101)
    got = collect_traces(stacks, 0, prefix, [0], max_bytes=100)
    assert got.missing == {0: "larger than 100 bytes"}
    assert Path(f"{prefix}0").exists() and list(stacks.iterdir()) == []


def test_a_stale_dump_is_not_taken_as_this_hangs(dirs):
    trace, stacks = dirs
    prefix = str(trace / "dump_rank_")
    old = Path(f"{prefix}0")
    old.write_bytes(b"from an earlier NCCL timeout")
    os.utime(old, (time.time() - 600, time.time() - 600))
    got = collect_traces(stacks, 1, prefix, [0], since=time.time())
    assert got.collected == {} and "older one is left alone" in got.missing[0]
    assert old.exists()


class FakeClock:
    """time.monotonic and time.sleep for collect_traces; runs ``on_sleep`` at each sleep."""

    def __init__(self, on_sleep):
        self.now, self.sleeps, self.on_sleep = 100.0, 0, on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        self.on_sleep(self.sleeps)


def test_waits_for_a_dump_that_appears_and_grows(dirs):
    trace, stacks = dirs
    prefix = str(trace / "dump_rank_")
    path = Path(f"{prefix}0")

    def writer(n: int) -> None:  # appears after 3 polls, grows for 2 more, then holds
        if n == 3:
            path.write_bytes(b"a")
        elif n in (4, 5):
            with path.open("ab") as f:
                f.write(b"b")

    fake = FakeClock(writer)
    got = collect_traces(stacks, 2, prefix, [0], wait_s=3.0, clock=fake.clock,
                         sleep=fake.sleep)
    assert got.collected[0].read_bytes() == b"abb", "taken only once its size held still"
    assert fake.sleeps == 6


def test_gives_up_at_the_deadline(dirs):
    trace, stacks = dirs
    fake = FakeClock(lambda n: None)
    got = collect_traces(stacks, 0, str(trace / "dump_rank_"), [0, 1], wait_s=1.0,
                         clock=fake.clock, sleep=fake.sleep)
    assert got.missing == {0: "no dump", 1: "no dump"}
    assert 1.0 <= fake.now - 100.0 <= 1.0 + nccl_trace.POLL_S + 1e-9


# -- asking for dumps ----------------------------------------------------------------------


def test_request_writes_into_each_ranks_pipe(dirs):
    trace, _ = dirs
    stem = str(trace / "pipe_rank_")
    readers = {}
    for rank in (4, 5):
        os.mkfifo(f"{stem}{rank}.pipe", 0o600)
        # What torch's heartbeat monitor does: open for reading, non-blocking, and poll.
        readers[rank] = os.open(f"{stem}{rank}.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        asked = request_dumps(TraceSettings(2000, "unused", stem), [4, 5, 6])
        assert asked == [4, 5], "rank 6 has no pipe"
        assert os.read(readers[4], 128) == b"1" and os.read(readers[5], 128) == b"1"
    finally:
        for fd in readers.values():
            os.close(fd)


def test_request_never_blocks_nor_writes_a_non_fifo(dirs, tmp_path):
    trace, _ = dirs
    stem = str(trace / "pipe_rank_")
    os.mkfifo(f"{stem}0.pipe")  # nobody reads it: the NCCL group is not up yet
    Path(f"{stem}1.pipe").write_text("a regular file")
    real_fifo = tmp_path / "elsewhere.pipe"
    os.mkfifo(real_fifo)
    reader = os.open(real_fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.symlink(real_fifo, f"{stem}2.pipe")
    try:
        started = time.monotonic()
        assert request_dumps(TraceSettings(2000, "unused", stem), [0, 1, 2]) == []
        assert time.monotonic() - started < 1
        assert Path(f"{stem}1.pipe").read_text() == "a regular file"
        # Nothing reached the FIFO behind the symlink (no writer ever: end of file).
        assert os.read(reader, 128) == b""
    finally:
        os.close(reader)
    assert request_dumps(TraceSettings(2000, "unused", None), [0]) == []
