"""A transformers `Trainer` script, as such scripts come: flags into `TrainingArguments`, a linear LR
decay to `--max_steps`, `checkpoint-<step>` every `--save_steps` under `--output_dir`, and a resume
through `trainer.train(resume_from_checkpoint=...)` (weights, optimizer, scheduler, every rank's RNG
state, and the batches the epoch already trained, skipped).

    torchrun --nproc_per_node 2 train.py --max_steps 100 --output_dir out --save_steps 50
    torchrun --nproc_per_node 2 train.py --max_steps 100 --output_dir out --resume_from_checkpoint out/checkpoint-50

A tiny GPT-2 built from a config and synthetic tokens: no download, CPU. Nothing here knows about
ddp-conformance: pytest.ini beside it names this script by its command line.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

SEED, SAMPLES, LENGTH, BATCH_SIZE, LR = 0, 64, 16, 4, 1e-2
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokens(Dataset):
    """Synthetic token sequences, the same on every rank (drawn from a generator seeded alike)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(SEED)
        self.ids = torch.randint(0, 64, (SAMPLES, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=BATCH_SIZE,
        learning_rate=LR, lr_scheduler_type="linear", seed=SEED, report_to=[], logging_strategy="no",
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True)
    set_seed(SEED)  # before the model: two fits from scratch start alike
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=LENGTH))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)


if __name__ == "__main__":
    main()
