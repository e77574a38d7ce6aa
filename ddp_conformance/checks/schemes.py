"""Sampling schemes other than a partition, each held to its own invariant (sampler_disjointness).

- Independent per-rank draws with replacement (a `RandomSampler(replacement=True)` or
  `WeightedRandomSampler` per rank, seeded with seed + rank): samples may repeat within and across
  ranks by design, so disjointness is not asked. What must hold: every index is in the dataset, the
  ranks' draws differ (identical draws mean every rank trains the same batches: the per-rank seed
  is missing), and the draws change between epochs (else the model sees one fixed subset).
- A rank-sharded `IterableDataset`: there are no indices to judge, only what the model was fed.
  What must hold: the ranks' first training batches differ (identical ones mean every rank reads
  the same stream: the dataset is not sharded by rank).
"""

from __future__ import annotations

from typing import Any

from .base import CheckContext, all_gather, hide_on_verdict
from .observe import LoaderPass


def judge_with_replacement(ctx: CheckContext, passes: list[LoaderPass]) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    size = passes[0].dataset_size or 0
    mine = [[i for batch in p.batches for i in batch] for p in passes]
    everyone = all_gather(mine)
    figures: dict[str, Any] = {"scheme": "independent draws with replacement", "indices_from": "the fit",
                               "dataset_size": size, "samples_per_rank": [len(r[0]) for r in everyone]}
    outside = [(rank, i) for rank, draws in enumerate(everyone) for i in draws[0] if not 0 <= i < size]
    if outside:
        rank, index = outside[0]
        raise ctx.fail(f"rank {rank} draws index {index} outside the dataset of {size} samples: the sampler does "
                       "not index the trainer's dataset", **figures)
    first = [draws[0] for draws in everyone]
    if ctx.world_size > 1 and all(draws == first[0] for draws in first):
        raise ctx.fail(f"every rank draws the same {len(first[0])} samples in epoch 0 ({passes[0].sampler} with "
                       "replacement): each rank's sampler needs its own seed (seed + rank), or every rank trains "
                       "on the same batches", **figures)
    repeated = [rank for rank, draws in enumerate(everyone) if len(draws) > 1 and draws[0] == draws[1]]
    figures["draws_change_between_epochs"] = not repeated
    if repeated:
        raise ctx.fail(f"rank {repeated[0]} draws the same samples in epoch 0 and epoch 1 ({passes[0].sampler} with "
                       "replacement): its generator restarts from the same seed every epoch (seed it with the "
                       "epoch too), so the model sees one fixed subset", **figures)
    figures["summary"] = "independent draws, ok"
    return figures


def judge_iterable(ctx: CheckContext, passes: list[LoaderPass]) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    digests = all_gather(passes[0].first_input if passes else None)
    figures: dict[str, Any] = {"scheme": "iterable dataset", "indices_from": "the fit's inputs",
                               "distinct_first_batches": len(set(digests))}
    if ctx.world_size > 1 and None not in digests and len(set(digests)) == 1:
        raise ctx.fail(f"every rank trains on the same first batch: the IterableDataset yields one stream to all "
                       f"{ctx.world_size} ranks (shard it by rank, e.g. islice(stream, rank, None, world_size))",
                       **figures)
    ctx.note("an IterableDataset has no indices: only that the ranks read different data is judged")
    figures["summary"] = "iterable, ranks differ"
    return figures
