"""Every pass of a DataLoader over its data during a fit, and the dataset indices each batch drew (`LoaderWatch`).

`FitRecorder` owns one for the fit: it wraps the public `DataLoader.__iter__` and `BatchSampler.__iter__` for
the duration of the fit (restored after; a DataLoader subclass that calls `super().__iter__()` is seen too),
and the `__iter__` of the class of a hand-written batch sampler a loader uses (a `Sampler` yielding lists of
indices, as length-bucketing samplers are written). A loader whose batches are not lists of indices is
recorded without them (the recorder digests what each training micro-batch was fed instead). On request
(the plan's `keep_batches`) it keeps the batches a loader yielded for the first step, as CPU copies; with the
plan's `draws` it records which batch of which pass each micro-batch trained.
"""

from __future__ import annotations

import collections.abc
import contextlib
import numbers
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler, Subset

from . import loader_wrappers
from .fit_record import FirstStep, FitRecord, LoaderPass, base_index
from .fit_watch import FitPlan

#: with `draws`: the latest batches a micro-batch may have come from (a loop holds one, or two reading ahead)
HELD_BATCHES = 8


class LoaderWatch:
    """Records the fit's loader passes into `record.passes`; `patch(owner, name, make)` wraps a method until the
    fit ends, `own_draws()` marks what the RNG gives inside it as a DataLoader's own, and `heartbeat()` says the
    rank is alive as a pass begins."""

    def __init__(self, record: FitRecord, plan: FitPlan, hooks: LoaderHooks) -> None:
        self.record = record
        self._keep_batches = plan.keep_batches and plan.first_step
        self._draws = plan.draws
        self._patch, self._own_draws, self._heartbeat = hooks
        # with `draws`: by pass, each yielded batch's tensors, held weakly: a batch the loop has let go of can match no
        # micro-batch (a new tensor may take the memory a freed one had)
        self._yield_tensors: dict[int, list[list[weakref.ref[Any]]]] = {}
        self._yielded: tuple[int, int, Any] | None = None  # (pass index, batches it yielded, the last one)
        self._yielded_before: Any = None  # the batch yielded before `_yielded`'s, for a loader read one ahead
        self._ahead: dict[int, Any] = {}  # pass index -> the wrapper that reads its loader ahead (`loader_wrappers`)
        self._watched: set[type] = set()  # hand-written batch sampler classes whose __iter__ is wrapped
        self._claimed: set[int] = set()  # passes whose batches a batch sampler records

    def install(self) -> None:
        self._patch(DataLoader, "__iter__", self._loader_iter)
        if self._draws is not None:
            for loader_type in _loader_types():
                if "__iter__" in vars(loader_type):
                    self._patch(loader_type, "__iter__", self._outer_iter)
        self._patch(BatchSampler, "__iter__", self._batch_sampler_iter)

    def micro_batch(self, inputs: Any) -> None:
        """What the plan asks of each micro-batch: which batch of the newest pass it trains (`draws`), and in the
        first step that batch itself (`keep_batches`)."""
        record, newest = self.record, len(self.record.passes) - 1
        if self._draws is not None:
            record.micro_draws.append((newest, self._trained_batch(inputs), record.optimizer_steps))
        first = record.first_step
        if self._keep_batches and first is not None and first.grads is None:
            self._keep_batch(first, newest)

    def _keep_batch(self, first: FirstStep, newest: int) -> None:
        """The batch the newest pass last yielded, for this micro-batch of the first step."""
        dispatched = newest >= 0 and self.record.passes[newest].dispatched
        if self._yielded is not None and self._yielded[0] == newest and not dispatched:
            # a wrapper that reads the DataLoader one batch ahead (accelerate's DataLoaderShard) hands the loop
            # the batch before the last one it drew
            count = loader_wrappers.trained_yield(self._ahead.get(newest), self._yielded[1])
            first.sources.append((newest, count))
            first.batches.append(self._yielded[2] if count == self._yielded[1] else self._yielded_before)
        else:
            first.sources.append((newest if newest >= 0 else None, 0))
            first.batches.append(None)

    def _trained_batch(self, inputs: Any) -> int:
        """Which batch of the newest pass a micro-batch trains: the latest one, still alive, whose tensors its
        forward's inputs are or are views of (a loop that reads one ahead, as Lightning's, has yielded the next batch
        already; one that skips what a resume consumed, `if i < skip: continue`, has yielded batches it never
        trains); else the latest one yielded, as a loop that copies the batch to another device trains (through a
        wrapper that reads its DataLoader one ahead, accelerate's DataLoaderShard, the one before it). -1 where the
        pass yielded none."""
        yielded = self._yield_tensors.get(len(self.record.passes) - 1, [])
        storages = _storages(_tensors(inputs))
        for nth in range(len(yielded) - 1, max(-1, len(yielded) - 1 - HELD_BATCHES), -1):
            alive = [tensor for tensor in (ref() for ref in yielded[nth]) if tensor is not None]
            if _storages(alive) & storages:
                return nth
        ahead = self._ahead.get(len(self.record.passes) - 1)
        return loader_wrappers.trained_yield(ahead, len(yielded)) - 1 if yielded else -1

    def _drawn(self, loader: Any) -> Callable[[int, int, Any], None]:
        """With `draws`: what records each batch the loop gets from `loader` into the pass it came from (-1: the
        newest). Its indices are the batch sampler's last batch where the loader fetches in the loop's own process
        (`num_workers=0`: each batch is fetched as the loop asks for it), else what `draws(batch)` reads."""

        def on_draw(index: int, count: int, batch: Any) -> None:
            if not self.record.passes:
                return
            target = self.record.passes[index]
            indices: list[int] | None = None
            if target.indexed and target.batches and getattr(loader, "num_workers", 1) == 0:
                indices = [base_index(target.index_map, i) for i in target.batches[-1]]
            else:
                try:
                    indices = [int(i) for i in self._draws(batch)]  # type: ignore[misc]
                except Exception:  # the trainer's batch_indices cannot read it: said by the check that asked
                    indices = None
            target.yielded.append(indices)
            at = index if index >= 0 else len(self.record.passes) - 1
            held = self._yield_tensors.setdefault(at, [])
            held.append([weakref.ref(tensor) for tensor in _tensors(batch)])
            if len(held) > HELD_BATCHES:
                held[-HELD_BATCHES - 1] = []  # out of the window a micro-batch is matched in

        return on_draw

    def _on_yield(self, index: int, count: int, batch: Any) -> None:
        first = self.record.first_step
        if first is None or first.grads is None:  # only the first step's batches are kept
            self._yielded_before = self._yielded[2] if self._yielded is not None and self._yielded[0] == index else None
            self._yielded = (index, count, cpu_copy(batch))

    def _loader_iter(self, original: Any) -> Any:
        watch = self

        def __iter__(loader: Any) -> Any:
            watch.record.passes.append(_new_pass(loader))
            watch._watch_batch_sampler(loader_wrappers.outermost(loader))
            ahead = loader_wrappers.reading_ahead(loader)
            if ahead is not None:
                watch._ahead[len(watch.record.passes) - 1] = ahead
                watch.record.passes[-1].dispatched = loader_wrappers.dispatches(ahead)
            watch._heartbeat()  # alive before the first batch (a slow first pass)
            with watch._own_draws():  # the pass's `_base_seed`
                iterator = original(loader)
            newest = len(watch.record.passes) - 1
            if watch._keep_batches:
                iterator = _Yields(iterator, watch._on_yield, newest)
            if watch._draws is not None and not _iterates_itself(type(loader)):
                iterator = _Yields(iterator, watch._drawn(loader), newest)
            return iterator

        return __iter__

    def _outer_iter(self, original: Any) -> Any:
        """A DataLoader subclass's own `__iter__` (a loader that skips what a resume consumed): what its iterator
        yields is what the loop trains, not what the DataLoader it calls underneath yields."""
        watch = self

        def __iter__(loader: Any) -> Any:
            if type(loader).__iter__ is not __iter__:  # a subclass of a subclass: the outermost records
                return original(loader)
            return _Yields(original(loader), watch._drawn(loader), -1)

        return __iter__

    def _watch_batch_sampler(self, batch_sampler: Any) -> None:
        """Record a hand-written batch sampler's batches as a BatchSampler's: its class's `__iter__`
        is wrapped until the fit ends (a built-in iterable, a list of lists, cannot be). So is a BatchSampler
        subclass that wraps another (accelerate's BatchSamplerShard, SkipBatchSampler): the outermost records
        the pass, so its batches, this rank's share, are the ones recorded (`loader_wrappers`)."""

        owner = type(batch_sampler)
        plain = isinstance(batch_sampler, BatchSampler) and not loader_wrappers.is_wrapper(batch_sampler)
        if batch_sampler is None or plain or owner in self._watched:
            return
        self._watched.add(owner)
        with contextlib.suppress(AttributeError, TypeError):
            self._patch(owner, "__iter__", self._batch_sampler_iter)

    def _batch_sampler_iter(self, original: Any) -> Any:
        watch = self

        def __iter__(sampler: Any) -> Iterator[list[int]]:
            # the outermost batch sampler of a pass records it (one may wrap a BatchSampler: its
            # batches are the inner one's regrouped, and the loader's are the outer one's)
            passes = watch.record.passes
            fresh = passes and len(passes) - 1 not in watch._claimed and not passes[-1].iterable
            target = passes[-1] if fresh else None
            if target is not None:
                watch._claimed.add(len(passes) - 1)
                target.indexed = True
            return _recorded(original(sampler), target, watch._own_draws)

        return __iter__


