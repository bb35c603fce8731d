"""A small Lightning training on CPU (DDP, gloo) with ft_agent's FaultToleranceCallback.

Run it under ft_launcher; it checkpoints every --ckpt-every steps and resumes from the last
checkpoint after a restart:

    FAULT_TOL_FINISHED_FLAG_FILE=/tmp/ft_demo/finished \\
    ft_launcher --nproc-per-node 2 --max-restarts 2 --ft-run-dir /tmp/ft_demo/run \\
        --ft-rank-heartbeat-timeout 5 \\
        examples/train_lightning.py --max-steps 60 --fault rank_killed --fault-delay 3 \\
        --autoresume --calculate-timeouts --exp-dir /tmp/ft_demo/exp

The data of step N is generated from a seed, so a resumed run computes what an
uninterrupted one would. It also runs as plain ``python examples/train_lightning.py``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import time
import warnings
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ft_agent.lightning import FaultToleranceCallback, SimulatedFaultParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=60, help="total training steps")
    p.add_argument("--ckpt-every", type=int, default=5, help="checkpoint interval (steps)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoints [FT_RUN_DIR/ckpt]")
    p.add_argument("--exp-dir", default=None,
                   help="the callback's exp_dir (ft_state/ lives under it) [trainer.log_dir]")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    p.add_argument("--val-every", type=int, default=10, help="validate every N steps")
    p.add_argument("--max-time", type=float, default=None,
                   help="stop after this many seconds (Lightning max_time)")
    p.add_argument("--autoresume", action="store_true",
                   help="create FAULT_TOL_FINISHED_FLAG_FILE when training is complete")
    p.add_argument("--calculate-timeouts", action="store_true")
    p.add_argument("--fault", choices=("random", "rank_killed", "rank_hung"), default=None,
                   help="simulated fault through the callback (first cycle only)")
    p.add_argument("--fault-delay", type=float, default=3.0, help="seconds after train start")
    p.add_argument("--fault-rand-delay", type=float, default=0.0)
    p.add_argument("--fault-rank", type=int, default=None, help="victim [drawn]")
    p.add_argument("--fault-every-cycle", action="store_true",
                   help="re-arm the fault in every restarted cycle")
    p.add_argument("--raise-at-step", type=int, default=None,
                   help="rank --raise-rank raises RuntimeError at this step (first cycle only)")
    p.add_argument("--raise-rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class Regression(LightningModule):
    """A linear regression with a per-step delay, so faults land mid-training."""

    def __init__(self, step_time: float, raise_at_step: int | None, raise_rank: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.step_time = step_time
        self.raise_at_step = raise_at_step
        self.raise_rank = raise_rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        step = self.global_step + 1
        if (self.raise_at_step == step and self.global_rank == self.raise_rank
                and cycle() == 0):
            raise RuntimeError(f"deliberate failure at step {step} in rank {self.global_rank}")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.step_time:
            time.sleep(self.step_time)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Progress(Callback):
    """One line per event that the end-to-end tests read from the rank logs."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        print(f"rank {trainer.global_rank} cycle {cycle()} train_start global_step "
              f"{trainer.global_step}", flush=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        print(f"rank {trainer.global_rank} cycle {cycle()} train_end global_step "
              f"{trainer.global_step}", flush=True)


def cycle() -> int:
    return int(os.environ.get("FT_CYCLE", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def data(seed: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.5)


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(args.seed)
    ckpt_dir = Path(args.ckpt_dir or Path(os.environ.get("FT_RUN_DIR", ".")) / "ckpt")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    fault = None
    if args.fault:
        fault = SimulatedFaultParams(args.fault, args.fault_delay, args.fault_rand_delay,
                                     args.fault_rank, args.fault_every_cycle)
    ft_callback = FaultToleranceCallback(
        autoresume=args.autoresume,
        calculate_timeouts=args.calculate_timeouts,
        simulated_fault_params=fault,
        exp_dir=args.exp_dir,
    )
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every,
                                  save_top_k=1, save_last=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=local_world,
        num_nodes=nodes,
        strategy=DDPStrategy(process_group_backend="gloo") if local_world * nodes > 1
        else "auto",
        max_steps=args.max_steps,
        max_time=datetime.timedelta(seconds=args.max_time) if args.max_time else None,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[ft_callback, checkpoints, Progress()],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=ckpt_dir.parent,
    )
    model = Regression(args.step_time, args.raise_at_step, args.raise_rank)
    train = DataLoader(data(args.seed, 512), batch_size=8)
    val = DataLoader(data(args.seed + 1, 64), batch_size=8)
    last = ckpt_dir / "last.ckpt"
    trainer.fit(model, train, val, ckpt_path=str(last) if last.exists() else None)


if __name__ == "__main__":
    main()
