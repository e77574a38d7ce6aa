"""Any LightningModule (+ LightningDataModule), checked under Lightning's own Trainer: no adapter code.

`--ddp-trainer lightning:pkg.model:LitModel+pkg.data:LitData` (see `spec.py` for every form) builds a
`LightningAdapter` on those classes. Every answer a check asks for comes from Lightning doing what
it does in a real fit, observed through public hooks, never re-implemented:

- data (`make_dataset`, `make_loader`, `batch_indices`, `collate`): a *probe*, one short
  `Trainer.fit` (one batch in each of three epochs) whose callback reads `trainer.train_dataloader` at
  every epoch's first batch: the loader Lightning built from `train_dataloader()`, with its
  DistributedSampler injected, as the fit reads it, after Lightning's `set_epoch` and every
  `on_train_epoch_start` (the module's own may tell a hand-written batch sampler its epoch). The epoch's batches
  are read from that loader's batch sampler (indices into its `dataset`), so no sample has to carry
  its index; `collate` is the loader's `collate_fn`. The module and datamodule are built, and the
  fit runs, from the rank's own RNG state with no `seed_everything` (as in a fresh torchrun process
  that never seeds), so data generated without a seed shows in data_consistency. A probe is a fit,
  hence collective: `make_loader` answers for this rank only.
- model, loss, one step: the module's own `training_step`, run as the DDP model's forward (as
  Lightning's strategies run it, so DDP prepares its reducer), inside the precision plugin's context,
  then `on_before_backward`, `backward`, `on_after_backward`; accumulation as Lightning's automatic
  optimization does it (loss / accumulate_grad_batches, `no_sync` but on the last micro-batch).
- fit / resume: `Trainer(strategy=DDPStrategy(**the config's DDP kwargs), precision, accumulate...,
  max_steps)` fits the module and datamodule; `ModelCheckpoint(every_n_train_steps=k)` writes the
  checkpoint (at step k only: `StepCheckpoint`), `fit(ckpt_path=...)` resumes. A `Recorder`
  callback feeds the check's FitObserver and keeps the final state. Every fit starts with
  `seed_everything(config.seed)`, as a training script does, and builds the module and datamodule
  from that seed in a forked RNG (so the module's initialisation draws nothing from the stream
  training uses, as in the torch reference); a resumed fit too, but from the datamodule's `setup`
  on it trains with the RNG the restarted process has (the check's), unless the trainer restores
  its own (`ddp_conformance.lightning.RNGStateCallback`).

The harness decides what its runs need (devices, strategy, max_steps, checkpointing, no logger, no
validation); a factory's Trainer arguments add the rest (gradient clipping, callbacks, plugins...).
The run config (`--ddp-config`) owns `precision` and `accumulate_grad_batches`: a factory that sets
them differently is stopped with one line, because the checks judge with the config's values. A
factory's `strategy=DDPStrategy(find_unused_parameters=True, ...)` (or a registered name,
"ddp_find_unused_parameters_true") keeps its DDP kwargs, in the fits and in the checks' own DDP
steps (`wrap`), with the config's on top; a key the two set differently, a strategy that is no
DDPStrategy, or a comm hook / model averaging (which the checks' own DDP steps cannot carry) is one
line saying where the setting belongs (`merged_ddp_kwargs`).

It runs inside ranks the harness already started, so Lightning's DDPStrategy reuses the default
process group; `LOCAL_RANK` must be in the environment or Lightning's launcher would re-execute
pytest, and strategy teardown deletes `WORLD_SIZE`: every Trainer run goes through
`lightning_environment`, which sets the one and restores the whole environment afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

from ..adapter import FitObserver, NotProvided, RankContext, StepInfo, TrainerAdapter, TrainState
from ..config import RunConfig
from ..resumable import capture_rng_state, restore_rng_state
from ..runner.rank import fault_handlers
from .lightning_parts import LightningParts
from .torch_ref import cpu_copy, seeded

PROBE_EPOCHS = 3  # sampler_disjointness reads epochs 0, 1 and 2
_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
_NOISE = (
    r".*does not have many workers.*",
    r".*Consider setting `persistent_workers=True`.*",
    r".*The number of training batches .* is smaller than the logging interval.*",
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
    r".*You are trying to `self.log\(\)` but the `self.trainer` reference is not registered.*",
    r".*Checkpoint directory .* exists and is not empty.*",
    r".*You're resuming from a checkpoint that ended before the epoch ended.*",
    r".*callbacks used to create the checkpoint need to be provided during `Trainer` instantiation.*",
)
#: Trainer arguments the harness decides, whatever a factory says
HARNESS_KEYS = frozenset({
    "accelerator", "devices", "num_nodes", "strategy", "max_steps", "max_epochs", "min_steps", "min_epochs",
    "max_time", "limit_train_batches", "limit_val_batches", "num_sanity_val_steps", "fast_dev_run",
    "enable_checkpointing", "logger", "enable_progress_bar", "enable_model_summary", "default_root_dir",
    "sync_batchnorm", "overfit_batches", "val_check_interval", "check_val_every_n_epoch"})
_PRECISION = {32: "32-true", "32": "32-true", "32-true": "32-true", 16: "16-mixed", "16": "16-mixed",
              "16-mixed": "16-mixed", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}


@dataclass
class LightningBuild:
    """One fresh module, its datamodule (None: the module's own `train_dataloader`) and Trainer args."""

    module: pl.LightningModule
    datamodule: pl.LightningDataModule | None = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def unpack(result: Any, spec: str) -> LightningBuild:
    """A factory's return value as `LightningBuild`, or one line saying what it should have returned."""
    if isinstance(result, pl.LightningModule):
        return LightningBuild(result)
    if isinstance(result, tuple) and len(result) in (2, 3):
        module, datamodule, *rest = result
        kwargs = rest[0] if rest else {}
        if (isinstance(module, pl.LightningModule) and isinstance(kwargs, Mapping)
                and (datamodule is None or isinstance(datamodule, pl.LightningDataModule))):
            return LightningBuild(module, datamodule, dict(kwargs))
    shown = f"a tuple of {', '.join(type(v).__name__ for v in result)}" if isinstance(result, tuple) \
        else type(result).__name__
    raise TypeError(f"trainer SPEC {spec!r}: the factory returned {shown}; expected a LightningModule, "
                    "(module, datamodule) or (module, datamodule, trainer_kwargs)")


# what a DDPStrategy holds besides DDP's kwargs that would change training, and the checks' own DDP cannot carry
_UNCARRIED = {"_ddp_comm_hook": "ddp_comm_hook", "_ddp_comm_wrapper": "ddp_comm_wrapper",
              "_model_averaging_period": "model_averaging_period"}


def merged_ddp_kwargs(strategy: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The DDP kwargs of a factory's `strategy` Trainer argument (a DDPStrategy, or a registered name:
    "ddp_find_unused_parameters_true") kept, with the run config's (`config`: the keys its file sets)
    on top. Where the two set one key differently, or the strategy is no DDPStrategy, or it holds a
    setting the checks' own DDP cannot carry, one line says where the setting belongs."""
    from lightning.pytorch.strategies import StrategyRegistry  # deferred: torch is heavy to import

    if strategy is None or strategy in ("auto", "ddp"):
        return dict(config)
    shown = repr(strategy) if isinstance(strategy, str) else f"{type(strategy).__name__}(...)"
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        strategy = StrategyRegistry.get(strategy)
    if not isinstance(strategy, DDPStrategy):
        raise ValueError(f"the trainer's arguments set strategy={shown}, which is not Lightning's DDPStrategy: the "
                         "checks run the fit under DDPStrategy, so leave strategy out of the Trainer arguments (DDP's "
                         "settings go in the --ddp-config file's trainer.strategy)")
    if not hasattr(strategy, "_ddp_kwargs") or not all(hasattr(strategy, name) for name in _UNCARRIED):
        raise AssertionError("lightning's DDPStrategy no longer keeps _ddp_kwargs / its comm hook where "
                             "ddp_conformance.trainers.lightning_adapter reads them: update merged_ddp_kwargs")
    for attribute, argument in _UNCARRIED.items():
        if getattr(strategy, attribute) is not None:
            raise ValueError(f"the trainer's DDPStrategy sets {argument}, which the checks' own DDP steps cannot "
                             f"carry (they would judge gradients without it): leave it out to check this trainer")
    theirs = dict(strategy._ddp_kwargs)
    for key, value in theirs.items():
        if key in config and config[key] != value:
            raise ValueError(f"the trainer's DDPStrategy sets {key}={value!r} but the run config says {config[key]!r}: "
                             f"the checks judge with the config's, so set trainer.strategy.{key} in the --ddp-config "
                             "file (or leave it out there)")
    return {**theirs, **config}


# ---------------------------------------------------------------------------------------------------
# Running Lightning inside a harness rank


@contextlib.contextmanager
def lightning_environment(local_rank: int) -> Iterator[None]:
    """Run a Trainer in a harness rank: LOCAL_RANK present, Lightning quiet, env restored after."""
    saved_env = dict(os.environ)
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with quiet():
            yield
    finally:
        fault_handlers.rearm()  # the fit's teardown reset them: a hang in the next fit keeps its stacks
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's warnings that say nothing about the trainer under check."""
    with warnings.catch_warnings():
        for pattern in _NOISE:
            warnings.filterwarnings("ignore", message=pattern)
        yield


def call_as_forward(wrapper: nn.Module, module: nn.Module, method: str, *args: Any) -> Any:
    """`module.<method>(*args)` run as the forward of `wrapper` (DDP around `module`), as Lightning's
    strategies run `training_step`: DDP's forward prepares the reducer for the backward that follows.
    The real `forward` is back in place when the method runs (it may call `self(x)`)."""
    if wrapper is module:
        return getattr(module, method)(*args)
    patched = "forward" in vars(module)
    original = module.forward

    def forward(*inner: Any, **kwargs: Any) -> Any:
        _unpatch(module, patched, original)
        return getattr(module, method)(*inner, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    try:
        return wrapper(*args)
    finally:
        _unpatch(module, patched, original)


def _unpatch(module: nn.Module, had_attribute: bool, original: Any) -> None:
    if had_attribute:
        module.forward = original  # type: ignore[method-assign]
    else:
        vars(module).pop("forward", None)


def step_loss(output: Any) -> torch.Tensor | None:
    """The loss in what `training_step` returned: a tensor, or a mapping's "loss"; None otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of a (nested) batch, depth first."""
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def batch_size_of(batch: Any) -> int:
    tensor = first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() else 1


def split_batch(batch: Any, parts: int) -> list[Any]:
    """A (nested) batch cut into `parts` micro-batches along dim 0 of every tensor, empty ones dropped."""
    if parts == 1:
        return [batch]

    def take(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim():
            return torch.tensor_split(value, parts)[i]
        if isinstance(value, Mapping):
            return {k: take(v, i) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [take(v, i) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    pieces = [take(batch, i) for i in range(parts)]
    return [p for p in pieces if batch_size_of(p)] if first_tensor(batch) is not None else pieces


def states(items: Sequence[Any]) -> dict[str, Any] | None:
    """One state dict per optimizer/scheduler, the lone one as is (None: there is none)."""
    found = [cpu_copy(item.state_dict()) for item in items]
    if not found:
        return None
    return found[0] if len(found) == 1 else {str(i): s for i, s in enumerate(found)}


# ---------------------------------------------------------------------------------------------------
# Callbacks: what the harness observes and sets, through Lightning's public hooks


class Recorder(pl.Callback):
    """Feeds the check's observer around every micro-batch, records the losses, captures the DDP
    model (the strategy unwraps it after fit) and the final state before teardown."""

    def __init__(self, adapter: LightningAdapter, observer: FitObserver | None) -> None:
        self.adapter, self.observer = adapter, observer
        self.info: StepInfo | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.adapter.wrapped = trainer.strategy.model
        if self.observer is not None:
            self.observer.on_wrapped(trainer.strategy.model)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        last = batch_idx + 1 >= trainer.num_training_batches
        self.info = StepInfo(rank=trainer.global_rank, epoch=trainer.current_epoch, global_step=trainer.global_step,
                             position=batch_idx, batch_size=batch_size_of(batch),
                             optimizer_step=last or (batch_idx + 1) % trainer.accumulate_grad_batches == 0)
        if self.observer is not None:
            self.observer.before_step(self.info)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = step_loss(outputs)
        # automatic optimization hands back the loss divided by accumulate_grad_batches
        value = None if loss is None else float(loss.detach()) * trainer.accumulate_grad_batches
        if value is not None:
            self.adapter.losses.append(value)
        if self.observer is not None and self.info is not None:
            self.observer.after_step(replace(self.info, loss=value))
            # Lightning's own way to end a fit early (as EarlyStopping does); min_steps/min_epochs still hold
            if self.info.optimizer_step and self.observer.stop_requested():
                trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch, position = self.data_position(trainer)
        self.adapter.final = TrainState(
            params=cpu_copy(pl_module.state_dict()), optimizer=states(trainer.optimizers) or {},
            scheduler=states([config.scheduler for config in trainer.lr_scheduler_configs]),
            epoch=epoch, global_step=trainer.global_step, position=position)

    def data_position(self, trainer: pl.Trainer) -> tuple[int, int]:
        """(epoch, micro-batches consumed in it), from the last batch seen: a finished epoch counts
        as the start of the next (Lightning's `current_epoch` already counts a stopped one)."""
        if self.info is None:
            return trainer.current_epoch, 0
        position = self.info.position + 1
        if position >= trainer.num_training_batches:
            return self.info.epoch + 1, 0
        return self.info.epoch, position


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, saving right after optimizer step `step` and at no other
    (`every_n_train_steps` alone would save again at every multiple of it)."""

    def __init__(self, dirpath: Path, step: int) -> None:
        super().__init__(dirpath=dirpath, every_n_train_steps=step)
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step <= self.step:
            super().on_train_batch_end(trainer, *args, **kwargs)


class InstallRNG(pl.Callback):
    """Gives a resumed fit the RNG state its process had (the check's) once the datamodule is set
    up: a restarted script's datamodule is built and set up from its seed, its training is not."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        restore_rng_state(self.state)


class ReadLoader(pl.Callback):
    """The probe's eyes: each epoch, the train loader Lightning prepared, and the dataset indices of
    each of that epoch's batches, read as the fit reads them: at the epoch's first batch, after every
    epoch-start hook has run (Lightning's `set_epoch`, then the callbacks' and the module's own
    `on_train_epoch_start`, where a module tells a hand-written batch sampler its epoch)."""

    def __init__(self) -> None:
        self.loader: DataLoader | None = None
        self.epochs: list[list[list[int]]] = []
        self.problem = ""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if len(self.epochs) > trainer.current_epoch or self.problem:
            return  # this epoch's batches are read already
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            self.problem = f"its train_dataloader() gives {type(loader).__name__}, not one DataLoader"
        elif isinstance(loader.dataset, IterableDataset):
            self.problem = "its train loader reads an IterableDataset, whose samples have no index"
        else:
            self.loader = loader
            batches = loader.batch_sampler if loader.batch_sampler is not None else ([i] for i in loader.sampler)
            self.epochs.append([[int(i) for i in batch] for batch in batches])


def _reads_without_training(module: pl.LightningModule) -> None:
    """Have the probe's fit end each epoch at its first batch, before the training step, and skip the
    module's hooks after training: the probe reads the loader (`ReadLoader`, a callback, runs first), so
    a step would be paid for nothing (0.35 s a step for Lightning's demo transformer). -1 from the
    module's `on_train_batch_start` is Lightning's documented way to skip the rest of an epoch; the
    module's own hook still runs first."""
    own = module.on_train_batch_start

    def read_only(batch: Any, batch_idx: int) -> int:
        own(batch, batch_idx)
        return -1

    module.on_train_batch_start = read_only  # type: ignore[method-assign]
    # what follows an epoch's or the fit's training is the module's work on steps the probe never trained:
    # a collective there (a gather on the global zero alone) would hang the probe, which no fit watch guards
    for hook in ("on_train_epoch_end", "on_train_end", "on_fit_end"):
        setattr(module, hook, _nothing)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@dataclass
class ProbedEpochs:
    loader: DataLoader
    epochs: list[list[list[int]]]


class EpochBatches(list):
    """One epoch of a rank's batches, each the list of its dataset indices (`len` is the epoch's)."""


# ---------------------------------------------------------------------------------------------------
# The adapter


class LightningAdapter(TrainerAdapter):
    """The checks' view of a LightningModule (+ DataModule) under Lightning's Trainer. See the module
    docstring. Subclasses (the Lightning reference) override `build`, `strategy`, `plugins`,
    `sync_context` or `callbacks`."""

    name = "lightning-module"

    checkpoints_once = True  # StepCheckpoint saves right after step k and at no other

    def __init__(self, parts: LightningParts | None = None) -> None:
        self.parts = parts
        if parts is not None:
            self.name = parts.label

    def setup(self, config: RunConfig, ctx: RankContext) -> None:
        super().setup(config, ctx)
        self.device = torch.device(ctx.device)
        self.wrapped: nn.Module | None = None
        self.losses: list[float] = []
        self.final: TrainState | None = None
        self._probe: ProbedEpochs | None = None
        self._stand_in: pl.Trainer | None = None  # for a training_step that reads self.trainer outside a fit
        self._ddp_kwargs: dict[str, Any] | None = None

    # --- what a subclass may change ----------------------------------------------------------------

    def build(self) -> LightningBuild:
        """A fresh module, datamodule and Trainer arguments, from the SPEC."""
        parts = self.parts
        if parts is None:
            raise NotProvided(self, "", "no LightningModule was named")
        if parts.factory is not None:
            return unpack(parts.factory(), parts.spec)
        assert parts.module is not None
        return LightningBuild(parts.module(), parts.datamodule() if parts.datamodule is not None else None)

    def strategy(self) -> DDPStrategy:
        """Lightning's DDPStrategy with the run's DDP kwargs (it passes them on to DDP)."""
        return DDPStrategy(**self.ddp_kwargs())

    def parallel_devices(self) -> list[torch.device] | None:
        """Each local rank's GPU, None on the CPU. Given to the strategy because `Trainer(devices=N)` cannot
        say that ranks share a GPU (gloo with fewer GPUs than ranks: rank i on GPU i mod n, as
        `runner.rank.ddp_context.rank_device` places them), and Lightning keeps a strategy's own. Set on
        whatever `strategy()` returns, so a subclass's strategy (the reference's) gets them too."""
        if self.device.type != "cuda":
            return None
        local_ranks = self.ctx.world_size // self.ctx.num_nodes
        if local_ranks == 1:  # its own GPU: in a world of one (a check's single-process reference) on any rank too
            return [self.device]
        gpus = max(torch.cuda.device_count(), 1)
        return [torch.device("cuda", i % gpus) for i in range(local_ranks)]

    def ddp_kwargs(self) -> dict[str, Any]:
        """The DDP kwargs of the fits and of `wrap`: the run config's, and those of a DDPStrategy in the
        factory's Trainer arguments that the config does not set (`merged_ddp_kwargs`); cached."""
        if self._ddp_kwargs is None:
            self._read_ddp_kwargs(seeded(self.config.seed, self.build))
        assert self._ddp_kwargs is not None
        return self._ddp_kwargs

    def _read_ddp_kwargs(self, built: LightningBuild) -> None:
        """Cache the DDP kwargs off a build the adapter made anyway: one made only to read them costs a whole
        build per adapter (a model's initialisation, a factory's pretrained weights loaded again)."""
        if self._ddp_kwargs is None:
            theirs = built.trainer_kwargs.get("strategy")
            self._ddp_kwargs = merged_ddp_kwargs(theirs, self.config.trainer.strategy.ddp_kwargs())

    def plugins(self) -> list[Any]:
        return []

    def callbacks(self, observer: FitObserver | None) -> list[pl.Callback]:
        """The harness's own callbacks for a fit (the trainer's come from its Trainer arguments)."""
        return [Recorder(self, observer)]

    def sync_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """What Lightning does around a micro-batch that does not end an accumulation window: no_sync."""
        if sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    # --- data: observed in a probe fit --------------------------------------------------------------

    def probe(self, epochs: int = PROBE_EPOCHS) -> ProbedEpochs:
        """The train loader as Lightning builds and prepares it in a fit (collective), cached by this
        adapter only: its data is built from the rank's RNG as the calling check left it (data_consistency
        reseeds every rank first), so a probe kept from an earlier check, whose fits seeded every rank
        alike, would hide data generated without a seed (fixture `lightning_unseeded_data`)."""
        if self._probe is None or len(self._probe.epochs) < epochs:
            self._probe = self._run_probe(max(epochs, PROBE_EPOCHS))
        return self._probe

    def _run_probe(self, epochs: int) -> ProbedEpochs:
        saved = capture_rng_state()  # an observation: the caller's RNG is left as it was
        reader = ReadLoader()
        try:
            with lightning_environment(self.ctx.local_rank):
                # no seed_everything: DDPStrategy's setup would reseed every rank with it (`reset_seed`),
                # and the data is to be built from this rank's own RNG, as in a process that never seeds,
                # so that data generated without a seed differs between ranks. Lightning's
                # DistributedSampler then has its default seed (0), not the fits' config seed.
                built = self.build()
                self._read_ddp_kwargs(built)  # its make_trainer asks for them: not another build for that
                _reads_without_training(built.module)
                trainer = self.make_trainer(built, [reader], max_epochs=epochs, limit_train_batches=1)
                trainer.fit(built.module, datamodule=built.datamodule)
        finally:
            restore_rng_state(saved)
        if reader.loader is None:
            raise NotProvided(self, "its train loader", reader.problem or "Lightning never started an epoch")
        return ProbedEpochs(reader.loader, reader.epochs)

    def make_dataset(self, size: int | None = None) -> Any:
        """The dataset of the train loader Lightning builds (`size` cannot be asked of a datamodule)."""
        return self.probe().loader.dataset

    def make_loader(self, dataset: Any, *, rank: int, world_size: int, epoch: int) -> EpochBatches:
        if (rank, world_size) != (self.ctx.rank, self.ctx.world_size):
            raise NotProvided(self, f"make_loader for rank {rank} of {world_size}",
                              "Lightning builds a rank's loader only inside that rank's fit")
        return EpochBatches(self.probe(epoch + 1).epochs[epoch])

    def batch_indices(self, batch: Any) -> list[int]:
        return list(batch)

    def collate(self, samples: Sequence[Any]) -> Any:
        return self.probe().loader.collate_fn(list(samples))

    # --- model, loss, one step: the module's own hooks ----------------------------------------------

    def make_model(self) -> nn.Module:
        """A fresh module, built from the config's seed so that every rank's is the same."""
        built = seeded(self.config.seed, self.build)
        self._read_ddp_kwargs(built)
        return built.module.to(self.device)

    def precision_plugin(self) -> Precision:
        precision = self.config.trainer.precision
        if precision in ("bf16-mixed", "16-mixed"):
            return MixedPrecision(precision, device=self.device.type)  # type: ignore[arg-type]
        return Precision()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """`training_step(batch, 0)`'s loss, through DDP's forward when `model` is wrapped."""
        module = model.module if isinstance(model, DistributedDataParallel) else model
        if not getattr(module, "automatic_optimization", True):
            raise NotProvided(self, "loss", "the module uses manual optimization (its training_step steps the "
                                            "optimizer itself)")
        if self._stand_in is not None:  # the step already asked for self.trainer: not run twice again
            output = self._training_step_beside_a_trainer(model, module, batch)
        else:
            try:
                output = self._training_step(model, module, batch)
            except RuntimeError as exc:
                if "not attached to a `Trainer`" not in str(exc):
                    raise
                output = self._training_step_beside_a_trainer(model, module, batch)
        loss = step_loss(output)
        if loss is None:
            raise NotProvided(self, "loss", f"training_step returned {type(output).__name__}, not a loss tensor "
                                            "(or a dict with 'loss')")
        return loss

    def _training_step(self, model: nn.Module, module: Any, batch: Any) -> Any:
        batch = module.on_after_batch_transfer(
            module.transfer_batch_to_device(module.on_before_batch_transfer(batch, 0), self.device, 0), 0)
        with quiet(), self.precision_plugin().train_step_context():
            return call_as_forward(model, module, "training_step", batch, 0)

    def _training_step_beside_a_trainer(self, model: nn.Module, module: Any, batch: Any) -> Any:
        """The step of a module that reads `self.trainer` (its world_size, global_rank...), with the
        Trainer the fit would build attached (never fitted: step and epoch 0) and `self.log` silent
        (outside a loop it has nowhere to log to). In the single-process reference that Trainer has
        one device, so `loss / self.trainer.world_size` divides by 1 there, as in a real run."""
        if self._stand_in is None:
            with lightning_environment(self.ctx.local_rank):
                self._stand_in = self.make_trainer(self.build(), [])
        try:
            module.trainer = self._stand_in
            with mock.patch.object(module, "log"), mock.patch.object(module, "log_dict"):
                return self._training_step(model, module, batch)
        except Exception as exc:
            raise NotProvided(self, "loss", "its training_step (or batch transfer hooks) use self.trainer, and with "
                                            f"a Trainer attached outside Trainer.fit it raised {type(exc).__name__}: "
                                            f"{exc}") from exc
        finally:
            module.trainer = None

    def wrap(self, model: nn.Module) -> nn.Module:
        """As DDPStrategy wraps it: DistributedDataParallel(module, device_ids, **the strategy's kwargs)."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs())

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """One optimizer step's gradients as Lightning's automatic optimization computes them."""
        module = model.module if isinstance(model, DistributedDataParallel) else model
        parts = split_batch(batch, self.config.trainer.accumulate_grad_batches)
        total = torch.zeros(())
        for i, micro in enumerate(parts):
            with self.sync_context(model, i == len(parts) - 1):
                loss = self.loss(model, micro)
                scaled = loss / len(parts)
                module.on_before_backward(scaled)
                module.backward(scaled)
            module.on_after_backward()
            total += loss.detach().float().cpu() / len(parts)
        return total

    # --- fit / resume: Lightning's Trainer ----------------------------------------------------------

    def trainer_kwargs(self, built: LightningBuild) -> dict[str, Any]:
        """The factory's Trainer arguments the harness leaves alone; one line on a config conflict."""
        kwargs = {k: v for k, v in built.trainer_kwargs.items() if k not in HARNESS_KEYS}
        config = self.config.trainer
        for key, ours in (("precision", config.precision), ("accumulate_grad_batches", config.accumulate_grad_batches)):
            if key not in kwargs:
                continue
            theirs = kwargs.pop(key)
            if (_PRECISION.get(theirs, theirs) if key == "precision" else theirs) != ours:
                raise ValueError(f"the trainer's arguments set {key}={theirs!r} but the run config says {ours!r}: "
                                 f"the checks judge with the config's, so set trainer.{key} in the --ddp-config file")
        return kwargs

    def make_trainer(self, built: LightningBuild, callbacks: list[pl.Callback], **run: Any) -> pl.Trainer:
        kwargs = self.trainer_kwargs(built)
        theirs = [c for c in _as_list(kwargs.pop("callbacks", [])) if not isinstance(c, ModelCheckpoint)]
        plugins = [*_as_list(kwargs.pop("plugins", [])), *self.plugins()]
        trainer = self.config.trainer
        cuda = self.device.type == "cuda"
        strategy, devices = self.strategy(), self.parallel_devices()
        if devices and isinstance(strategy, ParallelStrategy) and not strategy.parallel_devices:
            strategy.parallel_devices = devices
        return pl.Trainer(**{
            **kwargs, "accelerator": "gpu" if cuda else "cpu",
            "devices": len(set(devices or ())) or self.ctx.world_size // self.ctx.num_nodes,
            "num_nodes": self.ctx.num_nodes, "strategy": strategy, "precision": trainer.precision,
            "sync_batchnorm": trainer.sync_batchnorm and cuda,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "max_epochs": -1, "limit_val_batches": 0, "num_sanity_val_steps": 0, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
            "callbacks": [*callbacks, *theirs],
            "plugins": plugins or None, "default_root_dir": str(self.ctx.workdir), **run})

    def fit(self, steps: int, *, checkpoint_dir: Path | None = None, checkpoint_at: int | None = None,
            observer: FitObserver | None = None) -> TrainState:
        callbacks = self.callbacks(observer)
        saver = None
        if checkpoint_at is not None:
            if checkpoint_dir is None:
                raise ValueError("checkpoint_at needs checkpoint_dir")
            saver = StepCheckpoint(Path(checkpoint_dir), checkpoint_at)
            callbacks.append(saver)
        return self._fit(steps, callbacks, None, saver)

    def resume(self, checkpoint: Path, steps: int, *, observer: FitObserver | None = None) -> TrainState:
        return self._fit(steps, [InstallRNG(capture_rng_state()), *self.callbacks(observer)], Path(checkpoint), None)

    def fit_arguments(self) -> dict[str, Any]:
        """Extra `Trainer.fit` arguments (none: what the user's own script passes)."""
        return {}

    def _fit(self, steps: int, callbacks: list[pl.Callback], ckpt_path: Path | None,
             saver: ModelCheckpoint | None) -> TrainState:
        self.losses, self.final = [], None
        with lightning_environment(self.ctx.local_rank):
            pl.seed_everything(self.config.seed, verbose=False)
            built = seeded(self.config.seed, self.build)  # the same on every rank; the global RNG stays at the seed
            self._read_ddp_kwargs(built)
            trainer = self.make_trainer(built, callbacks, max_steps=steps)
            trainer.fit(built.module, datamodule=built.datamodule,
                        ckpt_path=str(ckpt_path) if ckpt_path is not None else None, **self.fit_arguments())
        if saver is not None and saver not in trainer.callbacks:
            raise NotProvided(self, "a checkpoint at a given step", "its LightningModule.configure_callbacks returns a "
                                                                    "ModelCheckpoint, which replaces the harness's")
        assert self.final is not None, "Lightning finished without calling on_train_end"
        self.final.losses = list(self.losses)
        self.final.checkpoint = Path(saver.best_model_path) if saver is not None and saver.best_model_path else None
        return self.final

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank={getattr(self, 'ctx', None) and self.ctx.rank}>"


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
