"""Worker behaviours for the I/O and hostile-input tests; argv[1] picks one."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODE = sys.argv[1]
RUN = Path(os.environ["FT_RUN_DIR"])
RANK = int(os.environ["RANK"])


def beat_for(client, seconds, every=0.05):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        client.send_heartbeat()
        time.sleep(every)


def heartbeats_under_attack():
    """Heartbeat for a while; tell the test how to reach the monitor; send a diagnosis
    carrying fields that must never reach events.jsonl."""
    from ft_agent import RankMonitorClient, protocol

    client = RankMonitorClient()
    client.init_workload_monitoring()
    (RUN / f"peer_rank_{RANK}.json").write_text(json.dumps({
        "endpoint": os.environ["FT_ENDPOINT"], "token": os.environ["FT_TOKEN"],
        "pid": os.getpid()}))
    client._fire(protocol.DIAGNOSIS, state="FORGED", iteration=1, event="hang_detected",
                 ts=1.0, rank=7, cycle=9, name="x", timeout_kind="heartbeat")
    beat_for(client, float(sys.argv[2]))
    client.shutdown_workload_monitoring()


def child_sleeps():
    """Start a child in this worker's process group, record its pid, wait forever."""
    child = subprocess.Popen(["sleep", "300"])
    (RUN / f"child_rank_{RANK}.pid").write_text(str(child.pid))
    time.sleep(300)


def carriage_returns():
    """Only '\\r', no newline: tens of MB of one endless 'line', then a final line."""
    block = b"\r" * (1 << 20)
    out = sys.stdout.buffer
    for _ in range(int(sys.argv[2])):
        out.write(block)
    out.write(b"\x1b[2J\x1b]0;title\x07after the flood\n")
    out.flush()


def chatty():
    """Print steadily (more than a small disk holds); exit 0 only if every write worked."""
    line = b"x" * 1023 + b"\n"
    out = sys.stdout.buffer
    end = time.monotonic() + float(sys.argv[2])
    n = 0
    while time.monotonic() < end:
        out.write(line * 64)
        out.flush()
        n += 64
        time.sleep(0.01)
    print(f"wrote {n} lines", flush=True)


def exit_code():
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
    sys.exit(int(sys.argv[2]))


{"heartbeats_under_attack": heartbeats_under_attack, "child_sleeps": child_sleeps,
 "carriage_returns": carriage_returns, "chatty": chatty, "exit_code": exit_code}[MODE]()
