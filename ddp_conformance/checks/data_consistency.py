"""data_consistency: every rank builds the same dataset, item for item.

A DistributedSampler hands each rank different *indices* of one dataset; that partitions the data
only if index i is the same sample on every rank. A dataset generated from an unseeded RNG
(`torch.randn` at startup) is the same everywhere only by accident: under torchrun every process
starts from its own seeds (the harness's ranks do too, see `seeds.py`), so each rank generates, and
trains on, its own private data. Nothing crashes and the loss still falls.

How: each rank reseeds its RNGs from OS entropy (as a fresh process starts, whatever earlier tests
left), builds the trainer's dataset (`make_dataset`), reads the same SAMPLES indices on every rank
(drawn by a fixed seed from the dataset's length, first and last included) twice each, and hashes
the items' bytes (`model_state.item_digest`: a tensor by its dtype, shape and values, whatever its layout,
strides, device or class, `tensor_bytes`). Items whose two reads differ (random augmentation in
`__getitem__`) are left out of the comparison; when none is left, the check is skipped with that
reason, as it is for a dataset that cannot be indexed and for an item holding a tensor whose values
cannot be read (a meta tensor), which the skip names. The first rank, in rank order, whose items
differ from rank 0's is named, with the first index where they differ.

A trainer that cannot build its dataset on its own (a `script:` SPEC, whose dataset only its run
builds) is judged on the dataset its training loader iterates: each rank reseeds as above, runs
fit(1) under the fit recorder (`observe.FitRecorder` keeps each loader pass's dataset), and reads
that dataset the same way. Where every rank's loader iterates a Subset (a rank's own shard, a
random_split's part), the dataset under the Subsets is compared item for item, and the parts must be
one shared split or disjoint shards; overlapping parts that differ are a split drawn per rank, and
named so. A fit that trains on batches made without a DataLoader (nanoGPT's memmap and
`torch.randint`) or through an IterableDataset is skipped, saying which.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ..adapter import NotProvided
from ..runner.rank.seeds import fresh_seeds
from .support.check_context import CheckContext, all_gather, hide_on_verdict, on_every_rank
from .support.loader_watch import through_subsets
from .support.model_state import item_digest
from .support.progress import guarded_fit
from .support.sampling import per_rank_split
from .support.tensor_bytes import UnreadableTensor

SAMPLES = 16
INDEX_SEED = 0
FIT_STEPS = 1  # the fit whose training loader's dataset is read, for a trainer that cannot build it alone


def sample_indices(size: int) -> list[int]:
    """The indices every rank reads: a fixed-seed sample, plus the first and the last item."""
    picked = random.Random(INDEX_SEED).sample(range(size), min(size, SAMPLES))
    return sorted({0, size - 1, *picked}) if size else []


def _read(dataset: Any, indices: list[int]) -> dict[int, str | None]:
    """index -> digest of the item, or None when two reads of it differ (the item is random)."""
    found: dict[int, str | None] = {}
    for index in indices:
        try:
            first, second = item_digest(dataset[index], strict=True), item_digest(dataset[index], strict=True)
        except UnreadableTensor as exc:
            raise UnreadableTensor(f"item {index} holds a tensor the harness cannot read, {exc}") from exc
        found[index] = first if first == second else None
    return found


def _mine(ctx: CheckContext) -> dict[str, Any]:
    """This rank's view of the trainer's dataset: its length and the sampled items' digests, or why not."""
    fresh_seeds()
    adapter = ctx.adapter()
    with ctx.training():
        dataset = adapter.make_dataset()
    return _view(dataset)


def _view(dataset: Any) -> dict[str, Any]:
    """A dataset's length and the digests of its items at the sampled indices, or why it cannot be read."""
    try:
        size = len(dataset)  # type: ignore[arg-type]
        indices = sample_indices(size)
        return {"size": size, "digests": _read(dataset, indices), **_split_of(dataset)}
    except UnreadableTensor as exc:
        return {"lacks": f"the trainer's dataset's {exc}: the ranks' items cannot be compared"}
    except (TypeError, NotImplementedError, KeyError) as exc:
        return {"unindexable": f"{type(dataset).__name__}: {type(exc).__name__}: {exc}".splitlines()[0][:200]}


def _from_the_fit(ctx: CheckContext, missing: NotProvided) -> dict[str, Any]:
    """This rank's view of the dataset its training loader iterated in a short fit of the trainer, for
    a trainer that cannot build its dataset on its own (a script: SPEC): the dataset the fit trains
    on is the one whose items must match, however the trainer builds it. The fit starts from fresh
    RNG seeds, as a torchrun process does; `missing` is raised where the trainer has no fit either."""
    fresh_seeds()
    try:
        guarded_fit(ctx, "data", FIT_STEPS, lambda observer: ctx.adapter().fit(FIT_STEPS, observer=observer))
    except NotProvided as exc:
        if exc.what != "fit":
            raise
        raise missing from None
    passes = ctx.recordings["data"].training_passes()
    if not passes:
        return {"lacks": f"fit({FIT_STEPS}) trained on batches drawn through no DataLoader (made by hand, e.g. "
                         "nanoGPT's np.memmap and torch.randint get_batch): there is no dataset of its loaders to "
                         "read by index, so the ranks' items cannot be compared"}
    dataset = passes[0].dataset
    if passes[0].iterable:
        return {"lacks": f"fit({FIT_STEPS})'s training loader iterates an IterableDataset "
                         f"({type(dataset).__name__}): it has no indices to read the same items at on every rank "
                         "(sampler_disjointness judges what each rank reads)"}
    return _view(dataset)


