"""A plain-torch Trainer class, in the shape of PyTorch's DDP tutorial: the model, loader and
optimizer come in, `train()` runs epochs, snapshots are written at epoch ends (rank 0) and read back.

Nothing here knows about ddp-conformance; `conformance_adapter.py` beside it is all it takes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(size: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, 8, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def make_loader(dataset: TensorDataset) -> DataLoader:
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(0))


def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


class Trainer:
    def __init__(self, model: nn.Module, loader: DataLoader, snapshot_path: str) -> None:
        self.model = DistributedDataParallel(model)
        self.loader = loader
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.snapshot_path = Path(snapshot_path)
        self.epochs_run = 0
        if self.snapshot_path.exists():
            self._load_snapshot()

    def _load_snapshot(self) -> None:
        snapshot = torch.load(self.snapshot_path, weights_only=True)
        self.model.module.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _save_snapshot(self, epoch: int) -> None:
        if dist.get_rank() == 0:
            snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                        "EPOCHS_RUN": epoch}
            torch.save(snapshot, f"{self.snapshot_path}.tmp")
            os.replace(f"{self.snapshot_path}.tmp", self.snapshot_path)
        dist.barrier()

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        F.cross_entropy(self.model(source), targets).backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        self.loader.sampler.set_epoch(epoch)
        for source, targets in self.loader:
            self._run_batch(source, targets)

    def train(self, max_epochs: int, save_every: int = 1) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if save_every and (epoch + 1) % save_every == 0:
                self._save_snapshot(epoch + 1)
