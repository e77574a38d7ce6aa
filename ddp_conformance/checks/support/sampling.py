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

from ...runner.ranks import ranks_label

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


def padded_epoch(dataset_size: int, world: int, share: int | None = None) -> tuple[int, int]:
    """(samples per rank, repeats the padding adds) of a padded epoch: DistributedSampler's ceil(N/R) each,
    or `share`, what a sharding that pads whole batches gives each rank (`loader_wrappers.padded_share`)."""
    per_rank = share if share is not None else (math.ceil(dataset_size / world) if world else 0)
    return per_rank, per_rank * world - dataset_size


def _padding_words(share: int | None) -> str:
    return ("DistributedSampler's padding" if share is None else
            "the sharding's padding (whole batches from the epoch's start, accelerate's even_batches)")


def analyse_epoch(ranks: Sequence[Batches], dataset_size: int, tail: int = 0,
                  share: int | None = None) -> SamplingVerdict:
    """One epoch: disjointness (up to padding), coverage (up to the dropped tail), equal batches.
    `tail`: the samples the loader itself leaves out at the end of each rank's share
    (`DataLoader(drop_last=True)`: its last, incomplete batch), which no rank draws; `share`: the samples
    each rank draws where the sharding pads whole batches (accelerate's BatchSamplerShard), not
    DistributedSampler's single ones."""
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
    padded, padding = padded_epoch(n, world, share)
    dropped = n // world if world else 0
    figures.update(padding_duplicates=duplicates, uncovered=missing)
    if all(c == 0 for c in counts):
        return SamplingVerdict(False, f"no rank receives any sample (dataset of {n}, world size {world}): "
                                      "the loaders are empty", figures)
    # a share with its loader's tail left out: any padding repeats may be in that tail
    valid_padded = duplicates <= padding and all(c == padded - tail for c in counts)
    valid_dropped = duplicates == 0 and all(c == dropped - tail for c in counts)
    if tail:
        figures["loader_drops_per_rank"] = tail
    if valid_padded or valid_dropped:
        figures["mode"] = "padded" if valid_padded and duplicates else ("drop_last" if missing else "exact")
        figures["overlap_beyond_padding"] = 0
    else:
        figures["overlap_beyond_padding"] = max(0, duplicates - padding)
        return SamplingVerdict(False, _diagnose_partition(seqs, n, world, tail, share), figures)
    if len(set(batches)) > 1:
        low, high = min(batches), max(batches)
        return SamplingVerdict(False, f"{ranks_label([r for r, b in enumerate(batches) if b == low])} get {low} "
                                      f"batches and {ranks_label([r for r, b in enumerate(batches) if b == high])} "
                                      f"get {high}: uneven batch counts leave ranks waiting in DDP's all-reduce "
                                      "at the end of every epoch (the batching differs between ranks)", figures)
    return SamplingVerdict(True, "", figures)


def _diagnose_partition(seqs: list[list[int]], n: int, world: int, tail: int = 0, share: int | None = None) -> str:
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
    padded, padding = padded_epoch(n, world, share)
    if repeats - padding >= world:
        # more repeats than any DistributedSampler pads (< num_replicas): the shares come from
        # different permutations, not from strides of one
        shared, r, s = max(((len(set(seqs[r]) & set(seqs[s])), r, s) for r in range(world)
                            for s in range(r + 1, world)), default=(0, 0, 0))
        return (f"the ranks' samples overlap: {repeats} repeats where {_padding_words(share)} allows at most "
                f"{padding} (ranks {r} and {s} share {shared}): the ranks shuffle with different permutations (a "
                "sampler seed that differs per rank? DistributedSampler's shares are disjoint only when every rank "
                "uses the same seed), or choose their shares by hash() of names, which differs per process")
    if len(missing) > n % world + world * tail:
        return (f"{len(missing)} of {n} samples reach no rank (e.g. {_sample(missing)}), more than a dropped tail "
                f"({n % world + world * tail}), with {max(counts)} samples per rank at most instead of "
                f"{padded - tail}: the sampler's num_replicas/rank do not match the process group")
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


def analyse_started_epoch(ranks: Sequence[Sequence[int]], dataset_size: int, epoch: int,
                          sampler: str = "DistributedSampler", share: int | None = None) -> SamplingVerdict:
    """An epoch the fit started but may not have finished (`ranks`: what each rank drew of it so
    far): whatever the ranks drew must still be disjoint, apart from DistributedSampler's padding.
    A partition's shares stay disjoint in any prefix, and padding (at most R - 1 repeats) comes only
    at their ends, so only overlap beyond it is a fault: the ranks draw from a loader that is not
    sharded by rank."""
    world, n = len(ranks), dataset_size
    seqs = [[int(i) for i in seq] for seq in ranks]
    figures: dict[str, Any] = {"started_epoch": epoch, "drawn_per_rank": [len(seq) for seq in seqs]}
    outside = [(rank, i) for rank, seq in enumerate(seqs) for i in seq if not 0 <= i < n]
    if outside:
        rank, index = outside[0]
        return SamplingVerdict(False, f"rank {rank} receives index {index} outside the dataset of {n} samples in epoch "
                                      f"{epoch}: the loader does not index the trainer's dataset", figures)
    repeats = sum(map(len, seqs)) - len(set().union(*map(set, seqs)))
    padding = padded_epoch(n, world, share)[1] if world else 0
    figures["overlap_beyond_padding"] = max(0, repeats - padding)
    if repeats <= padding:
        return SamplingVerdict(True, "", figures)
    unsharded = "" if sampler == "DistributedSampler" else "no DistributedSampler: "
    for r in range(world):
        for other in range(r + 1, world):
            shared = min(len(seqs[r]), len(seqs[other]))
            if shared and seqs[r][:shared] == seqs[other][:shared]:
                return SamplingVerdict(False, (
                    f"ranks {r} and {other} receive identical samples in epoch {epoch} (the first {shared} of each, "
                    f"{sampler}): {unsharded}from epoch {epoch} the fit trains every rank on the same data (a loader "
                    "rebuilt mid-run without sharding it by rank?)"), figures)
    return SamplingVerdict(False, (
        f"the ranks' samples overlap in epoch {epoch}: {repeats} repeats among the {sum(map(len, seqs))} drawn so far, "
        f"where {_padding_words(share)} allows at most {padding} ({sampler}): {unsharded}from epoch {epoch} the "
        "ranks' shares are not a partition of the dataset (a loader rebuilt mid-run without sharding it by rank?)"),
        figures)


