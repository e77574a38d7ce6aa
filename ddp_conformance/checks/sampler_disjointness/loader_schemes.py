"""Sampling schemes other than a partition, each held to its own invariant (sampler_disjointness).

- Independent per-rank draws with replacement (a `RandomSampler(replacement=True)` or
  `WeightedRandomSampler` per rank, seeded with seed + rank): samples may repeat within and across
  ranks by design, so disjointness is not asked. What must hold: every index is in the dataset, the
  ranks' draws differ (identical draws mean every rank trains the same batches: the per-rank seed
  is missing), and the draws change between epochs (else the model sees one fixed subset).
- A rank-sharded `IterableDataset`: there are no indices to judge, only what the model was fed.
  What must hold: the ranks' first training batches differ (identical ones mean every rank reads
  the same stream: the dataset is not sharded by rank).
- A map-style dataset batched by something other than lists of indices (a batch sampler of keys,
  as speech toolkits' are): no indices either, but every micro-batch's inputs are digested. What
  must hold: no two ranks are fed the same batch in an epoch (a sampler never sharded by rank feeds
  every rank the same ones), and, where the config shuffles, a rank's batches change between
  epochs (`set_epoch` that never reaches the sampler replays epoch 0).
"""

from __future__ import annotations

from typing import Any

import pytest

from ..support.check_context import CheckContext, all_gather, hide_on_verdict
from ..support.fit_record import LoaderPass
from ..support.sampling import replayed_epoch


def read_through_wrappers(ctx: CheckContext, passes: list[LoaderPass]) -> None:
    """Say which wrappers the indices were read through (accelerate's BatchSamplerShard, SkipBatchSampler:
    `support/loader_wrappers.py`); skip where the batches are dispatched (accelerate's `dispatch_batches`:
    rank 0 reads every rank's batches and sends each its slice, so no rank's own loader draws what it trains)."""
    __tracebackhide__ = hide_on_verdict
    if any(all_gather(any(p.dispatched for p in passes))):
        pytest.skip("the training loader dispatches its batches (accelerate's DataLoaderDispatcher, dispatch_batches="
                    "True): rank 0 reads every rank's batches and sends each its slice, so the indices a rank trains "
                    "are not drawn by its own loader and cannot be read by rank")
    mine = next((p.wrappers for p in passes if p.wrappers), None)
    if mine:
        ctx.note(f"the indices are read from what the loader's batch sampler yields to this rank: {mine}")


def judge_with_replacement(ctx: CheckContext, passes: list[LoaderPass]) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    size = passes[0].dataset_size or 0
    mine = [[i for batch in p.batches for i in batch] for p in passes]
    everyone = all_gather(mine)
    figures: dict[str, Any] = {"scheme": "independent draws with replacement", "indices_from": "the fit",
                               "dataset_size": size, "samples_per_rank": [len(r[0]) for r in everyone]}
    outside = [(rank, i) for rank, draws in enumerate(everyone) for epoch in draws for i in epoch
               if not 0 <= i < size]
    if outside:
        rank, index = outside[0]
        raise ctx.fail(f"rank {rank} draws index {index} outside the dataset of {size} samples: the sampler does "
                       "not index the trainer's dataset", **figures)
    for epoch in range(min(len(draws) for draws in everyone)):
        drawn = [draws[epoch] for draws in everyone]
        if ctx.world_size > 1 and all(d == drawn[0] for d in drawn):
            raise ctx.fail(f"every rank draws the same {len(drawn[0])} samples in epoch {epoch} "
                           f"({passes[epoch].sampler} with replacement): each rank's sampler needs its own seed "
                           "(seed + rank), or every rank trains on the same batches", **figures)
    replays = [(rank, replayed_epoch([draws])) for rank, draws in enumerate(everyone)]
    repeated = [(rank, replay) for rank, replay in replays if replay is not None]
    figures["draws_change_between_epochs"] = not repeated
    if repeated:
        rank, (epoch, earlier) = repeated[0]
        raise ctx.fail(f"rank {rank} draws the same samples in epoch {earlier} and epoch {epoch} ({passes[0].sampler} "
                       "with replacement): its generator restarts from the same seed (seed it with the epoch too), "
                       "so the model sees one fixed subset", **figures)
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


