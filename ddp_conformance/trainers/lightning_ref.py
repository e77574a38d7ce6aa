"""The Lightning reference: a LightningModule + `Trainer(strategy=DDPStrategy(...))`, made faithful.

It runs *inside* ranks the harness already started: torch.distributed is initialised, so Lightning's
DDPStrategy reuses the default group (`_init_dist_connection` returns early; MASTER_ADDR/MASTER_PORT
are not read). `LOCAL_RANK` must be in the environment, or Lightning's default launcher re-executes
`sys.argv` (i.e. pytest) in new processes; `fit` sets it from the rank context when missing. Strategy
teardown deletes `WORLD_SIZE` from the environment, and Lightning may set `PL_GLOBAL_SEED` and
friends, so every Trainer run restores the environment it found (ranks are reused across tests).

Out of the box Lightning 2.6 does not resume faithfully (measured in seeds/README.md). This
reference closes both gaps with Lightning's own mechanisms:
- RNG: `RngStateCallback` puts every rank's torch/numpy/python RNG state into the checkpoint
  (`Callback.state_dict`) and restores this rank's state right before the first batch after a
  resume (`on_train_batch_start`), the same point in the step sequence where it was captured.
- Data position: the train loader is a `ResumableLoader` (state_dict/load_state_dict), which the fit
  loop saves and restores (Lightning >= 2.2), over a `DistributedSampler` the module builds itself
  from the config (seed, shuffle, drop_last); Lightning keeps a DistributedSampler it is given and
  calls `set_epoch` on it every epoch.
- Checkpoints: `trainer.save_checkpoint` at step k (rank 0 writes, all ranks barrier), through an
  `AtomicCheckpointIO` plugin (temp file + os.replace), loaded with `fit(ckpt_path=...)`.

Measured (CPU, gloo, fp32, dropout 0.3, checkpoint mid-epoch at step 5 of 12): the resumed run equals
the uninterrupted one bit for bit at world sizes 1 and 2 (parameters, AdamW state, StepLR state,
counters, every loss); the same holds for the torch reference, and both references produce identical
losses and parameters for the same config. At world size 4 both differ by up to 1.2e-7: gloo's ring
all-reduce order depends on DDP's bucket layout, which a fresh DDP only rebuilds after its first
iteration; no trainer can avoid that without changing DDP.

Known differences from the torch reference: the model is the LightningModule (`state_dict` keys
`net.0.weight`); TrainState's epoch/position are read from the resumable loader, because Lightning's
`current_epoch` is already incremented when `max_steps` stops it mid-epoch. Broken variants are
subclasses too: override `callbacks` (drop RngStateCallback), `build_loader` (a plain DataLoader),
`strategy`, or set `module_class` to a RefModule subclass (e.g. one whose `on_save_checkpoint`
drops the optimizer states).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..adapter import FitObserver, RankContext, StepInfo, TrainState
from ..config import RunConfig
from .torch_ref import (
    ResumableLoader,
    TorchTrainer,
    atomic_save,
    build_mlp,
    cpu_copy,
    gather_rng_states,
    restore_rng_state,
    rng_state_for_rank,
    seed_all,
    seeded,
    split_batch,
    static_graph,
)

_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
_NOISE = (
    r".*does not have many workers.*",
    r".*Consider setting `persistent_workers=True`.*",
    r".*The number of training batches .* is smaller than the logging interval.*",
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
)


class RefModule(pl.LightningModule):
    """The same MLP, loss and optimizer as the torch reference, as a LightningModule."""

    def __init__(self, config: RunConfig, reduction: str = "mean") -> None:
        super().__init__()
        self.config = config
        self.reduction = reduction
        self.net = build_mlp(config.model)
        self.train_loader: DataLoader | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss_of(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Forward through `model` (this module, or DDP around it) and the batch-mean loss."""
        _, x, y = batch
        return F.cross_entropy(model(x).float(), y, reduction=self.reduction)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss_of(self, batch)

    def configure_optimizers(self) -> Any:
        optim = self.config.optim
        optimizer = torch.optim.AdamW(self.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
        sched = optim.scheduler
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=sched.step_size, gamma=sched.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        assert self.train_loader is not None, "LightningTrainer sets the loader before fit"
        return self.train_loader


class RngStateCallback(pl.Callback):
    """Carries every rank's RNG state through Lightning checkpoints, which hold none of their own."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        # dump_checkpoint runs on every rank (only rank 0 writes), so this collective is safe
        return {"ranks": gather_rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = rng_state_for_rank(state_dict["ranks"], self.rank)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.pending is not None:
            restore_rng_state(self.pending)
            self.pending = None


class StepCheckpoint(pl.Callback):
    """`trainer.save_checkpoint` right after optimizer step k (where ModelCheckpoint would save)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path, self.saved = step, path, False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.saved and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            self.saved = True


class Recorder(pl.Callback):
    """Feeds the observer, records losses, captures the DDP model (the strategy unwraps it after
    fit) and the final optimizer/scheduler state before teardown."""

    def __init__(self, adapter: LightningTrainer, observer: FitObserver | None) -> None:
        self.adapter, self.observer = adapter, observer
        self.info: StepInfo | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.adapter.wrapped = trainer.strategy.model
        if self.observer is not None:
            self.observer.on_wrapped(trainer.strategy.model)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        loop = trainer.fit_loop.epoch_loop
        accumulate = trainer.accumulate_grad_batches
        position = loop.batch_progress.current.ready - 1
        last = position + 1 >= trainer.num_training_batches
        self.info = StepInfo(rank=trainer.global_rank, epoch=trainer.current_epoch,
                             global_step=trainer.global_step, position=position, batch_size=len(batch[0]),
                             optimizer_step=last or (position + 1) % accumulate == 0)
        if self.observer is not None:
            self.observer.before_step(self.info)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # automatic optimization hands back the loss divided by accumulate_grad_batches
        value = float(loss.detach()) * trainer.accumulate_grad_batches
        self.adapter.losses.append(value)
        if self.observer is not None and self.info is not None:
            self.observer.after_step(replace(self.info, loss=value))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        epoch, position = data_position(trainer, pl_module)
        self.adapter.final = TrainState(
            params=cpu_copy(pl_module.state_dict()),
            optimizer=cpu_copy(trainer.optimizers[0].state_dict()),
            scheduler=cpu_copy(scheduler.state_dict()) if scheduler is not None else None,
            epoch=epoch,
            global_step=trainer.global_step,
            position=position,
        )


def data_position(trainer: pl.Trainer, module: pl.LightningModule) -> tuple[int, int]:
    """(epoch, micro-batches consumed in it) of the data stream, as the torch reference counts them.

    Lightning's own `current_epoch` is already incremented when `max_steps` stops it mid-epoch, so
    the position is read from the resumable loader when there is one (a finished epoch counts as
    the start of the next).
    """
    loader = getattr(module, "train_loader", None)
    if isinstance(loader, ResumableLoader):
        state = loader.state_dict()
        if state["position"] >= len(loader):
            return state["epoch"] + 1, 0
        return state["epoch"], state["position"]
    return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.completed


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


@contextlib.contextmanager
def lightning_environment(local_rank: int) -> Iterator[None]:
    """Run a Trainer in a harness rank: LOCAL_RANK present, Lightning quiet, env restored after."""
    saved_env = dict(os.environ)
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for pattern in _NOISE:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)


