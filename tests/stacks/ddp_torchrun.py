"""A torchrun script in the manner of PyTorch's DDP examples, for the real-stacks tests.

Written for ``torchrun`` alone: a DDP model, a DistributedSampler, a checkpoint file
written by rank 0 every ``--save-every`` epochs and loaded at start when it exists.
ft_agent is imported only behind ``--ft`` (as a user would add it), so run without the flag
the script never talks to the launcher, though its source names ft_agent. ``--compile``
puts the model under ``torch.compile`` before DDP wraps it.

    torchrun --nproc-per-node 2 tests/stacks/ddp_torchrun.py --epochs 20
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--save-every", type=int, default=2, help="checkpoint every N epochs")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-time", type=float, default=0.02, help="extra seconds per step")
    p.add_argument("--checkpoint", default=None, help="[FT_RUN_DIR or .]/ddp_checkpoint.pt")
    p.add_argument("--ft", action="store_true", help="heartbeats through ft_agent")
    p.add_argument("--compile", action="store_true", help="the model under torch.compile")
    return p.parse_args()


class Trainer:
    """One rank's training: epochs over its shard, a checkpoint now and then."""

    def __init__(self, args: argparse.Namespace, client: object | None) -> None:
        self.args, self.client = args, client
        self.rank = dist.get_rank()
        self.path = Path(args.checkpoint or Path(os.environ.get("FT_RUN_DIR", "."))
                         / "ddp_checkpoint.pt")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 20, generator=g)
        self.data = TensorDataset(x, x.sum(dim=1, keepdim=True))
        self.sampler = DistributedSampler(self.data)
        self.loader = DataLoader(self.data, batch_size=args.batch_size, sampler=self.sampler)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1))
        self.epochs_run = 0
        if self.path.exists():
            saved = torch.load(self.path, weights_only=True)
            model.load_state_dict(saved["model"])
            self.epochs_run = saved["epochs_run"]
            print(f"[rank {self.rank}] resuming from the checkpoint at epoch {self.epochs_run}",
                  flush=True)
        self.module = model  # what the checkpoint holds, compiled or not
        self.model = DDP(torch.compile(model) if args.compile else model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        for x, y in self.loader:
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            time.sleep(self.args.step_time)
            if self.client is not None:
                self.client.send_heartbeat()

    def save(self, epoch: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({"model": self.module.state_dict(), "epochs_run": epoch}, tmp)
        os.replace(tmp, self.path)
        print(f"[rank 0] epoch {epoch} saved to {self.path}", flush=True)

    def train(self) -> None:
        for epoch in range(self.epochs_run, self.args.epochs):
            self.epoch(epoch)
            if self.rank == 0 and (epoch + 1) % self.args.save_every == 0:
                self.save(epoch + 1)
        print(f"[rank {self.rank}] trained {self.args.epochs} epochs", flush=True)


def main() -> None:
    args = parse_args()
    client = None
    if args.ft:
        import ft_agent

        client = ft_agent.RankMonitorClient()
        client.init_workload_monitoring()
    dist.init_process_group("gloo")
    Trainer(args, client).train()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
