"""The Lightning reference: the generic Lightning adapter on a reference module and datamodule.

`LightningTrainer` is `LightningAdapter` (what `--ddp-trainer lightning:...` builds for a user's
module) around `RefModule` + `RefDataModule`, which train the torch reference's network on its data
with its sampler, optimizer and scheduler, so that for the same config both references produce
identical losses and parameters. What makes it faithful is exactly what a user adds, one line each:
- `RNGStateCallback()` in the Trainer's callbacks (`trainer_kwargs`): every rank's RNG state in the
  checkpoint, restored right before the first batch after a resume;
- `ResumableDataLoader(...)` as the train loader (`build_loader`): Lightning's fit loop saves its
  position in the epoch and restores it, so a mid-epoch resume continues with the next batch.
Two choices are the reference's own, not a user's: `RefDDPStrategy` (no `no_sync` under
static_graph, see below) and `AtomicCheckpointIO` (temp file + os.replace).

Measured (CPU, gloo, fp32, dropout 0.3, checkpoint mid-epoch at step 5 of 12): the resumed run equals
the uninterrupted one bit for bit at world sizes 1 and 2 (parameters, AdamW state, StepLR state,
counters, every loss). At world size 4 both references differ by up to 1.2e-7: gloo's ring
all-reduce order depends on DDP's bucket layout, which a fresh DDP only rebuilds after its first
iteration; no trainer can avoid that without changing DDP.

Broken variants are subclasses: override `trainer_kwargs` (no RNGStateCallback), `build_loader` (a
plain DataLoader), `strategy`, or set `module_class` to a RefModule subclass.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from ..config import RunConfig
from ..lightning import RNGStateCallback
from .lightning_adapter import LightningAdapter, LightningBuild
from .torch_ref import ReferenceData, atomic_save, build_mlp, static_graph

FIT_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(pl.Trainer.fit).parameters  # Lightning >= 2.6


class RefModule(pl.LightningModule):
    """The same MLP, loss and optimizer as the torch reference, as a LightningModule."""

    def __init__(self, config: RunConfig, reduction: str = "mean") -> None:
        super().__init__()
        self.config = config
        self.reduction = reduction
        self.net = build_mlp(config.model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        return F.cross_entropy(self(x).float(), y, reduction=self.reduction)

    def configure_optimizers(self) -> Any:
        optim = self.config.optim
        optimizer = torch.optim.AdamW(self.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
        sched = optim.scheduler
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=sched.step_size, gamma=sched.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RefDataModule(pl.LightningDataModule):
    """The torch reference's data: its dataset, its DistributedSampler (the config's seed, shuffle and
    drop_last; Lightning keeps a DistributedSampler it is given and calls `set_epoch` on it) and the
    loader its adapter builds."""

    def __init__(self, adapter: LightningTrainer) -> None:
        super().__init__()
        self.adapter = adapter

    def train_dataloader(self) -> DataLoader:
        dataset = self.adapter.make_dataset()
        sampler = self.adapter.make_sampler(dataset, self.trainer.global_rank, self.trainer.world_size)
        return self.adapter.build_loader(dataset, sampler)


class RefDDPStrategy(DDPStrategy):
    """DDPStrategy that does not use `no_sync` when static_graph is on (pytorch #143580: the first
    backward of a fresh DDP under no_sync fails an internal assert; stock Lightning hits it with
    `static_graph=True` and `accumulate_grad_batches > 1`). Same rule as the torch reference."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        if static_graph(self.model):
            yield None
            return
        with super().block_backward_sync():
            yield None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, writing to a temp file and renaming it into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        atomic_save(checkpoint, Path(path))


class LightningTrainer(ReferenceData, LightningAdapter):
    """The generic Lightning adapter on `RefModule` + `RefDataModule`."""

    name = "lightning"
    module_class: type[RefModule] = RefModule
    reduction = "mean"

    def build(self) -> LightningBuild:
        return LightningBuild(self.module_class(self.config, self.reduction), RefDataModule(self),
                              self.trainer_arguments())

    def trainer_arguments(self) -> dict[str, Any]:
        """What the reference's own training script would pass to its Trainer."""
        return {"callbacks": [RNGStateCallback()]}

    # --- the reference's own choices ----------------------------------------------------------------

    def strategy(self) -> DDPStrategy:
        return RefDDPStrategy(**self.config.trainer.strategy.ddp_kwargs())

    def plugins(self) -> list[Any]:
        return [AtomicCheckpointIO()]

    def sync_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if static_graph(model) else super().sync_context(model, sync)

    def fit_arguments(self) -> dict[str, Any]:
        """`weights_only=True`: the reference's checkpoints hold tensors and plain values only. Trainer.fit
        takes it since Lightning 2.6; before, the checkpoint loads with torch.load's own default."""
        return {"weights_only": True} if FIT_TAKES_WEIGHTS_ONLY else {}