class LoaderHooks(NamedTuple):
    """What the recorder lends its `LoaderWatch`."""

    patch: Callable[[type, str, Any], None]
    own_draws: Callable[[], contextlib.AbstractContextManager[None]]
    heartbeat: Callable[[], None]


def _tensors(batch: Any) -> Iterator[Any]:
    """The tensors of a batch, in its containers."""
    if isinstance(batch, torch.Tensor):
        yield batch
        return
    for item in children(batch) or []:
        yield from _tensors(item)


def _storages(tensors: Iterable[Any]) -> set[int]:
    """Where the tensors keep their data (views share their base's); an empty tensor's is 0, every empty one's."""
    found: set[int] = set()
    for tensor in tensors:
        try:
            pointer = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            continue
        if pointer:
            found.add(pointer)
    return found


def _loader_types() -> list[type]:
    """Every subclass of DataLoader defined so far, subclasses of subclasses too."""
    found: list[type] = []
    pending = list(DataLoader.__subclasses__())
    while pending:
        loader_type = pending.pop()
        if loader_type not in found:
            found.append(loader_type)
            pending += loader_type.__subclasses__()
    return found


def _iterates_itself(loader_type: type) -> bool:
    """Whether a DataLoader class has an `__iter__` of its own above DataLoader's (`_outer_iter` records it)."""
    mro = loader_type.__mro__
    return any("__iter__" in vars(owner) for owner in mro[:mro.index(DataLoader)] if DataLoader in mro)


