"""What the real fit did on this rank, recorded from torch's own hooks with no call in the trainer.

A check that asks the adapter to restate the trainer (`make_loader`, `train_step`) judges the
restatement: a loop that forgot `set_epoch` passes when the adapter's `make_loader` calls it. So
while a check runs `fit`/`resume`, a `FitRecorder` watches the process:

- every DDP forward, through `torch.nn.modules.module.register_module_forward_pre_hook` (global,
  public): the first DDP module's settings, each training micro-batch and whether it synchronised
  gradients (`require_backward_grad_sync`, which `no_sync()` clears);
- every optimizer step, through `torch.optim.optimizer.register_optimizer_step_post_hook`;
- every pass of a DataLoader over its data and the dataset indices each batch drew, by wrapping the
  public `DataLoader.__iter__` and `BatchSampler.__iter__` for the duration of the fit (restored
  after; a DataLoader subclass that calls `super().__iter__()` is seen too). A loader whose batches
  do not come from a `BatchSampler` is recorded without indices.

Hooks are process-wide, so the fit may run in another thread (progress.guarded_fit does). One
recorder at a time: a rank runs one fit at a time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

DDP_SETTINGS = ("gradient_as_bucket_view", "static_graph", "find_unused_parameters", "broadcast_buffers",
                "bucket_bytes_cap")


@dataclass
class LoaderPass:
    """One `iter()` of a DataLoader: its length, dataset size, sampler and the index batches drawn.

    `trained` says whether a training forward of a DDP model ran while this pass was the newest
    one, which separates the training loader's passes from validation or sanity-check passes."""

    length: int | None
    dataset_size: int | None
    sampler: str
    shuffle: bool | None
    batches: list[list[int]] = field(default_factory=list)
    indexed: bool = False  # batches came from a BatchSampler, so they are dataset indices
    trained: bool = False


@dataclass
class FitRecord:
    """Everything one fit did on this rank, as the hooks saw it."""

    ddp: dict[str, Any] | None = None  # the settings of the first DDP module that ran forward
    micro_batches: int = 0
    synced: list[bool] = field(default_factory=list)
    optimizer_steps: int = 0
    passes: list[LoaderPass] = field(default_factory=list)

    def training_passes(self) -> list[LoaderPass]:
        return [p for p in self.passes if p.trained]

    def summary(self) -> dict[str, Any]:
        """Plain values, for figures and for gathering across ranks."""
        return {"micro_batches": self.micro_batches, "synced": sum(self.synced),
                "optimizer_steps": self.optimizer_steps, "loader_passes": len(self.training_passes()),
                "ddp": self.ddp}


class FitRecorder:
    """Installs the hooks on entry and removes them on exit; `record` holds what they saw."""

    _lock = threading.Lock()

    def __init__(self) -> None:
        self.record = FitRecord()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> FitRecorder:
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data import BatchSampler, DataLoader

        if not FitRecorder._lock.acquire(blocking=False):
            raise RuntimeError("a FitRecorder is already recording in this process")
        self._stack.callback(FitRecorder._lock.release)
        self._torch = torch
        self._stack.callback(register_module_forward_pre_hook(self._on_forward).remove)
        self._stack.callback(register_optimizer_step_post_hook(self._on_optimizer_step).remove)
        self._patch(DataLoader, "__iter__", self._loader_iter)
        self._patch(BatchSampler, "__iter__", self._batch_sampler_iter)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _patch(self, owner: type, name: str, make: Any) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, make(original))
        self._stack.callback(setattr, owner, name, original)

    # --- hooks ------------------------------------------------------------------------------------

    def _on_forward(self, module: Any, _args: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(module, DistributedDataParallel):
            return
        record = self.record
        if record.ddp is None:
            record.ddp = {name: getattr(module, name, None) for name in DDP_SETTINGS}
        if module.training and self._torch.is_grad_enabled():
            record.micro_batches += 1
            record.synced.append(bool(module.require_backward_grad_sync))
            if record.passes:
                record.passes[-1].trained = True

    def _on_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.record.optimizer_steps += 1

    def _loader_iter(self, original: Any) -> Any:
        recorder = self

        def __iter__(loader: Any) -> Any:
            recorder.record.passes.append(_new_pass(loader))
            return original(loader)

        return __iter__

    def _batch_sampler_iter(self, original: Any) -> Any:
        recorder = self

        def __iter__(sampler: Any) -> Iterator[list[int]]:
            passes = recorder.record.passes
            target = passes[-1] if passes and not passes[-1].batches else None
            if target is not None:
                target.indexed = True
            return _recorded(original(sampler), target)

        return __iter__


def _recorded(batches: Iterator[list[int]], target: LoaderPass | None) -> Iterator[list[int]]:
    for batch in batches:
        if target is not None:
            target.batches.append([int(i) for i in batch])
        yield batch


def _new_pass(loader: Any) -> LoaderPass:
    sampler = getattr(loader, "sampler", None)
    dataset = getattr(loader, "dataset", None)
    try:
        length = len(loader)
    except TypeError:
        length = None
    try:
        size = len(dataset) if dataset is not None else None  # type: ignore[arg-type]
    except TypeError:
        size = None  # an iterable dataset
    shuffle = getattr(sampler, "shuffle", None)
    return LoaderPass(length=length, dataset_size=size, sampler=type(sampler).__name__,
                      shuffle=bool(shuffle) if isinstance(shuffle, bool) else _shuffles(sampler))


def _shuffles(sampler: Any) -> bool | None:
    """Whether a stock sampler shuffles; None for samplers this cannot know."""
    from torch.utils.data import RandomSampler, SequentialSampler

    if isinstance(sampler, RandomSampler):
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    return None
