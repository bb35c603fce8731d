"""DDP training that uses the sections API the way NVRx's train_ddp_sections_api.py does.

Written against NVRx's names (only the import differs): an ``init`` section around start-up
and checkpoint loading, ``step`` around every training and validation step, ``checkpoint``
around saving; each section's timeout is calculated once it was observed and the FT state
is saved to OUTPUT_DIR/ft_state.json (JSON, as NVRx's example does) and loaded at start.

Usage: nvrx_sections.py OUTPUT_DIR [--epochs N] [--iters N] [--exit-after-epoch E]
``--exit-after-epoch E``: in cycle 0 the last rank exits with 3 after epoch E (a crash).
Records the section timeouts the client reported in OUTPUT_DIR/record_c<cycle>_r<rank>_*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import ft_agent as fault_tolerance  # was: import nvidia_resiliency_ext.fault_tolerance

CYCLE = int(os.environ.get("FT_CYCLE", "0"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--exit-after-epoch", type=int, default=None)
    return parser.parse_args()


def record(out: Path, what: str, client) -> None:
    sec = client.section_timeouts
    data = {"str": str(sec), "section": sec.section, "out_of_section": sec.out_of_section,
            "calculated_sections": sorted(sec.calculated_sections),
            "is_out_of_section_calculated": sec.is_out_of_section_calculated,
            "are_valid": sec.are_valid, "state": client.state_dict()}
    (out / f"record_c{CYCLE}_r{dist.get_rank()}_{what}.json").write_text(json.dumps(data))


def maybe_load_ft_state(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def save_ft_state(client, path: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(client.state_dict()))
        os.replace(tmp, path)
    dist.barrier()


def update_ft_section_timeouts(client, selected, calc_out_of_section, path: Path) -> None:
    client.calculate_and_set_section_timeouts(selected_sections=selected,
                                              calc_out_of_section=calc_out_of_section)
    save_ft_state(client, path)


def main() -> None:
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    ft_state_path = out / "ft_state.json"
    checkpoint_path = out / "checkpoint.pt"

    ft_client = fault_tolerance.RankMonitorClient()
    ft_state = maybe_load_ft_state(ft_state_path)
    if ft_state:
        # NVRx allows this before init_workload_monitoring: in force once connected.
        ft_client.load_state_dict(ft_state)
    ft_client.init_workload_monitoring()
    record(out, "init", ft_client)

    ft_client.start_section("init")
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    progress = {"epoch_idx": 0}
    is_checkpoint_loaded = False
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, weights_only=True)
        model.load_state_dict(checkpoint["model_state"])
        progress.update(checkpoint["progress"])
        is_checkpoint_loaded = True
    para_model = nn.parallel.DistributedDataParallel(model)
    ft_client.end_section("init")

    if is_checkpoint_loaded:
        # The init section included loading a checkpoint: a representative time.
        update_ft_section_timeouts(ft_client, ["init"], False, ft_state_path)

    for epoch_idx in range(progress["epoch_idx"], args.epochs):
        for _ in range(args.iters):
            ft_client.start_section("step")
            optimizer.zero_grad()
            para_model(torch.randn(4, 16)).pow(2).mean().backward()
            optimizer.step()
            time.sleep(0.02)
            ft_client.end_section("step")
        update_ft_section_timeouts(ft_client, ["step"], False, ft_state_path)
        with torch.no_grad():  # validation steps share the "step" section
            for _ in range(2):
                ft_client.start_section("step")
                model(torch.randn(4, 16))
                ft_client.end_section("step")
        progress["epoch_idx"] = epoch_idx + 1
        ft_client.start_section("checkpoint")
        dist.barrier()
        if dist.get_rank() == 0:
            torch.save({"progress": progress, "model_state": model.state_dict()},
                       checkpoint_path)
        dist.barrier()
        ft_client.end_section("checkpoint")
        update_ft_section_timeouts(ft_client, ["checkpoint"], False, ft_state_path)
        record(out, f"epoch{epoch_idx}", ft_client)
        if CYCLE == 0 and epoch_idx == args.exit_after_epoch and \
                dist.get_rank() == dist.get_world_size() - 1:
            os._exit(3)

    # The out-of-section timeout is calculated when the run ends normally.
    update_ft_section_timeouts(ft_client, [], True, ft_state_path)
    record(out, "done", ft_client)
    ft_client.shutdown_workload_monitoring()
    dist.barrier()  # leave together: a torn-down gloo peer aborts the other
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
