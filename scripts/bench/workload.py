"""The one workload every launcher runs in the benchmark: a small DDP training on gloo.

It runs unchanged under ft_launcher, torchrun and NVRx's ft_launcher; only the heartbeat
client differs (``--client ours|nvrx|none``). It imports nothing from this repository unless
``--client ours``, so it also runs in NVRx's own virtualenv.

What the driver reads is appended, one JSON object per line, to the file named by
``--events`` (small ``O_APPEND`` writes, so ranks never interleave within a line):

- ``{"ev": "pid", ...}`` once per process, before anything slow, so the driver can signal it;
- ``{"ev": "first_step", "t": <unix time>, "step": <n>, "source": ...}`` after the first
  training step of a process (``source``: where it resumed from: ``snapshot``, ``disk`` or
  ``none``);
- ``{"ev": "ready", ...}`` (idle mode) after the first heartbeat;
- ``{"ev": "hb_stats", ...}`` (heartbeat mode) the per-call cost of ``send_heartbeat()``;
- ``{"ev": "done", ...}`` when the training finished.

Every record carries ``rank``, ``cycle`` and ``pid``. The same facts go to stdout as one line
each (``FIRST_STEP <unix time> rank=<r> cycle=<c>``), flushed, for a person reading the log.

Modes: ``train`` (DDP steps, checkpoint every ``--ckpt-every`` steps, resume after a restart;
``--sections``: each step in a ``compute`` section; ``--snapshots``: with ``--client ours``,
also an in-memory snapshot every step, restored before the disk checkpoint; ``--compile``:
the model under ``torch.compile``),
``heartbeat`` (time ``--calls`` heartbeats and exit) and ``idle`` (heartbeat at ``--hz`` for
``--duration`` seconds, no compute: the footprint measure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WARMUP_CALLS = 100  # heartbeats before timing starts: first sends set up buffers and caches


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("train", "heartbeat", "idle"), default="train")
    p.add_argument("--client", choices=("ours", "nvrx", "none"), default="none")
    p.add_argument("--events", required=True, help="JSONL file the driver reads")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.02, help="extra seconds per step")
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory [no checkpoints]")
    p.add_argument("--calls", type=int, default=10_000, help="heartbeat mode: timed calls")
    p.add_argument("--hz", type=float, default=10.0, help="idle mode: heartbeats per second")
    p.add_argument("--duration", type=float, default=60.0, help="idle mode: seconds")
    p.add_argument("--sections", action="store_true",
                   help="train mode: each step in a 'compute' section (clients that have them)")
    p.add_argument("--hb-mark", default=None,
                   help="train mode: after each send_heartbeat() returns, write 'count "
                        "call_time return_time' (unix seconds) over this file ({rank}: the "
                        "rank), for a driver that stops the rank right after a call")
    p.add_argument("--snapshots", action="store_true",
                   help="train mode, --client ours: offer the client a snapshot of the model, "
                        "the optimizer and the step after every step, and resume from "
                        "client.restore() when it returns one, before the disk checkpoint")
    p.add_argument("--state-mb", type=int, default=0,
                   help="train mode: this many MB of extra float32 state per rank, changed "
                        "every step and kept in each checkpoint and snapshot (the cost of "
                        "saving a large model without the compute of training one)")
    p.add_argument("--compile", action="store_true",
                   help="train mode: the model under torch.compile (inductor, the default "
                        "backend), then wrapped in DDP")
    p.add_argument("--light", action="store_true",
                   help="train mode without torch: a step is the sleep alone, the checkpoint a "
                        "JSON file (the smoke test's quick variant; the benchmark never uses it)")
    return p.parse_args()


class _NoClient:
    """torchrun has no heartbeat client: every call does nothing."""

    def init_workload_monitoring(self) -> None:
        pass

    def send_heartbeat(self) -> None:
        pass

    def shutdown_workload_monitoring(self) -> None:
        pass


def make_client(kind: str) -> Any:
    """ours = ft_agent's client, nvrx = NVRx's client, none = no client."""
    if kind == "ours":
        from ft_agent import RankMonitorClient

        return RankMonitorClient()
    if kind == "nvrx":
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        return RankMonitorClient()
    return _NoClient()


class Recorder:
    """Appends one JSON line per record to the events file and echoes it to stdout."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank = int(os.environ.get("RANK", "0"))
        # ours sets FT_CYCLE; torchrun and NVRx count restarts in TORCHELASTIC_RESTART_COUNT.
        self.cycle = int(os.environ.get("FT_CYCLE",
                                        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def __call__(self, ev: str, **fields: Any) -> None:
        record = {"ev": ev, "t": time.time(), "rank": self.rank, "cycle": self.cycle,
                  "pid": os.getpid(), **fields}
        os.write(self.fd, (json.dumps(record) + "\n").encode())
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"{ev.upper()} {record['t']:.6f} rank={self.rank} cycle={self.cycle} {extra}",
              flush=True)


def run_heartbeat(client: Any, record: Recorder, calls: int) -> None:
    """Time ``calls`` back-to-back heartbeats, one clock read around each; every one is
    sent (ours folds heartbeats closer than 0.04 s: that is timed too, as ``fold_``)."""
    fold_s = getattr(client, "heartbeat_fold_s", None)
    if fold_s is not None:
        client.heartbeat_fold_s = 0.0
    costs = _time_heartbeats(client, calls)
    folded: dict[str, float] = {}
    if fold_s is not None:
        client.heartbeat_fold_s = fold_s
        folded = _stats(_time_heartbeats(client, calls), "fold_")
    record("hb_stats", calls=calls, **_stats(costs), **folded, **_section_stats(client, calls))


def _time_heartbeats(client: Any, calls: int) -> list[int]:
    for _ in range(WARMUP_CALLS):
        client.send_heartbeat()
    clock = time.perf_counter_ns
    costs = [0] * calls
    for i in range(calls):
        t0 = clock()
        client.send_heartbeat()
        costs[i] = clock() - t0
    return costs


def _stats(costs_ns: list[int], prefix: str = "") -> dict[str, float]:
    us = sorted(c / 1000 for c in costs_ns)
    return {f"{prefix}p50_us": round(us[len(us) // 2], 3),
            f"{prefix}p99_us": round(us[min(len(us) - 1, int(0.99 * len(us)))], 3),
            f"{prefix}mean_us": round(statistics.fmean(us), 3),
            f"{prefix}max_us": round(us[-1], 3)}


def _section_stats(client: Any, calls: int) -> dict[str, Any]:
    """The same, for one ``start_section`` + ``end_section`` pair (what straggler detection
    adds per step), where the client has sections; ``section_note`` says why not."""
    if not hasattr(client, "start_section"):
        return {"section_note": "no sections in this client"}
    clock = time.perf_counter_ns
    costs = [0] * calls
    try:
        for _ in range(WARMUP_CALLS):
            client.start_section("compute")
            client.end_section("compute")
        for i in range(calls):
            t0 = clock()
            client.start_section("compute")
            client.end_section("compute")
            costs[i] = clock() - t0
    except Exception as exc:  # noqa: BLE001 - another launcher's client: record, go on
        return {"section_note": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return _stats(costs, "sec_")


def run_idle(client: Any, record: Recorder, hz: float, duration: float) -> None:
    """Heartbeat at a fixed rate for a bounded time, doing nothing else."""
    period = 1.0 / hz
    client.send_heartbeat()
    record("ready")
    deadline = time.monotonic() + duration
    next_beat = time.monotonic() + period
    while time.monotonic() < deadline:
        time.sleep(max(0.0, next_beat - time.monotonic()))
        next_beat += period
        client.send_heartbeat()


class HeartbeatMark:
    """``send_heartbeat()`` that also writes, once it returns, how many calls were made and
    when the last one was called and returned, over one fixed-width line (a reader retries
    a line it finds torn)."""

    def __init__(self, client: Any, path: str | None, rank: int) -> None:
        self.client, self.calls = client, 0
        self.fd = None if path is None else os.open(
            path.replace("{rank}", str(rank)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def __call__(self) -> None:
        called = time.time()
        self.client.send_heartbeat()
        if self.fd is not None:
            self.calls += 1
            line = f"{self.calls:12d} {called:.6f} {time.time():.6f}\n"
            os.pwrite(self.fd, line.encode(), 0)


def resume_point(client: Any, snapshots: bool, disk: Callable[[], tuple[Any, int] | None]
                 ) -> tuple[Any, int, str]:
    """(state, step, source) a cycle resumes from: the in-memory snapshot the client restores
    (``snapshots``; a client without ``restore`` has none), else ``disk()``'s checkpoint,
    else nothing (``None, 0, "none"``)."""
    restored = client.restore() if snapshots and hasattr(client, "restore") else None
    if restored is not None:
        state, step = restored
        return state, int(step), "snapshot"
    found = disk()
    if found is not None:
        return found[0], found[1], "disk"
    return None, 0, "none"


def offer_snapshot(client: Any, snapshots: bool, state: Callable[[], Any], step: int) -> None:
    """Hand the client this step's state (its --ft-snapshot-every decides whether it is
    taken; the state is built only when snapshots are on)."""
    if snapshots and hasattr(client, "snapshot"):
        client.snapshot(state(), step)


def run_train(client: Any, record: Recorder, args: argparse.Namespace) -> None:
    """DDP training that checkpoints every ``--ckpt-every`` steps and resumes from it."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # outside the model: DDP would broadcast a buffer of the model at every step
    ballast = torch.zeros(args.state_mb * 2**18)

    def saved() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict(), "ballast": ballast}
    ckpt = Path(args.ckpt_dir) / "ckpt.pt" if args.ckpt_dir else None
    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)

    def disk() -> tuple[Any, int] | None:
        if ckpt is None or not ckpt.exists():
            return None
        saved = torch.load(ckpt, weights_only=True)
        return saved, saved["step"]

    state, start, source = resume_point(client, args.snapshots, disk)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        ballast.copy_(state["ballast"])
    # Compiled first, then wrapped: the model's graph goes through inductor (C++ kernels
    # on CPU), and DDP's hooks stay outside it.
    net = torch.compile(model) if args.compile else model
    ddp = DistributedDataParallel(net) if world > 1 else net
    gen = torch.Generator().manual_seed(record.rank)
    sections = args.sections and hasattr(client, "start_section")
    heartbeat = HeartbeatMark(client, args.hb_mark, record.rank)
    for step in range(start + 1, args.steps + 1):
        if sections:
            client.start_section("compute")
        x = torch.randn(32, 16, generator=gen)
        loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ballast.numel():
            ballast[step % ballast.numel()] += 1.0
        if step == start + 1:
            record("first_step", step=step, source=source)
        if args.step_time:
            time.sleep(args.step_time)
        if sections:
            client.end_section("compute")
        heartbeat()
        offer_snapshot(client, args.snapshots, saved, step)
        if ckpt is not None and (step % args.ckpt_every == 0 or step == args.steps):
            if record.rank == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({**saved(), "step": step}, tmp)
                os.replace(tmp, ckpt)  # a kill mid-save never leaves a torn checkpoint
            if world > 1:
                dist.barrier()
    record("done", steps=args.steps, resumed_from=start)
    if world > 1:
        dist.destroy_process_group()


def run_light(client: Any, record: Recorder, args: argparse.Namespace) -> None:
    """The train mode's control flow without torch: steps, checkpoints, resume, records."""
    ckpt = Path(args.ckpt_dir) / "light.json" if args.ckpt_dir else None

    def disk() -> tuple[Any, int] | None:
        if ckpt is None or not ckpt.exists():
            return None
        step = json.loads(ckpt.read_text())["step"]
        return {"step": step}, step

    _, start, source = resume_point(client, args.snapshots, disk)
    sections = args.sections and hasattr(client, "start_section")
    heartbeat = HeartbeatMark(client, args.hb_mark, record.rank)
    for step in range(start + 1, args.steps + 1):
        if sections:
            client.start_section("compute")
        if step == start + 1:
            record("first_step", step=step, source=source)
        time.sleep(args.step_time)
        if sections:
            client.end_section("compute")
        heartbeat()
        offer_snapshot(client, args.snapshots, lambda s=step: {"step": s}, step)
        if ckpt is not None and record.rank == 0 and (
                step % args.ckpt_every == 0 or step == args.steps):
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, ckpt)
    record("done", steps=args.steps, resumed_from=start)


def main() -> None:
    args = parse_args()
    record = Recorder(args.events)
    record("pid", master_addr=os.environ.get("MASTER_ADDR", ""))
    client = make_client(args.client)
    client.init_workload_monitoring()
    if args.mode == "heartbeat":
        run_heartbeat(client, record, args.calls)
    elif args.mode == "idle":
        run_idle(client, record, args.hz, args.duration)
    elif args.light:
        run_light(client, record, args)
    else:
        run_train(client, record, args)
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
