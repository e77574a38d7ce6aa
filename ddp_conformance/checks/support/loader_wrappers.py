"""The batch samplers and loaders that wrap a DataLoader's own, read by their attributes, never by importing
the library that made them (Hugging Face accelerate, which the transformers Trainer uses too, is not a
dependency of the plugin).

accelerate shards the data without a DistributedSampler: `Accelerator.prepare(loader)` replaces the
loader's `BatchSampler` with a `BatchSamplerShard` (`batch_sampler`, `process_index`, `num_processes`,
`split_batches`, `even_batches`) that yields this rank's share of the inner one's batches (every
`num_processes`-th batch, or this rank's slice of each with `split_batches`), inside a `DataLoaderShard`
that iterates a plain DataLoader (`base_dataloader`) one batch ahead. `skip_first_batches` wraps the batch
sampler again, in a `SkipBatchSampler` (`batch_sampler`, `skip_batches`). An IterableDataset is wrapped in
an `IterableDatasetShard` (`dataset`, `process_index`, `num_processes`); `dispatch_batches` makes a
`DataLoaderDispatcher` whose rank 0 alone reads the data and sends every rank its slice.

What a rank trains is what the outermost batch sampler yields: the recorder (`observe.FitRecorder`) records
that one (`outermost`, `is_wrapper`), and reads the sampler that orders the samples, the batch size and the
dropped tail through the chain (`ordering_sampler`, `dropped_tail`). A wrapper this module does not know is
recorded as it yields, or without indices, never an error in the fit.
"""

from __future__ import annotations

import sys
from typing import Any

#: how deep a chain of wrappers is followed (a SkipBatchSampler around a BatchSamplerShard around a BatchSampler)
MAX_DEPTH = 8


def inner_batch_sampler(batch_sampler: Any) -> Any:
    """The batch sampler `batch_sampler` wraps (its `batch_sampler` attribute), None when it wraps none."""
    inner = getattr(batch_sampler, "batch_sampler", None)
    return inner if inner is not None and inner is not batch_sampler and hasattr(inner, "__iter__") else None


def is_wrapper(batch_sampler: Any) -> bool:
    """Whether a batch sampler wraps another and yields batches of its own making from it (a shard, a skip)."""
    return batch_sampler is not None and inner_batch_sampler(batch_sampler) is not None


def chain(batch_sampler: Any) -> list[Any]:
    """The batch sampler and those it wraps, outermost first."""
    found = [batch_sampler]
    while len(found) < MAX_DEPTH:
        inner = inner_batch_sampler(found[-1])
        if inner is None:
            break
        found.append(inner)
    return found


