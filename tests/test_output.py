"""The output pump (ft_launcher/process/output.py) on real pipes and real writer processes: bounded
lines, escaped console, a log that cannot be written, a console that went away."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ft_launcher.process.output import LINE_LIMIT, OutputPump, Sink, console_line, split_lines


def _writer(code: str) -> subprocess.Popen:
    """A real process printing to a pipe; its exit code tells whether every write worked."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def _pump(proc: subprocess.Popen, sink: Sink, **kw) -> OutputPump:
    assert proc.stdout is not None
    return OutputPump(proc.stdout, sink, name="test-pump", **kw).start()


def test_console_escapes_controls_and_breaks_bare_carriage_returns():
    assert split_lines(b"a\r\nb\r\r\rc\n\nd") == [(b"a", b"\n"), (b"b", b"\r"), (b"c", b"\n"),
                                                 (b"", b"\n"), (b"d", b"")]
    assert console_line(b"[r0]: ", b"\x1b[2Jhi\x07\ttab\xff") == \
        b"[r0]: \\x1b[2Jhi\\x07\ttab\\xff\n"
    console = io.BytesIO()
    sink = Sink(None, b"[r0]: ", console=console)
    sink.write(b"10%\r20%\r")
    sink.write(b"\r" * 5000)
    sink.write(b"done\n\n")
    sink.write(b"no newline at the end")
    sink.close()
    assert console.getvalue() == (b"[r0]: 10%\n[r0]: 20%\n[r0]: done\n[r0]: \n"
                                  b"[r0]: no newline at the end\n")


def test_a_huge_line_is_cut_on_the_console_and_kept_whole_in_the_log(tmp_path: Path):
    log_path = tmp_path / "rank.log"
    console = io.BytesIO()
    proc = _writer("import sys; sys.stdout.buffer.write(b'x' * 3_000_000 + b'\\nnext\\n')")
    pump = _pump(proc, Sink(open(log_path, "ab", buffering=0), b"[r0]: ", console=console))
    assert proc.wait(30) == 0
    pump.join(10)
    assert log_path.stat().st_size == 3_000_000 + 6
    lines = console.getvalue().split(b"\n")
    assert lines[0] == b"[r0]: " + b"x" * LINE_LIMIT
    assert lines[1] == f"[r0]: [... {3_000_000 - LINE_LIMIT} more bytes of this line are in " \
                       "the log]".encode()
    assert lines[2] == b"[r0]: next"


def test_carriage_returns_only_keep_the_sink_bounded():
    """Megabytes of '\\r' and of one endless line: the sink never holds more than a line."""
    console = io.BytesIO()
    sink = Sink(None, b"p ", console=console)
    for _ in range(200):
        sink.write(b"\r" * LINE_LIMIT)
        assert len(sink._partial) <= LINE_LIMIT
    assert console.getvalue() == b""
    for _ in range(200):
        sink.write(b"y" * LINE_LIMIT)
        assert len(sink._partial) <= LINE_LIMIT
    assert console.getvalue() == b"p " + b"y" * LINE_LIMIT + b"\n"


def test_a_log_that_cannot_be_written_is_drained_counted_and_reported_once(caplog):
    """/dev/full fails every write with ENOSPC, like a full disk. The writer puts 4 MB through
    its pipe and exits 0: it never saw the pipe close."""
    drops: list[str] = []
    sink = Sink(open("/dev/full", "ab", buffering=0), None, label="rank 3",
                on_drop=drops.append)
    proc = _writer("import sys\nfor _ in range(4096): sys.stdout.buffer.write(b'z' * 1023 + "
                   "b'\\n')")
    pump = _pump(proc, sink)
    assert proc.wait(30) == 0
    pump.join(10)
    assert not pump.is_alive()
    assert pump.dropped_bytes == 4096 * 1024
    assert drops == ["No space left on device"]
    assert sum("rank 3: log file cannot be written" in r.message for r in caplog.records) == 1


