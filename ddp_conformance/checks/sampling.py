"""The logic of the sampler-disjointness check, on plain lists: pure, local, no torch.

Input: for each observed epoch, each rank's batches of dataset indices. The rules are
DistributedSampler's documented contract (torch/utils/data/distributed.py):
- without drop_last every rank gets ceil(N/R) samples; the union is the whole dataset and exactly
  ceil(N/R)*R - N indices appear twice (padding repeats the start of the epoch's permutation; tiny
  datasets wrap more than once);
- with drop_last every rank gets floor(N/R) samples, all distinct, and N mod R are left out;
- every rank gets the same number of batches (or DDP hangs at the epoch's end);
- with shuffling the order depends on `seed + epoch`, so it changes between epochs once
  `set_epoch` is called.
Any partition satisfying the counts is accepted (not only DistributedSampler's strided layout),
because the property users need is disjointness and coverage, not a particular layout.

Separate from the check so it can be property-tested against the real DistributedSampler
(tests/checks/test_sampling_properties.py) without a process group.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runner.verdict import ranks_label

#: the order rule needs this many observed positions per epoch: two epochs' shuffles agree on m
#: positions by chance with probability at most (N-m)!/N! <= 1/m!, negligible for m = 10 (1/3.6e6)
ORDER_MIN_SIZE = 10

Batches = Sequence[Sequence[int]]


@dataclass
class SamplingVerdict:
    ok: bool
    diagnosis: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


def _flat(batches: Batches) -> list[int]:
    return [int(i) for batch in batches for i in batch]



def _sample(values: Sequence[int], limit: int = 5) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", ..." if len(values) > limit else "")


def analyse_epoch(ranks: Sequence[Batches], dataset_size: int) -> SamplingVerdict:
    """One epoch: disjointness (up to padding), coverage (up to the dropped tail), equal batches."""
    world = len(ranks)
    seqs = [_flat(b) for b in ranks]
    counts = [len(s) for s in seqs]
    batches = [len(b) for b in ranks]
    figures: dict[str, Any] = {"samples_per_rank": counts, "batches_per_rank": batches}
    n = dataset_size
    for rank, seq in enumerate(seqs):
        bad = [i for i in seq if not 0 <= i < n]
        if bad:
            return SamplingVerdict(False, f"rank {rank} receives index {bad[0]} outside the dataset of {n} "
                                          "samples: the loader does not index the trainer's dataset", figures)
    total = sum(counts)
    union = set().union(*map(set, seqs)) if seqs else set()
    duplicates = total - len(union)
    missing = n - len(union)
    padded = math.ceil(n / world) if world else 0
    dropped = n // world if world else 0
    figures.update(padding_duplicates=duplicates, uncovered=missing)
    if all(c == 0 for c in counts):
        return SamplingVerdict(False, f"no rank receives any sample (dataset of {n}, world size {world}): "
                                      "the loaders are empty", figures)
    valid_padded = missing == 0 and all(c == padded for c in counts)
    valid_dropped = duplicates == 0 and all(c == dropped for c in counts)
    if valid_padded or valid_dropped:
        figures["mode"] = "padded" if valid_padded and duplicates else ("drop_last" if missing else "exact")
        figures["overlap_beyond_padding"] = 0
    else:
        figures["overlap_beyond_padding"] = max(0, duplicates - (padded * world - n))
        return SamplingVerdict(False, _diagnose_partition(seqs, n, world), figures)
    if len(set(batches)) > 1:
        low, high = min(batches), max(batches)
        return SamplingVerdict(False, f"{ranks_label([r for r, b in enumerate(batches) if b == low])} get {low} "
                                      f"batches and {ranks_label([r for r, b in enumerate(batches) if b == high])} "
                                      f"get {high}: uneven batch counts leave ranks waiting in DDP's all-reduce "
                                      "at the end of every epoch (the batching differs between ranks)", figures)
    return SamplingVerdict(True, "", figures)


def _diagnose_partition(seqs: list[list[int]], n: int, world: int) -> str:
    """Name the cause of a partition that is neither padded nor drop_last DistributedSampler output."""
    full = set(range(n))
    for r in range(world):
        for s in range(r + 1, world):
            if seqs[r] and seqs[r] == seqs[s]:
                return (f"ranks {r} and {s} receive identical index sequences ({len(seqs[r])} samples each, "
                        f"dataset {n}): no DistributedSampler, every rank iterates the same data")
    if world > 1 and n > 1 and all(set(s) >= full for s in seqs):
        return (f"every rank iterates the whole dataset ({n} samples) in its own order: no DistributedSampler "
                f"(or one built with num_replicas=1), so the {world} ranks train on the same samples")
    counts = [len(s) for s in seqs]
    union = set().union(*map(set, seqs))
    repeats = sum(counts) - len(union)
    missing = sorted(full - union)
    padding = math.ceil(n / world) * world - n
    if repeats - padding >= world:
        # more repeats than any DistributedSampler pads (< num_replicas): the shares come from
        # different permutations, not from strides of one
        shared, r, s = max(((len(set(seqs[r]) & set(seqs[s])), r, s) for r in range(world)
                            for s in range(r + 1, world)), default=(0, 0, 0))
        return (f"the ranks' samples overlap: {repeats} repeats where DistributedSampler's padding allows at most "
                f"{padding} (ranks {r} and {s} share {shared}): the ranks shuffle with different permutations (a "
                "sampler seed that differs per rank? DistributedSampler's shares are disjoint only when every rank "
                "uses the same seed)")
    if len(missing) > n % world:
        return (f"{len(missing)} of {n} samples reach no rank (e.g. {_sample(missing)}), more than a dropped tail "
                f"({n % world}), with {max(counts)} samples per rank at most instead of {math.ceil(n / world)}: the "
                "sampler's num_replicas/rank do not match the process group")
    if len(set(counts)) > 1:
        return (f"the ranks get different numbers of samples ({counts}): DistributedSampler gives every rank "
                f"{math.ceil(n / world)} (padded) or {n // world} (drop_last)")
    counter = Counter(i for s in seqs for i in s)
    return (f"the ranks' samples are not a partition of the dataset: counts per rank {counts}, "
            f"{len(missing)} uncovered, {sum(c - 1 for c in counter.values() if c > 1)} repeated "
            f"(DistributedSampler gives {math.ceil(n / world)} each, padded, or {n // world} with drop_last)")


def _unshuffled(seqs: list[list[int]], n: int) -> bool:
    """The ranks read the data in index order: DistributedSampler(shuffle=False)'s strided layout
    (rank r: r, r+R, r+2R ... mod N) or contiguous blocks. Exact layouts, so a real shuffle matches
    them with probability 1/N!, unlike "each rank's share happens to be sorted" (1/2 for 2 samples)."""
    world = len(seqs)
    strided = all(seq == [(r + j * world) % n for j in range(len(seq))] for r, seq in enumerate(seqs))
    flat = [i for seq in seqs for i in seq]
    return strided or flat == sorted(flat)


def analyse(epochs: Sequence[Sequence[Batches]], dataset_size: int, shuffle: bool,
            sampler: str = "DistributedSampler") -> SamplingVerdict:
    """Every epoch's partition, then the order across epochs when shuffling (`sampler`: the name of
    what orders the samples, for the advice)."""
    figures: dict[str, Any] = {"dataset_size": dataset_size, "epochs": len(epochs)}
    for epoch, ranks in enumerate(epochs):
        verdict = analyse_epoch(ranks, dataset_size)
        figures.update(verdict.figures)
        if not verdict.ok:
            return SamplingVerdict(False, f"{verdict.diagnosis} (epoch {epoch})", figures)
    figures["order_changes"] = None
    if shuffle and len(epochs) >= 2:
        per_rank = [[_flat(epoch[r]) for epoch in epochs] for r in range(len(epochs[0]))]
        judged = [orders for orders in per_rank if len(orders[0]) >= 2]
        if sum(len(orders[0]) for orders in judged) >= ORDER_MIN_SIZE:
            same = all(all(o == orders[0] for o in orders) for orders in judged)
            figures["order_changes"] = not same
            if same:
                if _unshuffled([orders[0] for orders in per_rank], dataset_size):
                    return SamplingVerdict(False, "the loader does not shuffle although data.shuffle is true: "
                                                  f"every rank reads its samples in index order in all {len(epochs)} "
                                                  "epochs", figures)
                cause = ("DistributedSampler.set_epoch(epoch) is never called" if sampler == "DistributedSampler"
                         else f"{sampler} is never told the epoch (set_epoch(epoch)), or shuffles with a seed "
                              "without it")
                return SamplingVerdict(False, f"the order is the same every epoch ({len(epochs)} epochs, every "
                                              f"rank): {cause}, so each epoch reuses the first epoch's shuffle",
                                       figures)
    return SamplingVerdict(True, "", figures)