class LightningTrainer(TorchTrainer):
    """Adapter around `RefModule` + `lightning.pytorch.Trainer`. Data, sampler and loader come from
    the torch reference (same dataset, same DistributedSampler rules); model, loss, wrapping, the
    step and the whole fit go through Lightning."""

    name = "lightning"
    module_class: type[RefModule] = RefModule

    def setup(self, config: RunConfig, ctx: RankContext) -> None:
        super().setup(config, ctx)
        self.module: RefModule | None = None
        self.final: TrainState | None = None

    # --- data: Lightning calls set_epoch itself, through this very function ------------------------

    def set_epoch(self, loader: DataLoader, epoch: int) -> None:
        _set_sampler_epoch(loader, epoch)

    # --- model, loss, one step --------------------------------------------------------------------

    def make_model(self) -> nn.Module:
        module = seeded(self.config.seed, lambda: self.module_class(self.config, self.reduction))
        return module.to(self.device)

    def precision_plugin(self) -> Precision:
        precision = self.config.trainer.precision
        if precision in ("bf16-mixed", "16-mixed"):
            return MixedPrecision(precision, device=self.device.type)  # type: ignore[arg-type]
        return Precision()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        module = model.module if isinstance(model, DistributedDataParallel) else model
        with self.precision_plugin().forward_context():
            return module.loss_of(model, self.to_device(batch))  # type: ignore[operator]

    def strategy(self) -> DDPStrategy:
        return RefDDPStrategy(**self.ddp_kwargs())

    def wrap(self, model: nn.Module) -> nn.Module:
        """As `DDPStrategy._setup_model` does: DDP(module, device_ids, **strategy kwargs)."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module=model, device_ids=device_ids, **self.strategy()._ddp_kwargs)

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """One optimizer step's gradients, as Lightning's automatic optimization computes them:
        loss / accumulate_grad_batches, no_sync on all micro-batches but the last, then the
        module's `on_after_backward`."""
        module = model.module if isinstance(model, DistributedDataParallel) else model
        parts = split_batch(batch, self.config.trainer.accumulate_grad_batches)
        total = torch.zeros(())
        for i, micro in enumerate(parts):
            with self.sync_context(model, i == len(parts) - 1):
                loss = self.loss(model, micro)
                (loss / len(parts)).backward()
            module.on_after_backward()
            total += loss.detach().float().cpu() / len(parts)
        return total

    # --- fit / resume -------------------------------------------------------------------------------

    def callbacks(self, observer: FitObserver | None) -> list[pl.Callback]:
        return [RngStateCallback(self.ctx.rank), Recorder(self, observer)]

    def make_trainer(self, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
        trainer = self.config.trainer
        return pl.Trainer(
            accelerator="gpu" if self.device.type == "cuda" else "cpu",
            devices=self.ctx.world_size // self.ctx.num_nodes,
            num_nodes=self.ctx.num_nodes,
            strategy=self.strategy(),
            precision=trainer.precision,  # type: ignore[arg-type]
            sync_batchnorm=trainer.sync_batchnorm and self.device.type == "cuda",
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            max_steps=steps,
            max_epochs=-1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
            default_root_dir=str(self.ctx.workdir),
        )

    def _prepare(self) -> RefModule:
        module = self.make_model()
        assert isinstance(module, RefModule)
        dataset = self.make_dataset()
        # epoch 0 here; Lightning sets the epoch itself at the start of every epoch
        module.train_loader = self.build_loader(dataset, self.make_sampler(dataset, self.ctx.rank,
                                                                             self.ctx.world_size))
        self.module = self.model = module
        return module

    def _fit(self, steps: int, callbacks: list[pl.Callback], ckpt_path: Path | None) -> TrainState:
        module = self.module
        assert module is not None
        with lightning_environment(self.ctx.local_rank):
            trainer = self.make_trainer(steps, callbacks)
            trainer.fit(module, ckpt_path=str(ckpt_path) if ckpt_path is not None else None,
                        weights_only=True)
        assert self.final is not None, "Lightning finished without calling on_train_end"
        self.final.losses = list(self.losses)
        self.final.checkpoint = self.checkpoint_file
        return self.final

    def fit(self, steps: int, *, checkpoint_dir: Path | None = None, checkpoint_at: int | None = None,
            observer: FitObserver | None = None) -> TrainState:
        seed_all(self.config.seed)
        self._prepare()
        callbacks = self.callbacks(observer)
        if checkpoint_at is not None:
            if checkpoint_dir is None:
                raise ValueError("checkpoint_at needs checkpoint_dir")
            self.checkpoint_file = Path(checkpoint_dir) / f"{self.name}-step{checkpoint_at}.ckpt"
            callbacks.append(StepCheckpoint(checkpoint_at, self.checkpoint_file))
        return self._fit(steps, callbacks, None)

    def resume(self, checkpoint: Path, steps: int, *, observer: FitObserver | None = None) -> TrainState:
        self._prepare()
        return self._fit(steps, self.callbacks(observer), Path(checkpoint))

    def state(self) -> TrainState:
        if self.final is None:
            raise RuntimeError("no fit has run yet")
        return self.final

    # the torch loop's pieces do not apply: Lightning owns the loop and the checkpoint format
    def checkpoint_payload(self) -> dict[str, Any]:
        raise NotImplementedError("Lightning writes its own checkpoints")

    def __repr__(self) -> str:
        return f"<LightningTrainer rank={getattr(self, 'ctx', None) and self.ctx.rank}>"

