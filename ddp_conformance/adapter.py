"""Both processes: the one interface through which every conformance check talks to a trainer.

A check never imports a trainer's code: it gets a `TrainerAdapter` from `--ddp-trainer SPEC`, calls
`setup(config, ctx)` inside each rank, and then asks for exactly what it needs (a loader, the model,
one step, a short fit, a resume). Every method has a default that raises `NotProvided`, so an
adapter implements only what its trainer can offer and a check that needs the rest is *skipped*
with the reason, never failed: "cannot observe X" is not evidence that X is wrong.

Each adapter instance lives inside one rank, in an initialised default process group. Methods
marked *collective* must be called on every rank (they run DDP); the others are local.

This module does not import torch at import time, so the plugin can load it for SPEC validation in
sessions that never train anything.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from .config import RunConfig


class NotProvided(Exception):
    """The adapter cannot give what a check asked for. A check turns it into a skip with `str(exc)`."""

    def __init__(self, adapter: object, what: str, why: str = "") -> None:
        name = adapter_name(adapter)
        message = f"trainer {name} does not provide {what}" if what else f"trainer {name}"
        super().__init__(f"{message}: {why}" if why else message)
        self.what = what


class TrainerBuildError(Exception):
    """The trainer could not be built (its factory or class raised, or its `setup` with the run's
    config): no check of it can run. Raised from the trainer's own error, which holds its frames;
    the suite reports it once and skips the trainer's other checks (`ddp_conformance.suite.unbuilt`)."""


