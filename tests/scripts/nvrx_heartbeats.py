"""DDP training that uses the heartbeat API the way NVRx's train_ddp_heartbeats_api.py does.

Written against NVRx's names (only the import differs): the timeouts are calculated once
``hb_timeouts.are_valid`` is False after the first epoch, ``state_dict()`` is saved in each
checkpoint and loaded on resume, and a simulated fault is armed once the timeouts are
valid. Small and quick: gloo on CPU, a tiny model, a few steps per epoch.

Usage: nvrx_heartbeats.py OUTPUT_DIR [--epochs N] [--iters N] [--step-time S]
       [--simulated_fault TYPE,DELAY]  (TYPE rank_killed or rank_hung; the last rank fails)
Records what the client reported, as JSON, in OUTPUT_DIR/record_c<cycle>_r<rank>_<what>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import ft_agent as fault_tolerance  # was: import nvidia_resiliency_ext.fault_tolerance

CYCLE = int(os.environ.get("FT_CYCLE", "0"))
_sim_fault_is_set = False
_sim_fault_canceled = False


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--simulated_fault", default=None)
    return parser.parse_args()


def record(out: Path, what: str, client: fault_tolerance.RankMonitorClient, **extra) -> None:
    hb = client.hb_timeouts
    data = {"str": str(hb), "initial": hb.initial, "subsequent": hb.subsequent,
            "are_valid": hb.are_valid, "were_calculated": hb.were_calculated,
            "is_initialized": client.is_initialized, "state": client.state_dict(), **extra}
    name = f"record_c{CYCLE}_r{dist.get_rank()}_{what}.json"
    (out / name).write_text(json.dumps(data))


def save_checkpoint(path: Path, progress: dict, model: nn.Module, client) -> dict:
    state = {"progress": dict(progress), "model_state": model.state_dict(),
             "ft_state": client.state_dict()}
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()
    return state["ft_state"]


def setup_simulated_fault(desc: str) -> None:
    global _sim_fault_is_set
    _sim_fault_is_set = True
    fault_type, _, delay = desc.partition(",")
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    sig = {"rank_killed": signal.SIGKILL, "rank_hung": signal.SIGSTOP}[fault_type]

    def fault() -> None:
        time.sleep(float(delay))
        if not _sim_fault_canceled:
            print(f"Simulating fault: {fault_type}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)

    threading.Thread(target=fault, daemon=True).start()


def main() -> None:
    global _sim_fault_canceled
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    para_model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = {"epoch_idx": 0, "iter_idx": 0}
    checkpoint_path = out / "checkpoint.pt"

    ft_client = fault_tolerance.RankMonitorClient()
    ft_client.init_workload_monitoring()
    record(out, "init", ft_client)

    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, weights_only=True)
        model.load_state_dict(checkpoint["model_state"])
        ft_client.load_state_dict(checkpoint["ft_state"])
        progress.update(checkpoint["progress"])
        record(out, "loaded", ft_client, checkpoint_ft_state=checkpoint["ft_state"])

    for epoch_idx in range(progress["epoch_idx"], args.epochs):
        for iter_idx in range(progress["iter_idx"], args.iters):
            if ft_client.hb_timeouts.are_valid is False and epoch_idx == 1 and iter_idx == 1:
                # After a whole epoch and a checkpoint: the longest intervals were seen.
                ft_client.calculate_and_set_hb_timeouts()
                record(out, "calculated", ft_client)
            optimizer.zero_grad()
            loss = para_model(torch.randn(4, 16)).pow(2).mean()
            loss.backward()
            optimizer.step()
            time.sleep(args.step_time)
            progress["iter_idx"] = iter_idx + 1
            ft_client.send_heartbeat()
        progress["epoch_idx"] += 1
        progress["iter_idx"] = 0
        saved = save_checkpoint(checkpoint_path, progress, model, ft_client)
        record(out, f"saved_e{epoch_idx}", ft_client, saved=saved)
        if args.simulated_fault and not _sim_fault_is_set and ft_client.hb_timeouts.are_valid:
            setup_simulated_fault(args.simulated_fault)

    _sim_fault_canceled = True
    record(out, "done", ft_client)
    ft_client.shutdown_workload_monitoring()
    dist.barrier()  # leave together: a torn-down gloo peer aborts the other
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
