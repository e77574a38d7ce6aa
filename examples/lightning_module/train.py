"""Train the repo's model: `torchrun --nproc_per_node 2 train.py` (or `python train.py` on one process)."""

from __future__ import annotations

import lightning.pytorch as pl
from data import LitDataModule
from model import LitClassifier


def main() -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", max_epochs=4, log_every_n_steps=4)
    trainer.fit(LitClassifier(), LitDataModule())


if __name__ == "__main__":
    main()
