"""Worker behaviours for the monitoring tests; argv[1] picks one. Cycle 0 misbehaves,
later cycles run cleanly so the restarted job finishes."""

import atexit
import json
import os
import sys
import time
from pathlib import Path

import zmq

from ft_agent import RankMonitorClient, protocol

MODE = sys.argv[1]
CYCLE = int(os.environ["FT_CYCLE"])
RANK = int(os.environ["RANK"])
RUN = Path(os.environ["FT_RUN_DIR"])


def stuck_in_imports():
    time.sleep(600)


def slow_section_work():
    time.sleep(600)


def stuck_in_teardown():
    time.sleep(600)


def record(name, data):
    (RUN / f"{name}_cycle_{CYCLE}_rank_{RANK}.json").write_text(json.dumps(data))


def beat(client, n, every=0.02, section=None):
    for _ in range(n):
        if section:
            with client.section(section):
                time.sleep(every)
        else:
            time.sleep(every)
        client.send_heartbeat()


if MODE == "sleep_before_init" and CYCLE == 0 and RANK == 1:
    stuck_in_imports()

if MODE == "stuck_at_exit" and RANK == 1:  # its interpreter's exit never ends
    atexit.register(stuck_in_teardown)  # before the client's own handler: runs after it

client = RankMonitorClient()
client.init_workload_monitoring()
record("hello_timeouts", client.timeouts)

if MODE == "section_overrun" and CYCLE == 0:
    beat(client, 5, section="fast")
    if RANK == 0:
        with client.section("slow"):
            slow_section_work()
    beat(client, 200, section="fast")
elif MODE == "calc":
    beat(client, 20, every=0.03)
    beat(client, 10, every=0.01, section="step")
    assert client.calculate_and_set_hb_timeouts()
    assert client.calculate_and_set_section_timeouts()
    record("calculated", client.state_dict())
    if CYCLE == 0 and RANK == 1:
        sys.exit(7)
elif MODE == "bad_messages":
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(os.environ["FT_ENDPOINT"])
    bad_hello = protocol.encode(protocol.HELLO, token="wrong", rank=RANK, local_rank=RANK,
                                pid=os.getpid(), host="x", cycle=CYCLE)
    for frame in [b"\x80\x04garbage", b"{not json", b'{"v": 99, "k": "hb"}', b'[1,2]',
                  b'{"v": 1, "k": "nope"}', b'{"v": 1, "k": "sec_open", "name": 5}',
                  bad_hello, protocol.HEARTBEAT_FRAME]:
        sock.send(frame)
    sock.send_multipart([b"a", b"b"])
    reply = sock.poll(2000) and protocol.decode(sock.recv())
    record("bad_hello_reply", reply or {})
    client.end_section("never_opened")
    client.start_section("unconfigured")
    client.end_section("unconfigured")
    for _ in range(5000):  # a flood is absorbed, not a crash or a false verdict
        client.send_heartbeat()
    beat(client, 30)
    sock.close()
elif MODE == "steady":  # heartbeats at 20 Hz for STEADY_S seconds or until RUN/stop exists
    end = time.monotonic() + float(os.environ.get("STEADY_S", "12"))
    while time.monotonic() < end and not (RUN / "stop").exists():
        time.sleep(0.05)
        client.send_heartbeat()
elif MODE == "burst":  # a burst far beyond any queue, then steady heartbeats again
    for _ in range(200_000):
        client.send_heartbeat()
    beat(client, 60, every=0.05)
elif MODE == "clean_long":
    beat(client, 150, every=0.04, section="step")
else:
    beat(client, 10)
if MODE != "stuck_at_exit":  # that one leaves the goodbye to the interpreter's exit
    client.shutdown_workload_monitoring()
if MODE == "stuck_after_goodbye" and RANK == 1:  # done training, then never exits
    stuck_in_teardown()
