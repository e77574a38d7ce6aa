"""The repo's LightningDataModule, as in any Lightning project: ddp-conformance checks it as it is.

One line is there for a faithful resume: Lightning continues an epoch in the middle only with a train
loader that has `state_dict`/`load_state_dict`; a plain `DataLoader` replays the epoch's first batches.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset, random_split

from ddp_conformance.lightning import ResumableDataLoader


class LitDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.seed)  # the same data on every rank
        x = torch.randn(96, 8, generator=generator)
        y = (x[:, :4].sum(dim=1) > x[:, 4:].sum(dim=1)).long()
        self.train_set, self.val_set = random_split(TensorDataset(x, y), [64, 32], generator=generator)

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
