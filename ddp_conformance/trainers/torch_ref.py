"""The plain-torch reference: a DDP training loop done right, built to pass every conformance check.

What "right" means here, each point a check holds it to:
- data: a `DistributedSampler` per rank, `set_epoch` before every epoch, items that carry their index;
- model: seeded init (identical on all ranks), optional dropout and BatchNorm (SyncBatchNorm on CUDA);
- DDP built from the config's kwargs, nothing more, nothing less (`StrategyConfig.ddp_kwargs`);
- loss averaged over the batch (DDP averages over ranks, so mean/mean is the global-batch gradient);
- accumulation with `no_sync`, forward included, each micro-batch loss scaled by 1/accumulation;
- AdamW + StepLR (stepped per optimizer step);
- checkpoints written by rank 0 only, atomically (temp file + `os.replace`), holding the unwrapped
  model (no `module.` keys), optimizer, scheduler, epoch, global step, position inside the epoch and
  every rank's torch/numpy/python RNG states, so a resume reproduces the uninterrupted run bit for bit.

Measured on CPU/gloo/fp32 (dropout 0.3, checkpoint mid-epoch): a resume equals the uninterrupted run
bit for bit at world sizes 1 and 2; at 4 it differs by up to 1.2e-7, because gloo's ring all-reduce
order follows DDP's bucket layout and a fresh DDP rebuilds its buckets only after its first iteration.

Every decision is a small method so that a broken trainer (the mutants of the conformance suite) is a
subclass overriding one of them: `make_sampler`, `set_epoch`, `make_model`, `loss`, `ddp_kwargs`,
`wrap`, `after_backward`, `train_micro_batch`, `checkpoint_payload`, `model_state`,
`load_model_state`, `load_checkpoint`.

The dataset and model builder live here too, and the Lightning reference reuses them so both
references train the same network on the same data; the resumable loader and the RNG helpers are the
public ones in `ddp_conformance.resumable`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, default_collate

from ..adapter import FitObserver, RankContext, StepInfo, TrainerAdapter, TrainState
from ..config import ModelConfig, RunConfig
from ..resumable import (
    ResumableDataLoader,
    gather_rng_states,
    restore_rng_state,
    rng_state_for_rank,
    seed_all,
)

# ---------------------------------------------------------------------------------------------------
# Data


class IndexedDataset(Dataset):
    """Synthetic classification data made in code: item i is `(i, x_i, y_i)`.

    Labels come from a fixed random linear "teacher", so a small MLP can learn them and the loss
    falls within a few steps. The index rides along with every sample so a check can see exactly
    which samples each rank received.
    """

    def __init__(self, size: int, input_dim: int, num_classes: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        teacher = torch.randn(input_dim, num_classes, generator=generator)
        self.x = torch.randn(size, input_dim, generator=generator)
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


# ---------------------------------------------------------------------------------------------------
# Model


def build_mlp(cfg: ModelConfig) -> nn.Sequential:
    """Linear -> [BatchNorm1d] -> ReLU -> [Dropout] per hidden layer, then a Linear head.

    A Linear followed by BatchNorm has no bias: BatchNorm subtracts the batch mean, so that bias gets a
    gradient of pure round-off, which AdamW normalises into lr-sized steps. Such a parameter changes
    nothing the model computes, yet drifts with the all-reduce's summation order (a resumed DDP's
    first step sums in its initial bucket layout), and made a faithful resume differ by 0.05 at
    world size 4 while every loss was identical."""
    layers: list[nn.Module] = []
    width = cfg.input_dim
    for hidden in cfg.hidden:
        layers.append(nn.Linear(width, hidden, bias=not cfg.batchnorm))
        if cfg.batchnorm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.ReLU())
        if cfg.dropout > 0:
            layers.append(nn.Dropout(cfg.dropout))
        width = hidden
    layers.append(nn.Linear(width, cfg.num_classes))
    return nn.Sequential(*layers)


def seeded(seed: int, build: Any) -> Any:
    """Run `build()` with torch's global RNG seeded, without disturbing the caller's RNG stream.

    Model init must be identical on every rank and in every fresh trainer, yet must not reset the
    global RNG that dropout draws from (that would make a resume differ from an uninterrupted run).
    On a GPU dropout draws from the CUDA generator, which `torch.manual_seed` reseeds too: so the CUDA
    generators in use are forked as well (a model built on the GPU draws its init from them), and none
    not yet in use is seeded (`manual_seed` would queue that seed for CUDA's first use, after the fork).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for device in devices:
            torch.cuda.default_generators[device].manual_seed(seed)
        return build()


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The autocast context for a Lightning-style precision string (as Lightning's MixedPrecision)."""
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    if precision == "16-mixed":
        return torch.autocast(device_type=device_type, dtype=torch.float16)
    return contextlib.nullcontext()


def split_batch(batch: Sequence[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """Split a collated batch into `parts` micro-batches along dim 0 (for accumulation)."""
    if parts == 1:
        return [list(batch)]
    pieces = [torch.tensor_split(t, parts) for t in batch]
    return [[p[i] for p in pieces] for i in range(parts) if len(pieces[0][i])]


def atomic_save(payload: Any, path: Path) -> None:
    """torch.save to a temp file in the same dir, fsync, then os.replace: a crash mid-write leaves
    the previous checkpoint intact instead of a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def cpu_copy(value: Any) -> Any:
    """A deep copy of a (nested) state with every tensor detached and on CPU, for TrainState."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


def static_graph(model: nn.Module) -> bool:
    """Whether `model` is a DDP built with static_graph=True."""
    return isinstance(model, DistributedDataParallel) and bool(getattr(model, "static_graph", False))


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------------
# The adapter


class ReferenceData:
    """The data both references train on (the Lightning reference too): the config's synthetic
    dataset, a DistributedSampler, and a loader that resumes mid-epoch with its own generator."""

    config: RunConfig

    def make_dataset(self, size: int | None = None) -> Dataset:
        data, model = self.config.data, self.config.model
        return IndexedDataset(size or data.size, model.input_dim, model.num_classes, data.seed)

    def make_sampler(self, dataset: Dataset, rank: int, world_size: int) -> Sampler:
        data = self.config.data
        return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=data.shuffle,
                                  seed=data.seed, drop_last=data.drop_last)

    def build_loader(self, dataset: Dataset, sampler: Sampler) -> DataLoader:
        generator = torch.Generator().manual_seed(self.config.data.seed)
        return ResumableDataLoader(dataset, batch_size=self.config.data.batch_size, sampler=sampler,
                                   generator=generator)


class TorchTrainer(ReferenceData, TrainerAdapter):
    """A plain-torch DDP trainer and its adapter in one. See the module docstring."""

    name = "torch"
    reduction = "mean"
    checkpoints_once = True  # fit writes its checkpoint when global_step == checkpoint_at, at no other step

    def setup(self, config: RunConfig, ctx: RankContext) -> None:
        super().setup(config, ctx)
        self.device = torch.device(ctx.device)
        self.model: nn.Module | None = None
        self.wrapped: nn.Module | None = None
        self.epoch = self.global_step = self.position = 0
        self.losses: list[float] = []
        self.checkpoint_file: Path | None = None
        scaler_on = config.trainer.precision == "16-mixed" and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if scaler_on else None

    # --- data: ReferenceData's, plus set_epoch and the helpers below -----------------------------

    def set_epoch(self, loader: DataLoader, epoch: int) -> None:
        sampler = loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def make_loader(self, dataset: Dataset, *, rank: int, world_size: int, epoch: int) -> DataLoader:
        loader = self.build_loader(dataset, self.make_sampler(dataset, rank, world_size))
        self.set_epoch(loader, epoch)
        return loader

    def batch_indices(self, batch: Any) -> list[int]:
        return [int(i) for i in batch[0]]

    def collate(self, samples: Sequence[Any]) -> Any:
        return default_collate(list(samples))

    # --- model, loss, one step ------------------------------------------------------------------

    def make_model(self) -> nn.Module:
        model = seeded(self.config.seed, lambda: build_mlp(self.config.model))
        if self.config.trainer.sync_batchnorm and self.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return model.to(self.device)

    def to_device(self, batch: Any) -> Any:
        return [t.to(self.device, non_blocking=True) for t in batch]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        _, x, y = self.to_device(batch)
        with autocast_for(self.config.trainer.precision, self.device.type):
            logits = model(x)
        return F.cross_entropy(logits.float(), y, reduction=self.reduction)

    def ddp_kwargs(self) -> dict[str, Any]:
        return self.config.trainer.strategy.ddp_kwargs()

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs())

    def sync_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """`no_sync` on micro-batches that do not end an accumulation window (forward included).

        Not with `static_graph`: a fresh DDP's first backward under no_sync trips a reducer assert
        (pytorch #143580), and a resumed run's DDP is fresh, so syncing only its first window would
        make a resume differ (in the last bits) from the uninterrupted run. Every micro-batch is
        synced instead: the accumulated gradient is the same, at one all-reduce per micro-batch.
        """
        if sync or not hasattr(model, "no_sync") or static_graph(model):
            return contextlib.nullcontext()
        return model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def after_backward(self, model: nn.Module) -> None:
        """Anything done between backward and the optimizer step (here: nothing)."""

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The gradient computation of one optimizer step on `batch`: split into
        `accumulate_grad_batches` micro-batches, all but the last under no_sync. The gradients are the
        true ones: under 16-mixed the GradScaler's loss scale is divided out, as `scaler.step` (or
        `scaler.unscale_` before clipping) does in the fit (a power of two: exact)."""
        parts = split_batch(batch, self.config.trainer.accumulate_grad_batches)
        total = torch.zeros(())
        for i, micro in enumerate(parts):
            with self.sync_context(model, i == len(parts) - 1):
                loss = self.loss(model, micro)
                self.backward(loss / len(parts))
            self.after_backward(model)
            total += loss.detach().float().cpu() / len(parts)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.div_(scale)
        return total

    # --- training --------------------------------------------------------------------------------

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        optim = self.config.optim
        return torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        sched = self.config.optim.scheduler
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=sched.step_size, gamma=sched.gamma)

    def _build(self) -> None:
        self.dataset = self.make_dataset()
        self.model = self.make_model()
        self.optimizer = self.make_optimizer(self.model)
        self.scheduler = self.make_scheduler(self.optimizer)
        self.epoch = self.global_step = self.position = 0

    def _wrap(self, observer: FitObserver | None) -> None:
        assert self.model is not None
        self.wrapped = self.wrap(self.model)
        if observer is not None:
            observer.on_wrapped(self.wrapped)

    def fit(self, steps: int, *, checkpoint_dir: Path | None = None, checkpoint_at: int | None = None,
            observer: FitObserver | None = None) -> TrainState:
        seed_all(self.config.seed)
        self._build()
        self._wrap(observer)
        target = None
        if checkpoint_at is not None:
            if checkpoint_dir is None:
                raise ValueError("checkpoint_at needs checkpoint_dir")
            target = Path(checkpoint_dir) / f"{self.name}-step{checkpoint_at}.pt"
        return self._run(steps, target, checkpoint_at, observer)

    def resume(self, checkpoint: Path, steps: int, *, observer: FitObserver | None = None) -> TrainState:
        self._build()
        self._wrap(observer)
        # loaded after wrapping so that the RNG state it restores is the last thing touched
        # before the first batch (every rank loads the same file, so DDP's replicas stay equal)
        self.load_checkpoint(self.read_checkpoint(Path(checkpoint)))
        return self._run(steps, None, None, observer)

    def epoch_loader(self, epoch: int) -> DataLoader:
        """The loader the fit's own loop iterates in `epoch` (the `make_loader` helper by default)."""
        return self.make_loader(self.dataset, rank=self.ctx.rank, world_size=self.ctx.world_size, epoch=epoch)

    def _run(self, steps: int, target: Path | None, checkpoint_at: int | None,
             observer: FitObserver | None) -> TrainState:
        accumulate = self.config.trainer.accumulate_grad_batches
        while self.global_step < steps:
            loader = self.epoch_loader(self.epoch)
            length = len(loader)
            if length == 0:
                raise RuntimeError(f"rank {self.ctx.rank}: the loader of epoch {self.epoch} is empty")
            if self.position:
                loader.load_state_dict({"epoch": self.epoch, "position": self.position})
            for batch in loader:
                last = self.position + 1 == length
                step = last or (self.position + 1) % accumulate == 0
                self.train_micro_batch(batch, step, observer)
                self.position += 1
                if step:
                    self.optimizer_step()
                if last:
                    self.epoch, self.position = self.epoch + 1, 0
                if step and self.global_step == checkpoint_at and target is not None:
                    self.save_checkpoint(target)
                    self.checkpoint_file = target
                if step and self.global_step >= steps:
                    break
                if step and observer is not None and observer.stop_requested():
                    return self.state()
        return self.state()

    def train_micro_batch(self, batch: Any, sync: bool, observer: FitObserver | None) -> None:
        """One micro-batch: forward and backward (under no_sync unless `sync`), then after_backward."""
        assert self.wrapped is not None
        info = StepInfo(rank=self.ctx.rank, epoch=self.epoch, global_step=self.global_step,
                        position=self.position, batch_size=len(batch[0]), optimizer_step=sync)
        if observer is not None:
            observer.before_step(info)
        with self.sync_context(self.wrapped, sync):
            loss = self.loss(self.wrapped, batch)
            self.backward(loss / self.config.trainer.accumulate_grad_batches)
        self.after_backward(self.wrapped)
        value = float(loss.detach())
        self.losses.append(value)
        if observer is not None:
            observer.after_step(replace(info, loss=value))

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1

    # --- checkpoints -------------------------------------------------------------------------------

    def model_state(self) -> dict[str, torch.Tensor]:
        """The unwrapped model's state_dict: keys without DDP's `module.` prefix."""
        assert self.model is not None
        return self.model.state_dict()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        assert self.model is not None
        self.model.load_state_dict(state, strict=True)

    def checkpoint_payload(self) -> dict[str, Any]:
        """Everything a resume needs. Collective (gathers every rank's RNG state)."""
        payload: dict[str, Any] = {
            "model": self.model_state(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "position": self.position,
            "rng": gather_rng_states(),
            "world_size": self.ctx.world_size,
        }
        if self.scaler is not None:
            payload["scaler"] = self.scaler.state_dict()
        return payload

    def save_checkpoint(self, path: Path) -> None:
        """Rank 0 writes; every rank waits, so no rank can read the file before it exists."""
        payload = self.checkpoint_payload()
        if self.ctx.rank == 0:
            atomic_save(payload, path)
        barrier()

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        return torch.load(path, map_location=self.device, weights_only=True)

    def load_checkpoint(self, payload: dict[str, Any]) -> None:
        """Restore what the payload holds; a missing piece is left at its fresh value (as a trainer
        that never saved it would), so the conformance checks see the consequence, not a KeyError."""
        self.load_model_state(payload["model"])
        if "optimizer" in payload:
            self.optimizer.load_state_dict(payload["optimizer"])
        if "scheduler" in payload:
            self.scheduler.load_state_dict(payload["scheduler"])
        if "scaler" in payload and self.scaler is not None:
            self.scaler.load_state_dict(payload["scaler"])
        self.epoch = int(payload.get("epoch", 0))
        self.global_step = int(payload.get("global_step", 0))
        self.position = int(payload.get("position", 0))
        if "rng" in payload:
            restore_rng_state(rng_state_for_rank(payload["rng"], self.ctx.rank))

    def state(self) -> TrainState:
        assert self.model is not None
        return TrainState(
            params=cpu_copy(self.model.state_dict()),
            optimizer=cpu_copy(self.optimizer.state_dict()),
            scheduler=cpu_copy(self.scheduler.state_dict()),
            epoch=self.epoch,
            global_step=self.global_step,
            position=self.position,
            losses=list(self.losses),
            checkpoint=self.checkpoint_file,
        )