class _Yields:
    """A DataLoader pass's iterator that tells `on_yield(pass index, count, batch)` each batch it
    yields; everything else is the iterator's own."""

    def __init__(self, inner: Any, on_yield: Callable[[int, int, Any], None], index: int) -> None:
        self._inner, self._on_yield, self._index, self._count = inner, on_yield, index, 0

    def __iter__(self) -> _Yields:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._count += 1
        self._on_yield(self._index, self._count, batch)
        return batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def cpu_copy(batch: Any) -> Any:
    """`batch` with every tensor a detached CPU copy, its containers rebuilt as they were (mappings,
    named tuples, tuples, lists); anything else as it is."""

    if isinstance(batch, torch.Tensor):
        return batch.detach().cpu().clone()
    items = children(batch)
    return batch if items is None else rebuilt(batch, [cpu_copy(item) for item in items])


def _recorded(batches: Iterator[list[int]], target: LoaderPass | None,
              loaders_own: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[list[int]]:
    """The batch sampler's batches, recorded into `target`; a sampler's RNG draws (a RandomSampler
    seeds itself from torch's RNG at its first batch) are the loader's own."""
    batches = iter(batches)
    while True:
        with loaders_own():
            batch = next(batches, None)
        if batch is None:
            return
        if target is not None:
            if all(isinstance(i, numbers.Integral) for i in batch):
                target.batches.append([int(i) for i in batch])
            else:  # not dataset indices (a custom sampler yielding keys): nothing to judge by index
                target.indexed, target = False, None
        yield batch


def _new_pass(loader: Any) -> LoaderPass:
    # the sampler that orders the samples: a batch_sampler's own (DataLoader(batch_sampler=
    # BatchSampler(DistributedSampler(...))) leaves `loader.sampler` a default SequentialSampler), or
    # a batch sampler of its own making, which orders them itself

    batch_sampler = loader_wrappers.outermost(loader)
    sampler = loader_wrappers.ordering_sampler(batch_sampler)  # under accelerate's BatchSamplerShard too
    if batch_sampler is not None and not isinstance(batch_sampler, BatchSampler) and sampler is None:
        sampler = batch_sampler
    if sampler is None:
        sampler = getattr(loader, "sampler", None)
    dataset = getattr(loader, "dataset", None)
    base, index_map = through_subsets(dataset)
    length = _length(loader)
    size = _length(dataset)  # None for an iterable dataset

    shuffle = getattr(sampler, "shuffle", None)
    replacement = getattr(sampler, "replacement", None)
    return LoaderPass(length=length, dataset_size=size, sampler=type(sampler).__name__,
                      shuffle=bool(shuffle) if isinstance(shuffle, bool) else _shuffles(sampler),
                      replacement=bool(replacement) if isinstance(replacement, bool) else None,
                      iterable=isinstance(dataset, IterableDataset), tail=dropped_tail(batch_sampler),
                      share=loader_wrappers.padded_share(batch_sampler),
                      wrappers=loader_wrappers.described(batch_sampler),
                      universe=sorted(set(index_map)) if index_map is not None else None, index_map=index_map,
                      base_size=_length(base) if index_map is not None else None, dataset=dataset)


def _length(sized: Any) -> int | None:
    """len(), or None for what has none (an iterable dataset or its loader, no dataset at all)."""
    try:
        return len(sized)
    except TypeError:
        return None


def through_subsets(dataset: Any) -> tuple[Any, list[int] | None]:
    """The dataset a chain of `Subset`s views, and the map from the outer indices to its own (None
    when the loader's dataset is no Subset): a rank that trains on its own Subset shard draws
    indices that mean nothing next to another rank's until they are the underlying dataset's."""

    index_map: list[int] | None = None
    while isinstance(dataset, Subset):
        inner = [int(i) for i in dataset.indices]
        index_map = inner if index_map is None else [inner[i] for i in index_map]
        dataset = dataset.dataset
    return dataset, index_map


def dropped_tail(batch_sampler: Any) -> int:
    """What `DataLoader(drop_last=True)` leaves out of each epoch of its sampler: the last, incomplete
    batch, read through the batch samplers that wrap it (`loader_wrappers.dropped_tail`). A sampler that
    cannot tell its length drops nothing this can know."""

    if not isinstance(batch_sampler, BatchSampler):
        return 0
    return loader_wrappers.dropped_tail(batch_sampler, BatchSampler)


def _shuffles(sampler: Any) -> bool | None:
    """Whether a stock sampler shuffles; None for samplers this cannot know."""

    if isinstance(sampler, RandomSampler):
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    return None


def children(batch: Any) -> list[Any] | None:
    """The items of a container batch (a mapping's values in key order), None for a leaf."""

    if isinstance(batch, collections.abc.Mapping):
        return list(batch.values())
    if isinstance(batch, list | tuple):
        return list(batch)
    return None


def rebuilt(like: Any, items: list[Any]) -> Any:
    """A container of `like`'s kind holding `items` (as `children` listed them)."""

    if isinstance(like, collections.abc.Mapping):
        values = dict(zip(like.keys(), items, strict=True))
        try:
            return type(like)(values)
        except Exception:  # a mapping type that cannot be built from a dict
            return values
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a named tuple
        return type(like)(*items)
    return type(like)(items) if isinstance(like, list | tuple) else like
