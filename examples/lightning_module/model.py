"""The repo's LightningModule, as in any Lightning project: ddp-conformance checks it as it is.

One line is there for a faithful resume: Lightning checkpoints hold no RNG state, so without
`RNGStateCallback` a run resumed from a checkpoint draws other dropout masks than the run it continues.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from ddp_conformance.lightning import RNGStateCallback


class LitClassifier(pl.LightningModule):
    def __init__(self, lr: float = 0.01, dropout: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]

    def configure_callbacks(self) -> list[pl.Callback]:
        return [RNGStateCallback()]  # every rank's RNG state in each checkpoint, restored on resume
