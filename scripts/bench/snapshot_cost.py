"""What a snapshot of one rank's state costs on this machine (ft_agent.snapshot).

    python scripts/bench/snapshot_cost.py                  # 200 MB of float32, 5 runs
    python scripts/bench/snapshot_cost.py --mb 50 --runs 3 --out /tmp/x.json

For a state of ``--mb`` MB of float32 (in 20 tensors, like a model's parameters) in a
store on /dev/shm, measures per run: the time ``snapshot()`` blocks the caller (the copy
into the slot file it keeps mapped), the background commit (CRC32 + the non-finite test +
commit record), the launcher's full check of the slot at a restart (``verify_slot``: read +
CRC32 of every tensor, no torch) and ``load()`` (read, CRC32 check, non-finite test).
The first snapshot, which claims and maps its slot's pages (the store then claims the
other slot in the background), is reported apart, and ``load()`` is
also timed in a new process, as a restarted rank meets it (every page fresh). For what bounds
these, it also measures a plain tensor copy into a reused buffer (memory bandwidth) and
the checksums considered over the same bytes: CRC32 as the store computes it (zlib-ng),
CRC32 by the standard library's zlib, and BLAKE2b. Medians printed,
everything written to ``--out`` as JSON. The store's directory is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
from bench import machine_info  # noqa: E402

from ft_agent.snapshot import SnapshotStore, load, verify_slot  # noqa: E402
from ft_agent.snapshot_format import crc32  # noqa: E402

TENSORS = 20


def state_of(mb: int, step: int) -> dict[str, Any]:
    per = mb * 2**20 // 4 // TENSORS
    g = torch.Generator().manual_seed(step)
    return {"model": {f"layer{i}": torch.randn(per, generator=g) for i in range(TENSORS)},
            "rng": torch.get_rng_state(), "iteration": step}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bounds(mb: int, repeat: int = 3) -> dict[str, Any]:
    """Memory bandwidth and checksum speed over the same amount of bytes."""
    src = torch.randn(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    raw = memoryview(src.numpy()).cast("B")
    copy = [timed(lambda: dst.copy_(src)) for _ in range(repeat)]
    crc = [timed(lambda: crc32(raw)) for _ in range(repeat)]
    stdlib = [timed(lambda: zlib.crc32(raw)) for _ in range(repeat)]
    blake = [timed(lambda: hashlib.blake2b(raw, digest_size=16).digest()) for _ in range(repeat)]
    fresh = [timed(lambda: torch.empty_like(src).copy_(src)) for _ in range(repeat)]
    med = statistics.median
    return {
        "copy_into_reused_buffer_s": med(copy), "copy_into_fresh_buffer_s": med(fresh),
        "crc32_s": med(crc), "crc32_stdlib_zlib_s": med(stdlib), "blake2b_s": med(blake),
        "copy_gib_per_s": round(mb / 1024 / med(copy), 2),
        "crc32_gib_per_s": round(mb / 1024 / med(crc), 2),
        "crc32_stdlib_zlib_gib_per_s": round(mb / 1024 / med(stdlib), 2),
        "blake2b_gib_per_s": round(mb / 1024 / med(blake), 2),
        "runs": {"copy": copy, "fresh": fresh, "crc32": crc, "crc32_stdlib_zlib": stdlib,
                 "blake2b": blake},
    }


def measure(mb: int, runs: int, root: Path) -> dict[str, Any]:
    directory = root / "rank_0"
    per_run = []
    with SnapshotStore(directory) as store:
        first = store.snapshot(state_of(mb, 0), 0, wait=True)
        first_write = store.wait()
        for step in range(1, runs + 1):
            state = state_of(mb, step)
            status = store.snapshot(state, step, wait=True)
            result = store.wait()
            assert status.started and result is not None and result.ok, (status, result)
            start = time.perf_counter()
            assert verify_slot(directory, status.slot) is None
            verify_s = time.perf_counter() - start
            snap = load(directory)
            assert snap.iteration == step
            assert torch.equal(snap.state["model"]["layer0"], state["model"]["layer0"])
            per_run.append({"iteration": step, "bytes": status.bytes,
                            "blocking_s": round(status.blocking_s, 4),
                            "write_s": round(result.seconds, 4),
                            "launcher_verify_s": round(verify_s, 4),
                            "restore_s": round(snap.seconds, 4)})
            del snap, state
        fresh = [restore_in_new_process(directory) for _ in range(runs)]
    med = {k: statistics.median(r[k] for r in per_run)
           for k in ("blocking_s", "write_s", "launcher_verify_s", "restore_s")}
    med["restore_new_process_s"] = statistics.median(fresh)
    return {"first": {"blocking_s": round(first.blocking_s, 4),
                      "write_s": round(first_write.seconds, 4)},
            "runs": per_run, "restore_new_process_s": fresh, "median": med}


# torch first, as in a rank: ft_agent.snapshot imports it on first use, not at its import.
LOAD_CHILD = ("import sys, torch; from ft_agent.snapshot import load; "
              "print(load(sys.argv[1]).seconds)")


def restore_in_new_process(directory: Path) -> float:
    """load() as a restarted rank does it: in a process whose memory is all fresh."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    out = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(directory)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return round(float(out.stdout.strip()), 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="state size in MB (default 200)")
    ap.add_argument("--runs", type=int, default=5, help="measured snapshots (default 5)")
    ap.add_argument("--out", type=Path, default=HERE / "snapshot_cost.json")
    args = ap.parse_args(argv)
    if args.mb < 1 or args.runs < 1:
        ap.error("--mb and --runs must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="ft-snapshot-bench-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        machine = machine_info()
        result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "machine": machine, "torch_threads": torch.get_num_threads(),
                  "command": shlex.join(["python", "scripts/bench/snapshot_cost.py",
                                         *(argv if argv is not None else sys.argv[1:])]),
                  "state": {"mb": args.mb, "dtype": "float32", "tensors": TENSORS,
                            "store": "/dev/shm (tmpfs)"},
                  "snapshot": measure(args.mb, args.runs, root),
                  "bounds": bounds(args.mb)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    m, b = result["snapshot"]["median"], result["bounds"]
    print(f"{args.mb} MB float32, median of {args.runs}: snapshot() blocks "
          f"{m['blocking_s'] * 1000:.0f} ms, background commit {m['write_s'] * 1000:.0f} ms, "
          f"launcher's check {m['launcher_verify_s'] * 1000:.0f} ms, "
          f"restore {m['restore_s'] * 1000:.0f} ms (in a new process "
          f"{m['restore_new_process_s'] * 1000:.0f} ms)")
    print(f"bounds: copy into a reused buffer {b['copy_into_reused_buffer_s'] * 1000:.0f} ms "
          f"({b['copy_gib_per_s']} GiB/s), into a fresh one "
          f"{b['copy_into_fresh_buffer_s'] * 1000:.0f} ms; CRC32 {b['crc32_gib_per_s']} GiB/s "
          f"(stdlib zlib {b['crc32_stdlib_zlib_gib_per_s']} GiB/s), "
          f"BLAKE2b {b['blake2b_gib_per_s']} GiB/s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
