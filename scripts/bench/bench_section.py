"""What a timed section costs the training process, next to a heartbeat (issue 14).

    python scripts/bench/bench_section.py [--calls 20000] [--repeat 5] [--json FILE]
    ft_launcher --nproc-per-node 1 scripts/bench/bench_section.py   # against a real monitor

Times, in the rank's own process, ``send_heartbeat()``, one ``start_section`` +
``end_section`` pair (what straggler detection adds per step), and ``with
client.section(...)``, each ``--calls`` times per repeat, interleaved so every kind sees the
same load, plus a pair JSON-encoded per call (the section path before its fast path: frames
pre-encoded per name in ft_agent.protocol.SectionFrames, as the heartbeat's). Outside
ft_launcher the monitor is a bare ZeroMQ ROUTER in a child process that answers the hello
and drops every frame (the client's cost does not depend on who reads). Prints p50 and p99
per call in microseconds (median over repeats, and their range) and the ratios to a
heartbeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ft_agent import RankMonitorClient, protocol  # noqa: E402


def serve(endpoint: str) -> None:
    """A bare ROUTER (its own process, so it takes no GIL from the client): ok to every
    hello, reads and drops everything else, until SIGTERM."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1_000_000)
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        identity, frame = sock.recv_multipart()
        if b'"k":"hello"' in frame:
            sock.send_multipart([identity, protocol.encode(protocol.CONFIG, ok=True,
                                                           timeouts={})])


def bare_monitor(directory: str) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{directory}/bench.sock"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", endpoint],
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout is None or proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the bare monitor did not start")
    return proc, endpoint


def per_call_us(fn: Callable[[], None], calls: int) -> list[float]:
    """Microseconds of each call (perf_counter_ns around each)."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000)
    return out


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def measure(client: RankMonitorClient, calls: int, repeat: int) -> dict[str, Any]:
    def pair() -> None:
        client.start_section("compute")
        client.end_section("compute")

    def context() -> None:
        with client.section("compute"):
            pass

    # What a section cost before its fast path: each frame JSON-encoded per call.
    def json_encoded() -> None:
        client._link.send(protocol.encode(protocol.SECTION_OPEN, name="compute",
                                          t=time.monotonic()))
        client._link.send(protocol.encode(protocol.SECTION_CLOSE, name="compute",
                                          t=time.monotonic()))

    kinds = {"send_heartbeat": client.send_heartbeat, "start+end_section": pair,
             "with section": context, "pair, JSON-encoded": json_encoded}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(repeat):
        for name, fn in kinds.items():  # interleaved: the same load for each kind
            samples = per_call_us(fn, calls)
            runs[name].append({"p50": pct(samples, 0.5), "p99": pct(samples, 0.99)})
            time.sleep(0.2)  # let the reader drain
    result = {}
    for name, per_run in runs.items():
        result[name] = {
            stat: {"median": statistics.median(r[stat] for r in per_run),
                   "min": min(r[stat] for r in per_run), "max": max(r[stat] for r in per_run)}
            for stat in ("p50", "p99")
        }
    hb = result["send_heartbeat"]["p50"]["median"]
    result["ratio_p50_section_pair_over_heartbeat"] = \
        result["start+end_section"]["p50"]["median"] / hb
    result["ratio_p50_json_pair_over_heartbeat"] = \
        result["pair, JSON-encoded"]["p50"]["median"] / hb
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--serve", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return

    monitor = None
    tmp = None
    if not os.environ.get("FT_ENDPOINT"):
        tmp = tempfile.TemporaryDirectory(prefix="ft-bench-")
        os.chmod(tmp.name, 0o700)
        monitor, endpoint = bare_monitor(tmp.name)
        os.environ.update(FT_ENDPOINT=endpoint, FT_TOKEN="bench", RANK="0")
    client = RankMonitorClient()
    client.init_workload_monitoring()
    try:
        result = measure(client, args.calls, args.repeat)
    finally:
        client.shutdown_workload_monitoring()
        if monitor is not None:
            monitor.terminate()
            monitor.wait()
        if tmp is not None:
            tmp.cleanup()
    result["monitor"] = "ft_launcher" if monitor is None else "bare ROUTER (child process)"
    result["calls"], result["repeat"] = args.calls, args.repeat
    result["load_average"] = os.getloadavg()[0]
    print(f"monitor: {result['monitor']}; {args.calls} calls x {args.repeat} repeats; "
          f"load average {result['load_average']:.1f}")
    print(f"{'call':<20} {'p50 us':>22} {'p99 us':>22}")
    for name in ("send_heartbeat", "start+end_section", "with section", "pair, JSON-encoded"):
        r = result[name]
        cells = [f"{r[s]['median']:.1f} ({r[s]['min']:.1f}-{r[s]['max']:.1f})"
                 for s in ("p50", "p99")]
        print(f"{name:<20} {cells[0]:>22} {cells[1]:>22}")
    print(f"section pair / heartbeat (p50): "
          f"x{result['ratio_p50_section_pair_over_heartbeat']:.2f}; JSON-encoded pair (the "
          f"path before): x{result['ratio_p50_json_pair_over_heartbeat']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