def replayed_epoch(per_rank: Sequence[Sequence[Any]]) -> tuple[int, int] | None:
    """The first (epoch, earlier epoch) in which every rank given replays what it drew in that
    earlier epoch, in the same order (`per_rank[rank][epoch]`: a rank's draws, comparable with ==);
    None when every epoch is new. A partition passes every rank, which a sampler never told the
    epoch makes replay together (one rank's short share may repeat by chance); the schemes without
    indices pass one rank at a time."""
    epochs = min((len(draws) for draws in per_rank), default=0)
    for epoch in range(1, epochs):
        for earlier in range(epoch):
            if all(draws[epoch] == draws[earlier] for draws in per_rank):
                return epoch, earlier
    return None


def _replay_diagnosis(replay: tuple[int, int], always: bool, per_rank: list[list[list[int]]], size: int,
                      sampler: str) -> str:
    """Why the ranks replay an earlier epoch: `always` when every epoch is the first one again."""
    epoch, earlier = replay
    epochs = len(per_rank[0])
    if always:
        if _unshuffled([orders[0] for orders in per_rank], size):
            return ("the loader does not shuffle although data.shuffle is true: every rank reads its samples in "
                    f"index order in all {epochs} epochs")
        cause = ("DistributedSampler.set_epoch(epoch) is never called" if sampler == "DistributedSampler"
                 else f"{sampler} is never told the epoch (set_epoch(epoch)), or shuffles with a seed without it")
        return (f"the order is the same every epoch ({epochs} epochs, every rank): {cause}, so each epoch reuses "
                "the first epoch's shuffle")
    return (f"epoch {epoch} replays epoch {earlier}'s order on every rank, while other epochs reshuffle: the sampler "
            f"({sampler}) is not given every epoch's number (set_epoch(epoch) with the epoch itself, before each "
            "epoch), so some epochs repeat an earlier shuffle")


def analyse(epochs: Sequence[Sequence[Batches]], dataset_size: int, shuffle: bool,
            sampler: str = "DistributedSampler", tail: int = 0, share: int | None = None) -> SamplingVerdict:
    """Every epoch's partition, then the order across epochs when shuffling (`sampler`: the name of
    what orders the samples, for the advice; `tail`: what the loader drops of each rank's share; `share`:
    what each rank draws where the sharding pads whole batches)."""
    figures: dict[str, Any] = {"dataset_size": dataset_size, "epochs": len(epochs)}
    for epoch, ranks in enumerate(epochs):
        verdict = analyse_epoch(ranks, dataset_size, tail, share)
        figures.update(verdict.figures)
        if not verdict.ok:
            return SamplingVerdict(False, f"{verdict.diagnosis} (epoch {epoch})", figures)
    figures["order_changes"] = None
    if shuffle and len(epochs) >= 2:
        per_rank = [[_flat(epoch[r]) for epoch in epochs] for r in range(len(epochs[0]))]
        judged = [orders for orders in per_rank if len(orders[0]) >= 2]
        if sum(len(orders[0]) for orders in judged) >= ORDER_MIN_SIZE:
            replay = replayed_epoch([[tuple(order) for order in orders] for orders in judged])
            figures["order_changes"] = replay is None
            if replay is not None:
                always = all(all(order == orders[0] for order in orders) for orders in judged)
                return SamplingVerdict(False, _replay_diagnosis(replay, always, per_rank, dataset_size, sampler),
                                       figures)
    return SamplingVerdict(True, "", figures)


#: the remedy for Subsets drawn differently on each rank (data_consistency gives it too)
SEED_THE_SPLIT = ("seed the split's generator identically on every rank "
                  "(random_split(..., generator=torch.Generator().manual_seed(seed)))")


def per_rank_split(universes: list[list[int] | None]) -> str:
    """A diagnosis when the ranks' loaders are over Subsets of one dataset that hold different but
    overlapping samples (`universes`: the underlying indices each rank's Subset holds): a split drawn
    on each rank from its own RNG, or seeded per rank. Disjoint Subsets are per-rank shards, a scheme
    of its own; identical ones are one split shared by all."""
    held = [set(u) for u in universes if u is not None]
    if len(held) < len(universes) or all(h == held[0] for h in held):
        return ""
    pairs = [(len(held[r] & held[s]), r, s) for r in range(len(held)) for s in range(r + 1, len(held))
             if held[r] != held[s]]
    common, r, s = max(pairs)
    if not common:
        return ""
    return (f"each rank draws from its own random_split subset: the ranks' datasets are Subsets of one dataset "
            f"that hold different samples (ranks {r} and {s} have {common} of their {len(held[r])} and {len(held[s])} "
            f"in common; a split drawn from each process's own RNG, or seeded per rank), so the ranks' shares overlap "
            f"and {len(set().union(*held)) - len(set.intersection(*held))} samples are not in every rank's split, "
            f"whatever the sampler's seed: {SEED_THE_SPLIT}")