def test_a_console_that_went_away_stops_echoing_but_not_the_log(tmp_path: Path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # writes now fail with EPIPE
    console = os.fdopen(write_end, "wb", buffering=0)
    log_path = tmp_path / "rank.log"
    sink = Sink(open(log_path, "ab", buffering=0), b"[r0]: ", console=console)
    proc = _writer("print('one'); print('two')")
    pump = _pump(proc, sink)
    assert proc.wait(30) == 0
    pump.join(10)
    assert sink.console is None
    assert log_path.read_bytes() == b"one\ntwo\n"
    console.close()


def test_a_line_hook_takes_lines_and_switches_sinks(tmp_path: Path):
    """How a warm-restart standby uses the pump: marked lines are messages, and one of them
    moves the output to the cycle's log."""
    first, second = tmp_path / "standby.log", tmp_path / "cycle.log"
    cycle_sink = Sink(open(second, "ab", buffering=0), None)
    seen: list[bytes] = []

    def on_line(pump: OutputPump, line: bytes) -> bool:
        if not line.startswith(b"@@"):
            return False
        seen.append(line)
        if line.startswith(b"@@start"):
            pump.swap_sink(cycle_sink)
        return True

    proc = _writer("print('before'); print('@@ready'); print('@@start'); print('after')")
    pump = _pump(proc, Sink(open(first, "ab", buffering=0), None), on_line=on_line)
    assert proc.wait(30) == 0
    pump.join(10)
    assert first.read_bytes() == b"before\n" and second.read_bytes() == b"after\n"
    assert seen == [b"@@ready\n", b"@@start\n"]


def test_a_failing_hook_does_not_stop_the_draining(tmp_path: Path):
    log_path = tmp_path / "rank.log"

    def broken(pump: OutputPump, line: bytes) -> bool:
        raise RuntimeError("boom")

    proc = _writer("import sys\nfor i in range(20000): print(i)")
    pump = _pump(proc, Sink(open(log_path, "ab", buffering=0), None), on_line=broken)
    assert proc.wait(30) == 0
    pump.join(10)
    assert not pump.is_alive() and pump.failures == 20000
    assert log_path.read_text().split() == [str(i) for i in range(20000)]


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("/dev/full")


def test_a_line_already_tagged_with_the_rank_is_not_tagged_twice():
    """torch tags its own distributed warnings ``[rank0]:``; the console shows one tag."""
    assert console_line(b"[rank0]: ", b"[rank0]:[W1201 c10d] warning") == \
        b"[rank0]:[W1201 c10d] warning\n"
    assert console_line(b"[rank0]: ", b"[rank1]: other") == b"[rank0]: [rank1]: other\n"


def test_a_worker_group_records_a_full_log_once_on_the_callers_thread(tmp_path: Path):
    """A worker whose log is /dev/full (ENOSPC on every write): one ``output_dropped``
    event, emitted by poll() on this thread; the worker exits 0; the drop is counted."""
    import threading

    from ft_launcher.process.workers import WorkerGroup, WorkerSpec

    recorded: list[tuple[str, dict, str]] = []
    group = WorkerGroup(events=lambda name, **f: recorded.append(
        (name, f, threading.current_thread().name)))
    code = "import sys\nfor _ in range(2000): sys.stdout.buffer.write(b'w' * 511 + b'\\n')"
    spec = WorkerSpec(0, 5, [sys.executable, "-c", code], dict(os.environ),
                      Path("/dev/full"), False)
    group.start([spec])
    try:
        worker = group.workers[0]
        assert worker.proc.wait(30) == 0
        worker._pump.join(10)
        group.poll()
        group.poll()
    finally:
        group.kill_all()
    assert recorded == [("output_dropped", {"rank": 5, "log": "/dev/full",
                                            "reason": "No space left on device"},
                         threading.current_thread().name)]
    assert worker.describe_exit() == {"exit_code": 0, "signal": None,
                                      "output_dropped_bytes": 2000 * 512}


def test_logs_stop_at_the_record_reserve_and_look_again(tmp_path, monkeypatch):
    """Injected free space and clock: log writes go ahead while they leave LOG_RESERVE,
    statvfs is read again once half the room is used (or a second passed), and a refused
    write is allowed again when space came back. Only the protected file system counts."""
    from ft_launcher.process import reserve

    guard = reserve.SpaceReserve()
    free = [reserve.LOG_RESERVE + 100_000]
    looks = []
    now = [0.0]
    monkeypatch.setattr(reserve.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(guard, "_free", lambda: looks.append(now[0]) or free[0])
    assert guard.log_allows(10_000) and len(looks) == 1  # room 90 000: budget 45 000
    assert all(guard.log_allows(10_000) for _ in range(4)) and len(looks) == 1
    free[0] -= 50_000
    assert guard.log_allows(10_000) and len(looks) == 2  # budget spent: look again
    free[0] = reserve.LOG_RESERVE + 5_000
    now[0] = 2.0  # a second passed: look again, whatever the budget
    assert not guard.log_allows(10_000) and len(looks) == 3
    free[0] = reserve.LOG_RESERVE + 1_000_000
    assert guard.log_allows(10_000)
    with open(tmp_path / "f", "wb") as f:
        assert not guard.covers(f.fileno())  # nothing protected yet
        guard.protect(tmp_path)
        assert guard.covers(f.fileno())
        guard.release(tmp_path)
        assert not guard.covers(f.fileno())