@dataclass(frozen=True)
class RankContext:
    """Where an adapter runs: this rank of the harness's process group, and a dir shared by all ranks."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: str  # "cpu" or "cuda:N"; a string so this module needs no torch
    workdir: Path
    num_nodes: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @classmethod
    def from_fixture(cls, ddp: Any, workdir: str | Path) -> RankContext:
        """From the harness's `ddp` fixture (rank, local_rank, world_size, backend, device)."""
        device = getattr(ddp, "device_name", None) or str(ddp.device)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ddp.world_size))
        return cls(rank=ddp.rank, local_rank=ddp.local_rank, world_size=ddp.world_size, backend=ddp.backend,
                   device=device, workdir=Path(workdir), num_nodes=max(1, ddp.world_size // local_world))

    @classmethod
    def current(cls, workdir: str | Path, device: Any = None) -> RankContext:
        """The context of the calling rank, read from torch.distributed and LOCAL_RANK."""
        import torch.distributed as dist  # deferred: torch is heavy to import

        if not dist.is_initialized():
            raise RuntimeError("RankContext.current() needs an initialised default process group")
        backend = str(dist.get_backend())
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device is None:
            device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
        world_size = dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return cls(rank=dist.get_rank(), local_rank=local_rank, world_size=world_size, backend=backend,
                   device=str(device), workdir=Path(workdir), num_nodes=max(1, world_size // local_world))


@dataclass(frozen=True)
class StepInfo:
    """One micro-batch of a fit: what a rank did, for progress records and participation checks.

    `global_step` counts optimizer steps already taken before this micro-batch (Lightning's meaning);
    `position` is the micro-batch's index inside its epoch; `optimizer_step` says whether this
    micro-batch ends an accumulation window (gradients are all-reduced on it).
    """

    rank: int
    epoch: int
    global_step: int
    position: int
    batch_size: int
    optimizer_step: bool
    loss: float | None = None  # set in `after_step` only


class FitObserver:
    """Hooks a check passes to `fit`/`resume`; the defaults do nothing.

    `on_wrapped` sees the DDP-wrapped model before the first forward (e.g. to register a comm hook
    or count reducer calls); `before_step`/`after_step` bracket every micro-batch's forward and
    backward, so a check can write per-rank progress outside the process group and name the step at
    which a rank stopped.
    """

    def on_wrapped(self, model: nn.Module) -> None:
        """Called once per fit/resume with the model exactly as the trainer wrapped it."""

    def before_step(self, info: StepInfo) -> None:
        """Called before the forward of each micro-batch."""

    def after_step(self, info: StepInfo) -> None:
        """Called after the backward (and anything the trainer does after it) of each micro-batch."""

    def stop_requested(self) -> bool:
        """Asked by a fit that can end early, after a micro-batch that ended with an optimizer step:
        True once the check has what it watches the fit for (a diagnosis that has its answer), so
        the fit may end there, as at its last step. A fit that never asks runs to its end, which is
        always right; one that asks must ask at the same micro-batches on every rank (an answer may
        be gathered from all of them)."""
        return False


@dataclass
class TrainState:
    """Where a fit ended, as plain CPU tensors and counters that can be compared across runs.

    `params` is the unwrapped model's state_dict (no `module.` prefix, buffers included);
    `position` is the number of micro-batches consumed in the current epoch; `losses` holds the loss
    of every micro-batch this object ran (after a resume: only the resumed part); `checkpoint` is the
    file the fit was asked to write (the same path on every rank, written by rank 0 only).
    """

    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    epoch: int
    global_step: int
    position: int
    losses: list[float] = field(default_factory=list)
    checkpoint: Path | None = None

    #: read off the fit's objects by the harness (the adapter returned nothing): counters unknown
    observed: bool = False

    @property
    def counters(self) -> dict[str, int]:
        if self.observed:
            return {}
        return {"epoch": self.epoch, "global_step": self.global_step, "position": self.position}


class TrainerAdapter:
    """What a check may ask of a trainer. Subclass it and override what your trainer can provide.

    Lifecycle: one fresh instance per rank per use; `setup` first; `fit` or `resume` at most once
    per instance (a resume is always done by a *fresh* instance, as after a crash).
    """

    #: shown in reports and skip reasons; defaults to the class name
    name: str = ""
    #: when `fit(checkpoint_at=k)` can write a checkpoint: None (at any optimizer step), "epoch" (only
    #: at epoch ends), or N (every N steps); resume_fidelity picks k accordingly
    checkpoint_every: int | str | None = None
    #: whether `fit(steps, checkpoint_at=k)` writes its checkpoint at step k and at no other step: then
    #: resume_fidelity takes it from the long fit it shares with sampler_disjointness. False (the
    #: default) where k may be an interval the trainer saves at again (2k, 3k...), as a loop with a
    #: `checkpoint_every` often is: resume_fidelity then checkpoints in a fit of its own that ends at k
    checkpoints_once: bool = False
    #: whether the trainer trains as the run config says; False for a trainer that only runs its own
    #: command line (a `script:` SPEC): the harness's notes on the config are then not about it
    takes_config: bool = True

    config: RunConfig
    ctx: RankContext

    def setup(self, config: RunConfig, ctx: RankContext) -> None:
        """Receive the (harness-reconciled) run config and this rank's context. Must be cheap: no
        training, no collectives. The default stores both as `self.config` and `self.ctx`."""
        self.config = config
        self.ctx = ctx

    # --- data ------------------------------------------------------------------------------------

    def make_dataset(self, size: int | None = None) -> Dataset:
        """The trainer's map-style dataset, `size` items (default: the config's). Deterministic: the
        same on every rank and every call. Its items must let `batch_indices` recover sample indices."""
        raise NotProvided(self, "make_dataset", "the trainer's dataset cannot be built on its own")

    def make_loader(self, dataset: Dataset, *, rank: int, world_size: int, epoch: int) -> Iterable[Any]:
        """The loader the trainer would iterate in `epoch` as `rank` of `world_size`, with whatever
        per-epoch preparation the trainer does (e.g. `sampler.set_epoch`). Local: no collectives, so a
        check may build every rank's loader in one process."""
        raise NotProvided(self, "make_loader", "the trainer's data loader cannot be built on its own")

    def batch_indices(self, batch: Any) -> list[int]:
        """The dataset indices of the samples in a batch of `make_loader`."""
        raise NotProvided(self, "batch_indices", "batches do not carry their sample indices")

    def collate(self, samples: Sequence[Any]) -> Any:
        """Turn dataset items into one batch, as the trainer's loader would (e.g. a global batch)."""
        raise NotProvided(self, "collate", "the trainer's batches cannot be built from samples")

    # --- model, loss, one step ------------------------------------------------------------------

    def make_model(self) -> nn.Module:
        """A freshly initialised, unwrapped model on this rank's device, identical on all ranks."""
        raise NotProvided(self, "make_model", "the model cannot be built on its own")

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Forward and loss for a batch, with the reduction and precision the trainer trains with.
        `model` may be unwrapped or the result of `wrap`."""
        raise NotProvided(self, "loss", "the trainer's loss cannot be computed on its own")

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model wrapped the way the trainer wraps it for DDP, with its configured kwargs.
        Collective (DDP construction broadcasts parameters)."""
        raise NotProvided(self, "wrap", "the trainer's DDP wrapping cannot be done on its own")

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """One micro-batch as the trainer does it: forward, loss, backward and anything it does after
        backward; no optimizer step, no zero_grad. Returns the loss (detached). Collective when
        `model` is DDP-wrapped (the backward all-reduces). The default is `loss(model, batch).backward()`:
        override it only when the trainer does more per micro-batch (clipping, a scaler, hooks)."""
        loss = self.loss(model, batch)
        loss.backward()
        return loss.detach()

    # --- fit, checkpoint, resume ----------------------------------------------------------------

    def fit(
        self,
        steps: int,
        *,
        checkpoint_dir: Path | None = None,
        checkpoint_at: int | None = None,
        observer: FitObserver | None = None,
    ) -> TrainState:
        """Train from scratch for `steps` optimizer steps; with `checkpoint_at=k`, write a checkpoint
        into `checkpoint_dir` right after step k (rank 0 only). Returns the final state, with
        `checkpoint` set to the file written. Collective."""
        raise NotProvided(self, "fit", "the trainer cannot be run for a given number of steps")

    def resume(self, checkpoint: Path, steps: int, *, observer: FitObserver | None = None) -> TrainState:
        """On a fresh instance: restore everything from `checkpoint` and train on to `steps` optimizer
        steps in total. Returns the final state. Collective."""
        raise NotProvided(self, "resume", "the trainer cannot resume from a checkpoint")


# the name the session gives the trainer a check is running (its test id's), one check at a time per rank
_SESSION_NAME: list[str] = []


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """While a check runs, every message names its trainer as the test id and the report do."""
    _SESSION_NAME.append(name)
    try:
        yield
    finally:
        _SESSION_NAME.pop()


def adapter_name(adapter: object) -> str:
    """The name a report shows for an adapter instance or class: the session's name for it inside a
    check, else its own `name` or class name."""
    if _SESSION_NAME:
        return _SESSION_NAME[-1]
    if isinstance(adapter, str):
        return adapter
    return getattr(adapter, "name", "") or getattr(adapter, "__name__", "") or type(adapter).__name__
