"""data_consistency: every rank builds the same dataset, item for item.

A DistributedSampler hands each rank different *indices* of one dataset; that partitions the data
only if index i is the same sample on every rank. A dataset generated from an unseeded RNG
(`torch.randn` at startup) is the same everywhere only by accident: under torchrun every process
starts from its own seeds (the harness's ranks do too, see `seeds.py`), so each rank generates, and
trains on, its own private data. Nothing crashes and the loss still falls.

How: each rank reseeds its RNGs from OS entropy (as a fresh process starts, whatever earlier tests
left), builds the trainer's dataset (`make_dataset`), reads the same SAMPLES indices on every rank
(drawn by a fixed seed from the dataset's length, first and last included) twice each, and hashes
the items' bytes (`states.item_digest`). Items whose two reads differ (random augmentation in
`__getitem__`) are left out of the comparison; when none is left, the check is skipped with that
reason, as it is for a dataset that cannot be indexed. The first rank, in rank order, whose items
differ from rank 0's is named, with the first index where they differ.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ..runner.seeds import fresh_seeds
from .base import CheckContext, all_gather, hide_on_verdict
from .observe import through_subsets
from .sampling import per_rank_split
from .states import item_digest

SAMPLES = 16
INDEX_SEED = 0


def sample_indices(size: int) -> list[int]:
    """The indices every rank reads: a fixed-seed sample, plus the first and the last item."""
    picked = random.Random(INDEX_SEED).sample(range(size), min(size, SAMPLES))
    return sorted({0, size - 1, *picked}) if size else []


def _read(dataset: Any, indices: list[int]) -> dict[int, str | None]:
    """index -> digest of the item, or None when two reads of it differ (the item is random)."""
    found: dict[int, str | None] = {}
    for index in indices:
        first, second = item_digest(dataset[index]), item_digest(dataset[index])
        found[index] = first if first == second else None
    return found


def _mine(ctx: CheckContext) -> dict[str, Any]:
    """This rank's view of the trainer's dataset: its length and the sampled items' digests, or why not."""
    fresh_seeds()
    adapter = ctx.adapter()
    with ctx.training():
        dataset = adapter.make_dataset()
    try:
        size = len(dataset)  # type: ignore[arg-type]
        indices = sample_indices(size)
        return {"size": size, "digests": _read(dataset, indices), **_split_of(dataset)}
    except (TypeError, NotImplementedError, KeyError) as exc:
        return {"unindexable": f"{type(dataset).__name__}: {type(exc).__name__}: {exc}".splitlines()[0][:200]}


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
    everyone = all_gather(_mine(ctx))
    if any("unindexable" in view for view in everyone):
        why = next(view["unindexable"] for view in everyone if "unindexable" in view)
        pytest.skip(f"the trainer's dataset cannot be read by index ({why}), so the ranks' items at the same index "
                    "cannot be compared")
    sizes = [view["size"] for view in everyone]
    figures: dict[str, Any] = {"dataset_size": sizes[0], "dataset_sizes_per_rank": sizes}
    if len(set(sizes)) > 1:
        rank = next(r for r, size in enumerate(sizes) if size != sizes[0])
        raise ctx.fail(f"rank {rank}'s dataset has {sizes[rank]} items where rank 0's has {sizes[0]}: every rank must "
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
            raise ctx.fail(f"rank {rank}'s dataset differs from rank 0's at index {where[0]} ({len(where)} of "
                           f"{len(stable)} sampled items differ{others}): {split}", **figures)
        raise ctx.fail(f"rank {rank}'s dataset differs from rank 0's at index {where[0]} ({len(where)} of "
                       f"{len(stable)} sampled items differ{others}): is the data generated without a seed, or "
                       "ordered by a set of strings or by hash()? Every torchrun process starts from its own RNG "
                       "seeds and its own str hash secret, so each rank trains on its own private data; build it "
                       "from a seeded torch.Generator (or load it), and order names with sorted(), not set()",
                       **figures)
    figures["summary"] = f"{len(stable)} sampled items identical"
    return figures