def outermost(loader: Any) -> Any:
    """The batch sampler whose batches a loader fetches: its `batch_sampler`, or a batch sampler it was given as
    its `sampler` (accelerate's `DataLoaderShard(sampler=BatchSamplerShard)` for a loader built that way)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None or not is_wrapper(batch_sampler):
        sampler = getattr(loader, "sampler", None)
        if is_wrapper(sampler):
            return sampler
    return batch_sampler


def ordering_sampler(batch_sampler: Any) -> Any:
    """The sampler that orders the samples under a chain of wrappers (the innermost batch sampler's `sampler`),
    None when no batch sampler in the chain has one."""
    for link in chain(batch_sampler):
        sampler = getattr(link, "sampler", None)
        if sampler is not None:
            return sampler
    return None


def shard(batch_sampler: Any) -> tuple[int, int] | None:
    """(process_index, num_processes) of the first wrapper in the chain that shards by process, None without one."""
    return next((found for found in map(_process_of, chain(batch_sampler)) if found is not None), None)


def _process_of(link: Any) -> tuple[int, int] | None:
    """(process_index, num_processes) of a batch sampler that shards by process itself, else None."""
    index, count = getattr(link, "process_index", None), getattr(link, "num_processes", None)
    return (index, count) if isinstance(index, int) and isinstance(count, int) else None


def _sharding(links: list[Any]) -> Any:
    """The wrapper in a chain (`chain`) that shards by process, above its innermost batch sampler; None without one."""
    return next((link for link in links[:-1] if _process_of(link) is not None), None)


def described(batch_sampler: Any) -> str | None:
    """The wrappers around the loader's batches, outermost first, for a note ("BatchSamplerShard (process 1 of 2)
    over BatchSampler"); None when the batch sampler wraps nothing."""
    links = chain(batch_sampler)
    if len(links) < 2:
        return None
    names = []
    for link in links:
        process, skip = _process_of(link), getattr(link, "skip_batches", None)
        name = type(link).__name__
        if process is not None:
            split = " splitting each batch" if getattr(link, "split_batches", False) else ""
            name += f" (process {process[0]} of {process[1]}{split})"
        elif isinstance(skip, int):
            name += f" (skips {skip} batches)"
        names.append(name)
    return " over ".join(names)


def dropped_tail(batch_sampler: Any, plain: type) -> int:
    """What a loader's batching leaves out of each epoch of this rank's share: a `plain` BatchSampler with
    `drop_last=True` its last, incomplete batch; a BatchSamplerShard over one with `drop_last=True` also the
    batches that would not reach every process. A batch sampler that cannot tell its length or size drops
    nothing this can know (0)."""
    links = chain(batch_sampler)
    base = links[-1]
    if not isinstance(base, plain) or not getattr(base, "drop_last", False):
        return 0
    try:
        size = len(base.sampler)
        kept = len(base) * base.batch_size
    except (TypeError, AttributeError):
        return 0
    sharded = _sharding(links)
    if sharded is None:
        return size - kept
    _, processes = _process_of(sharded)  # type: ignore[misc]
    try:
        batches = len(sharded)
    except TypeError:
        return 0
    per_batch = base.batch_size // processes if getattr(sharded, "split_batches", False) else base.batch_size
    return max(0, size // processes - batches * per_batch)


def padded_share(batch_sampler: Any) -> int | None:
    """The samples each rank draws an epoch where a BatchSamplerShard evens the ranks' batches itself
    (`even_batches`, over a BatchSampler that keeps its last batch): it completes the last batch, and adds
    batches until every process has as many, from the epoch's first samples. That is whole batches, not
    DistributedSampler's single samples: at world size 2 and batch size 4, 187 samples give each rank 96, 5
    repeats. None where no such shard pads (DistributedSampler's rule applies)."""
    links = chain(batch_sampler)
    base = links[-1]
    sharded = _sharding(links)
    size = getattr(base, "batch_size", None)
    if sharded is None or not getattr(sharded, "even_batches", False) or getattr(base, "drop_last", True) \
            or not isinstance(size, int):
        return None
    _, processes = _process_of(sharded)  # type: ignore[misc]
    try:
        batches = len(base)
    except TypeError:
        return None
    if getattr(sharded, "split_batches", False):
        return batches * (size // processes)
    return -(-batches // processes) * size


def reading_ahead(loader: Any, depth: int = 4) -> Any:
    """The wrapper whose `__iter__` is iterating `loader` right now (accelerate's DataLoaderShard keeps it as its
    `base_dataloader` and reads it one batch ahead of what it yields), found among the callers' frames; None when
    the loop iterates `loader` itself."""
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not loader and _base(owner) is loader:
            return owner
    return None


def _base(owner: Any) -> Any:
    try:
        return object.__getattribute__(owner, "__dict__").get("base_dataloader")
    except (AttributeError, TypeError):
        return None


def dispatches(adapter: Any) -> bool:
    """Whether a loader wrapper reads the data on one process and sends each its slice (accelerate's
    DataLoaderDispatcher, `dispatch_batches=True`): the indices a rank trains are not drawn on that rank."""
    return adapter is not None and "slice_fn" in object.__getattribute__(adapter, "__dict__")


def trained_yield(adapter: Any, yielded: int) -> int:
    """Which of the batches its DataLoader has yielded (1-based count `yielded`) a read-ahead wrapper has handed
    the loop last: the one before the batch it read ahead, or the last one once the DataLoader is exhausted
    (`end_of_dataloader`)."""
    if adapter is None or getattr(adapter, "end_of_dataloader", False):
        return yielded
    return max(1, yielded - 1)
