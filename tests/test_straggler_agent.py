"""The rank's side of straggler detection: section frames as cheap as a heartbeat, and the
device (GPU) time of a section from CUDA events, never synchronised.

The client talks to a real ZeroMQ ROUTER (what the monitor is) over ipc. No GPU exists
here: the device-time tests mock only the CUDA event object (record / query /
elapsed_time), and say so; tests/gpu/test_straggler_gpu.py runs the real events.
"""

from __future__ import annotations

import math
import sys

import pytest
import zmq

from ft_agent import RankMonitorClient, protocol
from ft_agent.device_time import MAX_PENDING, DeviceTimer


class FakeCudaEvent:
    """MOCK of torch.cuda.Event (no GPU here): the test decides when an event completed
    and the device clock of each record."""

    def __init__(self, device: FakeDevice) -> None:
        self.device, self.at, self.records = device, None, 0

    def record(self) -> None:
        self.records += 1
        self.at = self.device.enqueue()

    def query(self) -> bool:
        return self.at is not None and self.at <= self.device.done

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event not completed"
        return (self.device.clock[end.at] - self.device.clock[self.at]) * 1000.0


class FakeDevice:
    """A stream: records get consecutive positions; ``complete(n)`` runs the first n."""

    def __init__(self) -> None:
        self.clock: list[float] = []
        self.done = -1
        self.next_time = 0.0

    def enqueue(self) -> int:
        self.clock.append(self.next_time)
        return len(self.clock) - 1

    def complete(self, upto: int) -> None:
        self.done = upto


def timer_with(device: FakeDevice) -> DeviceTimer:
    return DeviceTimer(new_event=lambda: FakeCudaEvent(device))


# -- protocol ------------------------------------------------------------------------------


def test_section_frames_decode_like_encoded_ones():
    frames = protocol.section_frames('com"pute \u00e9')
    assert protocol.decode(frames.open(12.5)) == protocol.decode(
        protocol.encode(protocol.SECTION_OPEN, name='com"pute \u00e9', t=12.5))
    assert protocol.decode(frames.close(13.25)) == {
        "v": 1, "k": "sec_close", "name": 'com"pute \u00e9', "t": 13.25}
    assert protocol.decode(frames.close(13.25, 0.004))["dev"] == 0.004


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e9])
def test_a_device_time_the_decoder_would_reject_is_left_out(bad):
    msg = protocol.decode(protocol.section_frames("s").close(1.0, bad))
    assert "dev" not in msg


@pytest.mark.parametrize("name", ["", "a\nb", "x" * 300, "\x1b[2J"])
def test_a_bad_section_name_is_refused_when_its_frames_are_built(name):
    with pytest.raises(protocol.ProtocolError, match="section name"):
        protocol.section_frames(name)


@pytest.mark.parametrize("dev, words", [
    ('"1"', "'dev'"), ("-0.5", "'dev'"), ("1e999", "'dev'"), ("true", "'dev'"),
    ("[1]", "'dev'"), ("604801", "'dev'"), ("NaN", "not a finite number")])
def test_the_decoder_rejects_a_bad_device_time_naming_the_field(dev, words):
    frame = b'{"v":1,"k":"sec_close","name":"s","t":1.0,"dev":' + dev.encode() + b"}"
    with pytest.raises(protocol.ProtocolError, match=words):
        protocol.decode(frame)


# -- device timer (mocked CUDA events) ---------------------------------------------------


def test_device_times_arrive_in_order_once_their_events_completed():
    device = FakeDevice()
    timer = timer_with(device)
    reported = []
    for step in range(5):
        device.next_time = step * 1.0
        timer.open("compute")
        device.next_time = step * 1.0 + 0.1 * (step + 1)  # section k takes 0.1*(k+1) s
        reported.append(timer.close("compute"))
    assert reported == [None] * 5, "nothing completed yet: nothing reported, nothing waited"
    device.complete(5)  # the first 3 sections (6 records) ran on the device
    out = [timer.close("compute") for _ in range(4)]  # closes without an open report too
    assert [round(v, 6) if v else v for v in out] == [0.1, 0.2, 0.3, None]