def judge_inputs(ctx: CheckContext, passes: list[LoaderPass], shuffle: bool) -> dict[str, Any]:
    """The fit's own inputs, epoch by epoch (`passes`: this rank's complete training passes)."""
    __tracebackhide__ = hide_on_verdict
    everyone = all_gather([p.inputs for p in passes])
    if any(None in epoch for epochs in everyone for epoch in epochs):
        ctx.note("the fit's inputs are not judged: the model's forward gets no tensor positionally (keyword "
                 "arguments, model(input_ids=x), never reach a global forward hook)")
        return {"indices_from": None}
    figures, diagnosis = inputs_verdict(everyone, shuffle, passes[0].sampler)
    if diagnosis:
        raise ctx.fail(diagnosis, **figures)
    if shuffle and figures["order_changes"] is None:
        ctx.note(f"too few batches per epoch (< {ORDER_MIN_BATCHES}) to judge their order across epochs")
    return figures


# a rank's batches replayed in the same order in two epochs, by chance, with probability 1/k! for k
# batches whose contents a sampler keeps fixed and only reorders (bucketing samplers): 2.5e-5 for 8
ORDER_MIN_BATCHES = 8


def inputs_verdict(everyone: list[list[list[str]]], shuffle: bool, sampler: str) -> tuple[dict[str, Any], str]:
    """Figures and the diagnosis ("" when sound) from every rank's input digests, epoch by epoch
    (`everyone[rank][epoch]`): one batch fed to two ranks in an epoch, or an epoch replayed."""
    figures: dict[str, Any] = {"indices_from": "the fit's inputs",
                               "batches_seen_per_rank": [len(r[0]) for r in everyone]}
    for epoch in range(min(len(epochs) for epochs in everyone)):
        shared = shared_batch([epochs[epoch] for epochs in everyone])
        if shared:
            (first, second), position = shared
            return figures, (
                f"ranks {first} and {second} train on the same batch in epoch {epoch} (batch {position} of rank "
                f"{second}, inputs identical): the batches ({sampler}) are not sharded by rank, so the ranks train "
                "on the same samples (give each rank its own share, e.g. indices[rank::world_size], or a "
                "DistributedSampler under a BatchSampler)")
    judged = [(rank, epochs) for rank, epochs in enumerate(everyone)
              if len(epochs) > 1 and len(epochs[0]) >= ORDER_MIN_BATCHES]
    replays = [(rank, replayed_epoch([epochs])) for rank, epochs in judged]
    replayed = [(rank, replay) for rank, replay in replays if replay is not None]
    figures["order_changes"] = not replayed if shuffle and judged else None
    if shuffle and replayed:
        rank, (epoch, earlier) = replayed[0]
        return figures, (f"rank {rank} trains on the same batches in the same order in epoch {earlier} and epoch "
                         f"{epoch} ({sampler}): the shuffle does not change between epochs (pass the epoch to the "
                         "sampler, e.g. set_epoch(epoch), before each epoch)")
    figures["summary"] = "inputs differ by rank"
    return figures, ""


def shared_batch(batches: list[list[str]]) -> tuple[tuple[int, int], int] | None:
    """The first pair of ranks fed one identical batch in an epoch (`batches`: each rank's input
    digests), and its position in the second rank's epoch; None when every batch is its rank's own.
    A rank's last batch is left out where it has others: padding to equal lengths (as
    DistributedSampler pads) may repeat another rank's samples there, a whole batch when it holds one."""
    owner: dict[str, int] = {}
    for rank, digests in enumerate(batches):
        for position, digest in enumerate(digests):
            if position == len(digests) - 1 > 0:
                continue
            if owner.get(digest, rank) != rank:
                return (owner[digest], rank), position
            owner.setdefault(digest, rank)
    return None
