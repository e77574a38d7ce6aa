"""A Hugging Face accelerate training script, in the shape of accelerate's `*_no_trainer` examples:
`Accelerator.prepare`, `accelerator.backward`, a linear LR decay to `--max_train_steps`, `save_state`
every `--checkpointing_steps` into `step_<k>`, and a resume that loads the state and skips the
batches the epoch already trained (`skip_first_batches`).

    accelerate launch --num_processes 2 train.py --max_train_steps 100 --output_dir out --checkpointing_steps 50
    accelerate launch --num_processes 2 train.py --max_train_steps 100 --output_dir out \
        --resume_from_checkpoint out/step_50

A tiny GPT-2 built from a config and synthetic tokens: no download, CPU. Nothing here knows about
ddp-conformance: pytest.ini beside it names this script by its command line.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

SEED, SAMPLES, LENGTH, BATCH_SIZE, LR = 0, 64, 16, 4, 1e-2
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_train_steps", type=int, required=True)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--checkpointing_steps", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    return parser.parse_args()


def tokens() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randint(0, 64, (SAMPLES, LENGTH), generator=generator))


def main() -> None:
    args = parse_args()
    # a seedable sampler: the shuffle follows the seed and the epoch, so a resume reshuffles the same way
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(SEED)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=LENGTH)
    model = GPT2LMHeadModel(config)
    # a generator of its own: without one, each pass of the loader draws its seed from the global RNG, at the
    # epoch's start in an uninterrupted run but after load_state in a resumed one (dropout then draws one off)
    loader = DataLoader(tokens(), batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # the prepared scheduler steps once per process at every optimizer step (accelerate's examples scale it so)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, args.max_train_steps * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        step = int(Path(args.resume_from_checkpoint).name.removeprefix("step_"))
    model.train()
    while step < args.max_train_steps:
        epoch, done = divmod(step, len(loader))
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader
        for (batch,) in batches:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if args.checkpointing_steps and step % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{step}"))
            if step >= args.max_train_steps:
                break
    accelerator.end_training()


if __name__ == "__main__":
    main()