def test_the_backlog_is_bounded_and_events_are_reused():
    device = FakeDevice()
    created = []

    def new_event():
        created.append(FakeCudaEvent(device))
        return created[-1]

    timer = DeviceTimer(new_event=new_event)
    for _ in range(MAX_PENDING + 10):
        timer.open("s")
        timer.close("s")
    assert timer.dropped == 10
    device.complete(10**9)
    timer.open("s")
    assert timer.close("s") is not None
    before = len(created)
    for _ in range(20):  # steady state: completed events are recycled, none created
        timer.open("s")
        timer.close("s")
    assert len(created) == before


# -- client, against a real ROUTER ---------------------------------------------------------


@pytest.fixture
def monitor_socket(tmp_path, monkeypatch):
    """A real ROUTER that answers the hello; yields a function receiving decoded frames."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/m.sock"
    sock.bind(endpoint)
    monkeypatch.setenv("FT_ENDPOINT", endpoint)
    monkeypatch.setenv("FT_TOKEN", "t")
    monkeypatch.setenv("RANK", "3")
    client = RankMonitorClient()
    import threading

    def answer():
        ident, frame = sock.recv_multipart()
        assert protocol.decode(frame)["k"] == "hello"
        sock.send_multipart([ident, protocol.encode(protocol.CONFIG, ok=True, timeouts={})])

    t = threading.Thread(target=answer)
    t.start()
    client.init_workload_monitoring()
    t.join(10)

    def receive(n):
        out = []
        for _ in range(n):
            assert sock.poll(10_000), "no frame from the client"
            out.append(protocol.decode(sock.recv_multipart()[1]))
        return out

    yield client, receive
    client.shutdown_workload_monitoring()
    sock.close()


def test_sections_reach_the_monitor_through_the_fast_path(monitor_socket):
    client, receive = monitor_socket
    with client.section("compute"):
        pass
    client.start_section("io")
    client.end_section("io")
    client.end_all_sections()
    got = receive(5)
    assert [(m["k"], m.get("name")) for m in got] == [
        ("sec_open", "compute"), ("sec_close", "compute"), ("sec_open", "io"),
        ("sec_close", "io"), ("sec_close_all", None)]
    assert all(math.isfinite(m["t"]) for m in got)
    assert got[0]["t"] <= got[1]["t"] <= got[2]["t"]
    assert set(client._sections) == {"compute", "io"}, "frames built once per name"


def test_a_bad_section_name_is_warned_once_and_never_sent(monitor_socket, caplog):
    client, receive = monitor_socket
    for _ in range(3):
        with client.section("bad\nname"):
            pass
    client.send_heartbeat()
    assert receive(1)[0]["k"] == "hb", "nothing was sent for the bad name"
    assert sum("section not sent" in r.message for r in caplog.records) == 1


def test_device_sections_carry_earlier_device_times_and_torch_is_not_imported(
        monitor_socket):
    """MOCK: the CUDA events (no GPU here); everything else is real."""
    client, receive = monitor_socket
    device = FakeDevice()
    client._device = timer_with(device)
    for step in range(3):
        device.next_time = float(step)
        client.start_section("compute", device=True)
        device.next_time = step + 0.05
        client.end_section("compute", device=True)
    device.complete(10**9)
    with client.section("compute", device=True):
        pass
    closes = [m for m in receive(8) if m["k"] == "sec_close"]
    assert [round(m["dev"], 6) if "dev" in m else None for m in closes] == [
        None, None, None, 0.05]


def test_ft_agent_does_not_import_torch_for_wall_sections(tmp_path):
    import subprocess

    code = ("import sys, ft_agent; c = ft_agent.RankMonitorClient(); "
            "c.start_section('s'); c.end_section('s'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stderr
