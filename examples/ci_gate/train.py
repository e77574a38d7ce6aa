"""Your training code, as it already exists: data, model, loss, a hand-written DDP loop, checkpoints.

Nothing in this file knows about ddp-conformance; `conformance_adapter.py` beside it is all it takes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build_dataset(size: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, 8, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    return TensorDataset(torch.arange(size), x, y)  # each sample carries its index


def build_loader(dataset: TensorDataset, rank: int, world_size: int, epoch: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=4, sampler=sampler)


def build_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # same weights on every rank, global RNG untouched
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def compute_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    _, x, y = batch
    device = next(model.parameters()).device  # the rank's GPU under nccl, the CPU under gloo
    return F.cross_entropy(model(x.to(device)), y.to(device))


def train(model, optimizer, dataset, rank, world_size, step, until, checkpoint_every=0, checkpoint_dir=None) -> int:
    """Train from optimizer step `step` to `until`, saving a checkpoint every `checkpoint_every` steps."""
    per_epoch = len(build_loader(dataset, rank, world_size, 0))
    while step < until:
        epoch, done = divmod(step, per_epoch)
        for position, batch in enumerate(build_loader(dataset, rank, world_size, epoch)):
            if position < done:
                continue  # already trained on before the checkpoint
            optimizer.zero_grad()
            compute_loss(model, batch).backward()
            optimizer.step()
            step += 1
            if checkpoint_every and step % checkpoint_every == 0:
                save_checkpoint(Path(checkpoint_dir) / f"step{step}.pt", model, optimizer, step)
            if step >= until:
                break
    return step


def save_checkpoint(path: Path, model: nn.Module, optimizer, step: int) -> None:
    if dist.get_rank() == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    dist.barrier()
