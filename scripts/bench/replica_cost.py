"""What a snapshot replica on another node costs on this machine (ft_launcher.snapshots).

    python scripts/bench/replica_cost.py                  # 200 MB of float32, 5 runs
    python scripts/bench/replica_cost.py --mb 20 --runs 3 --out /tmp/x.json

A replica server runs in a process of its own (a buddy node, on loopback), its root on
/dev/shm. Per run, this process writes a new snapshot of ``--mb`` MB of float32 (20 tensors)
into a local store, then measures: ``push`` of that slot to the server (read, send in
chunks, the server's CRC32 check and write, commit record last); ``fetch`` of it back into
an empty rank directory (the server's check on the way out, this side's check and write);
and ``load`` of the fetched directory (read, CRC32, non-finite test), here and in a new
process as a restarted rank meets it. ``restore`` is fetch + load in a new process: what a
rank whose node was lost waits for. Medians printed, everything written to ``--out``.
The server is ended by pid and every directory removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
from bench import machine_info  # noqa: E402
from snapshot_cost import TENSORS, restore_in_new_process, state_of  # noqa: E402

from ft_agent.snapshot import SnapshotStore, load  # noqa: E402
from ft_launcher.snapshots.replica import DEFAULT_CHUNK, DEFAULT_WINDOW, fetch, push  # noqa: E402

TOKEN = "b0" * 16
SERVER = ("import sys, time; from ft_launcher.snapshots.replica import ReplicaServer; "
          "s = ReplicaServer(sys.argv[1], 'tcp://127.0.0.1:0', sys.argv[2]).start(); "
          "print(s.endpoint, flush=True); time.sleep(3600)")


def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(root), TOKEN], env=env,
                            stdout=subprocess.PIPE, text=True)
    endpoint = proc.stdout.readline().strip()
    if not endpoint.startswith("tcp://"):
        proc.kill()
        raise RuntimeError(f"replica server did not start (exit {proc.wait()})")
    return proc, endpoint


def one_run(step: int, mb: int, src: Path, dest: Path, endpoint: str) -> dict[str, Any]:
    state = state_of(mb, step)
    with SnapshotStore(src) as store:
        store.snapshot(state, step, wait=True)
        assert store.wait().ok
    pushed = push(src, 0, endpoint, TOKEN, timeout=60)
    assert pushed.ok and not pushed.skipped, pushed
    shutil.rmtree(dest, ignore_errors=True)
    got = fetch(endpoint, 0, dest, TOKEN, timeout=60)
    assert got.ok and got.iteration == step, got
    snap = load(dest)
    assert snap.iteration == step and all(
        torch.equal(snap.state["model"][k], state["model"][k]) for k in state["model"])
    fresh = restore_in_new_process(dest)
    return {"iteration": step, "bytes": pushed.bytes, "push_s": round(pushed.seconds, 4),
            "fetch_s": round(got.seconds, 4), "load_s": round(snap.seconds, 4),
            "load_new_process_s": fresh, "restore_s": round(got.seconds + fresh, 4)}


def measure(mb: int, runs: int, root: Path) -> dict[str, Any]:
    proc, endpoint = start_server(root / "replicas")
    try:
        one_run(0, mb, root / "src", root / "dest", endpoint)  # first: buffers, pages
        per_run = [one_run(step, mb, root / "src", root / "dest", endpoint)
                   for step in range(1, runs + 1)]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    keys = ("push_s", "fetch_s", "load_s", "load_new_process_s", "restore_s")
    return {"runs": per_run, "median": {k: statistics.median(r[k] for r in per_run)
                                        for k in keys},
            "max": {k: max(r[k] for r in per_run) for k in keys}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="state size in MB (default 200)")
    ap.add_argument("--runs", type=int, default=5, help="measured runs (default 5)")
    ap.add_argument("--out", type=Path, default=HERE / "replica_cost.json")
    args = ap.parse_args(argv)
    if args.mb < 1 or args.runs < 1:
        ap.error("--mb and --runs must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="ft-replica-bench-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "machine": machine_info(), "torch_threads": torch.get_num_threads(),
                  "command": shlex.join(["python", "scripts/bench/replica_cost.py",
                                         *(argv if argv is not None else sys.argv[1:])]),
                  "state": {"mb": args.mb, "dtype": "float32", "tensors": TENSORS,
                            "stores": "/dev/shm (tmpfs)", "transport": "ZeroMQ TCP loopback",
                            "chunk_bytes": DEFAULT_CHUNK, "window": DEFAULT_WINDOW},
                  "replica": measure(args.mb, args.runs, root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    m = result["replica"]["median"]
    print(f"{args.mb} MB float32, median of {args.runs}: push {m['push_s'] * 1000:.0f} ms, "
          f"fetch {m['fetch_s'] * 1000:.0f} ms, load {m['load_s'] * 1000:.0f} ms (in a new "
          f"process {m['load_new_process_s'] * 1000:.0f} ms); restore = fetch + load in a "
          f"new process {m['restore_s'] * 1000:.0f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