def _split_of(dataset: Any) -> dict[str, Any]:
    """Where the dataset is a Subset (a random_split's part): the underlying indices it holds and the
    underlying dataset's sampled items, so that ranks holding other parts of the same data are told
    apart from ranks holding other data."""
    base, index_map = through_subsets(dataset)
    if index_map is None:
        return {}
    size = len(base)
    return {"universe": sorted(set(index_map)), "base": (size, _read(base, sample_indices(size)))}


def _per_rank_split(everyone: list[dict[str, Any]], rank: int) -> str:
    """The diagnosis when rank `rank`'s dataset differs from rank 0's only by which part of the same
    underlying data its Subset holds (sampler_disjointness names the same cause)."""
    views = (everyone[0], everyone[rank])
    if any("base" not in view for view in views) or views[0]["base"] != views[1]["base"]:
        return ""
    return per_rank_split([view["universe"] for view in views]).replace("ranks 0 and 1", f"ranks 0 and {rank}")


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    try:
        mine, source = on_every_rank(lambda: _mine(ctx)), "make_dataset"
    except NotProvided as exc:  # on every rank alike
        if exc.what != "make_dataset":
            raise
        mine, source = _from_the_fit(ctx, exc), f"the fit's training loader (fit({FIT_STEPS}))"
    everyone = all_gather(mine)
    lacking = next((view["lacks"] for view in everyone if "lacks" in view), None)
    if lacking is not None:
        pytest.skip(lacking)
    if any("unindexable" in view for view in everyone):
        why = next(view["unindexable"] for view in everyone if "unindexable" in view)
        pytest.skip(f"the trainer's dataset cannot be read by index ({why}), so the ranks' items at the same index "
                    "cannot be compared")
    figures: dict[str, Any] = {"dataset_from": source}
    if source != "make_dataset" and all("base" in view for view in everyone):
        return _judge_subsets(ctx, everyone, figures)
    return _judge_items(ctx, everyone, figures)


def _judge_items(ctx: CheckContext, everyone: list[dict[str, Any]], figures: dict[str, Any],
                 what: str = "dataset") -> dict[str, Any]:
    """Fail naming the first rank whose `what` has another length than rank 0's, or other items at a
    sampled index; else the figures."""
    __tracebackhide__ = hide_on_verdict
    sizes = [view["size"] for view in everyone]
    figures.update(dataset_size=sizes[0], dataset_sizes_per_rank=sizes)
    if len(set(sizes)) > 1:
        rank = next(r for r, size in enumerate(sizes) if size != sizes[0])
        raise ctx.fail(f"rank {rank}'s {what} has {sizes[rank]} items where rank 0's has {sizes[0]}: every rank must "
                       "build the same dataset (the sampler splits indices, not data)", **figures)
    reference = everyone[0]["digests"]
    stable = [i for i, d in reference.items() if d is not None]
    figures.update(sampled_indices=len(reference), compared_indices=len(stable))
    if not stable:
        pytest.skip(f"every one of the {len(reference)} sampled items changes from one read to the next on rank 0 "
                    "(random augmentation in __getitem__?), so the ranks' items cannot be compared")
    differing = {r: [i for i in stable if view["digests"].get(i) not in (None, reference[i])]
                 for r, view in enumerate(everyone) if r}
    bad = [r for r, indices in differing.items() if indices]
    figures["differing_ranks"] = bad
    if bad:
        rank, where = bad[0], differing[bad[0]]
        others = f"; ranks {', '.join(map(str, bad))} all differ" if len(bad) > 1 else ""
        split = _per_rank_split(everyone, rank)
        if split:
            raise ctx.fail(f"rank {rank}'s {what} differs from rank 0's at index {where[0]} ({len(where)} of "
                           f"{len(stable)} sampled items differ{others}): {split}", **figures)
        raise ctx.fail(f"rank {rank}'s {what} differs from rank 0's at index {where[0]} ({len(where)} of "
                       f"{len(stable)} sampled items differ{others}): is the data generated without a seed, or "
                       "ordered by a set of strings or by hash()? Every torchrun process starts from its own RNG "
                       "seeds and its own str hash secret, so each rank trains on its own private data; build it "
                       "from a seeded torch.Generator (or load it), and order names with sorted(), not set()",
                       **figures)
    figures["summary"] = f"{len(stable)} sampled items identical"
    return figures


def _judge_subsets(ctx: CheckContext, everyone: list[dict[str, Any]], figures: dict[str, Any]) -> dict[str, Any]:
    """Every rank's training loader iterates a Subset (its own shard, or a random_split's part): the
    data under the Subsets must be the same on every rank, item for item, and the parts must be one
    shared split or disjoint shards, not parts drawn per rank that overlap."""
    __tracebackhide__ = hide_on_verdict
    bases = [{"size": view["base"][0], "digests": view["base"][1]} for view in everyone]
    figures = _judge_items(ctx, bases, figures, what="dataset under its loader's Subset")
    split = per_rank_split([view["universe"] for view in everyone])
    figures["subset_sizes_per_rank"] = [len(view["universe"]) for view in everyone]
    if split:  # the items under the Subsets are identical; which of them each rank holds is the verdict
        figures["summary"] = "per-rank random_split"
        raise ctx.fail(f"the ranks' training loaders iterate Subsets of the same {figures['dataset_size']} items that "
                       f"hold different samples: {split}", **figures)
    shared = all(view["universe"] == everyone[0]["universe"] for view in everyone)
    figures["summary"] += "; one shared split" if shared else "; each rank its own shard"
    return figures
