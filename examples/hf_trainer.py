"""A Hugging Face Trainer script: a tiny GPT-2 on random tokens, on CPU, entirely offline.

It is written as a plain HF script (no ft_agent), so it runs unchanged under ``python``,
``torchrun`` and ``ft_launcher``; it checkpoints every ``--save-steps`` and, when a
checkpoint exists in ``--output-dir``, resumes from the newest one:

    ft_launcher --nproc-per-node 2 --max-restarts 2 \\
        --ft-simulated-fault rank_killed:base_delay=30,rank=1 \\
        examples/hf_trainer.py --max-steps 600

``--ft-callback`` adds ``ft_agent.transformers.FaultToleranceCallback``: heartbeats,
progress and checkpoint reports, and in-memory snapshots of the Trainer's state after each
step, so a restart resumes from the last step instead of the last checkpoint (with
``--ft-snapshot-every`` given to the launcher).

The model is built from a config (no download) and the data are seeded random tokens, so
every rank of every restart sees the same data; ``HF_HUB_OFFLINE=1`` is set for the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default=None,
                   help="checkpoints [FT_RUN_DIR/hf_trainer, else ./hf_trainer_out]")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument("--save-steps", type=int, default=50, help="a disk checkpoint every N steps")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="per device")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--samples", type=int, default=4096, help="random sequences in the dataset")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds per step (a sleep), so that a fault at a given time "
                        "lands mid-training on a fast machine too")
    p.add_argument("--ft-callback", action="store_true",
                   help="add ft_agent.transformers.FaultToleranceCallback")
    return p.parse_args(argv)


class RandomTokens(torch.utils.data.Dataset):
    """``samples`` sequences of random token ids, each a function of the seed and its index."""

    def __init__(self, samples: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (samples, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTime(TrainerCallback):
    """Sleeps after each optimizer step (``--step-time``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def output_dir(args: argparse.Namespace) -> Path:
    if args.output_dir:
        return Path(args.output_dir)
    run_dir = os.environ.get("FT_RUN_DIR")
    return Path(run_dir) / "hf_trainer" if run_dir else Path("hf_trainer_out")


def build_trainer(args: argparse.Namespace,
                  callbacks: Sequence[TrainerCallback] = ()) -> Trainer:
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.width,
                        n_layer=args.layers, n_head=2, bos_token_id=0, eos_token_id=0,
                        loss_type="ForCausalLM")
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(output_dir(args)),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        warmup_steps=10,
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=args.logging_steps,
        seed=args.seed,
        use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
        report_to="none",
        disable_tqdm=True,
    )
    extra = list(callbacks)
    if args.step_time > 0:
        extra.append(StepTime(args.step_time))
    if args.ft_callback:
        from ft_agent.transformers import FaultToleranceCallback

        extra.append(FaultToleranceCallback())
    data = RandomTokens(args.samples, args.seq_len, config.vocab_size, args.seed)
    return Trainer(model=model, args=training, train_dataset=data, callbacks=extra)


def main(argv: Sequence[str] | None = None,
         callbacks: Sequence[TrainerCallback] = ()) -> int:
    """Train to ``--max-steps``, resuming from the newest checkpoint in the output dir.
    ``callbacks`` are added to the Trainer's (the benchmark adds its step clock)."""
    args = parse_args(argv)
    trainer = build_trainer(args, callbacks)
    last = get_last_checkpoint(trainer.args.output_dir) \
        if os.path.isdir(trainer.args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    state = trainer.state
    print(f"rank {trainer.args.process_index} trained to global_step {state.global_step} "
          f"(resumed from {last or 'the start'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
