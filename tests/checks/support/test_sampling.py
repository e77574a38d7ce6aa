"""Property tests of the sampler-disjointness logic (`ddp_conformance.checks.sampling`) against the
real `torch.utils.data.DistributedSampler`: every configuration it can produce is accepted, and the
broken samplers the mutants stand for are rejected with the diagnosis that names them.

Pure and local: samplers are built for every rank in this process, no process group.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from ddp_conformance.checks.support import loader_wrappers
from ddp_conformance.checks.support.sampling import ORDER_MIN_SIZE, analyse, analyse_started_epoch

NEEDS_ACCELERATE = "accelerate (the dev extra) is not installed: its BatchSamplerShard cannot be built"

EPOCHS = 3  # as the check judges (sampler_disjointness.EPOCHS)


def batches(indices: list[int], batch_size: int) -> list[list[int]]:
    return [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]


def distributed(size: int, world: int, batch: int, drop_last: bool, shuffle: bool, seed: int, epoch: int,
                rank: int, *, seed_of=lambda seed, rank: seed, set_epoch: bool = True, replicas=None):
    sampler = DistributedSampler(range(size), num_replicas=replicas or world, rank=rank, shuffle=shuffle,
                                 seed=seed_of(seed, rank), drop_last=drop_last)
    if set_epoch:
        sampler.set_epoch(epoch)
    return batches(list(sampler), batch)


def epochs_of(size, world, batch, drop_last, shuffle, seed, told=lambda epoch: epoch, **broken):
    """Every rank's batches for each judged epoch; `told`: the epoch the sampler is given."""
    return [[distributed(size, world, batch, drop_last, shuffle, seed, told(e), r, **broken) for r in range(world)]
            for e in range(EPOCHS)]


configs = st.fixed_dictionaries({
    "size": st.integers(1, 300), "world": st.integers(1, 8), "batch": st.integers(1, 16),
    "drop_last": st.booleans(), "shuffle": st.booleans(), "seed": st.integers(0, 2**31 - 1),
})


@settings(max_examples=150, deadline=None)
@given(configs)
def test_every_distributed_sampler_configuration_passes(c):
    assume(not c["drop_last"] or c["size"] >= c["world"])  # N < R with drop_last: every loader is empty
    verdict = analyse(epochs_of(**c), c["size"], c["shuffle"])
    assert verdict.ok, verdict.diagnosis
    padding = math.ceil(c["size"] / c["world"]) * c["world"] - c["size"]
    assert verdict.figures["padding_duplicates"] == (0 if c["drop_last"] else padding)
    assert verdict.figures["uncovered"] == (c["size"] % c["world"] if c["drop_last"] else 0)


@settings(max_examples=100, deadline=None)
@given(configs)
def test_a_loader_that_drops_its_last_incomplete_batch_passes(c):
    """`DataLoader(drop_last=True)` over any DistributedSampler: each rank's share loses its last
    `share % batch` samples (padding repeats among them, often), so fewer samples are covered than
    the sampler's own contract says, by the loader's choice, not a sharding bug."""
    assume(not c["drop_last"] or c["size"] >= c["world"])
    epochs = epochs_of(**c)
    share = sum(map(len, epochs[0][0]))
    tail = share % c["batch"]
    assume(share >= c["batch"])  # else the loader yields nothing at all
    if tail:
        epochs = [[batches[:-1] for batches in ranks] for ranks in epochs]
    verdict = analyse(epochs, c["size"], c["shuffle"], tail=tail)
    assert verdict.ok, verdict.diagnosis


@settings(max_examples=60, deadline=None)
@given(configs)
def test_no_distributed_sampler_is_named(c):
    """Every rank iterating the dataset with the same shuffle (a plain shuffling loader)."""
    assume(c["world"] >= 2 and c["size"] >= 2)
    one = [distributed(c["size"], 1, c["batch"], False, c["shuffle"], c["seed"], e, 0) for e in range(EPOCHS)]
    verdict = analyse([[one[e]] * c["world"] for e in range(EPOCHS)], c["size"], c["shuffle"])
    assert not verdict.ok
    assert "no DistributedSampler" in verdict.diagnosis


@settings(max_examples=60, deadline=None)
@given(configs)
def test_a_per_rank_seed_is_named(c):
    assume(c["world"] >= 2 and c["size"] >= 20 * c["world"])
    verdict = analyse(epochs_of(**{**c, "shuffle": True}, seed_of=lambda seed, rank: seed + rank),
                      c["size"], True)
    assert not verdict.ok
    assert "different permutations" in verdict.diagnosis


@settings(max_examples=60, deadline=None)
@given(configs)
def test_set_epoch_never_called_is_named(c):
    size, world = c["size"], c["world"]
    share = size // world if c["drop_last"] else math.ceil(size / world)
    assume(share >= 2 and share * world >= ORDER_MIN_SIZE)  # below that the order is not judged
    verdict = analyse(epochs_of(**{**c, "shuffle": True}, set_epoch=False), c["size"], True)
    assert not verdict.ok
    assert "set_epoch(epoch) is never called" in verdict.diagnosis


@settings(max_examples=60, deadline=None)
@given(configs)
def test_a_wrong_num_replicas_leaves_samples_unseen(c):
    """Built for a bigger world (e.g. num_replicas from a stale config): a share of the data is never read."""
    size, world = c["size"], c["world"]
    assume(size >= 4 * (world + 1))
    share = size // (world + 1) if c["drop_last"] else math.ceil(size / (world + 1))
    assume(share not in (math.ceil(size / world), size // world))  # else it is a valid drop_last split
    verdict = analyse(epochs_of(**c, replicas=world + 1), size, c["shuffle"])
    assert not verdict.ok
    assert "reach no rank" in verdict.diagnosis


@settings(max_examples=60, deadline=None)
@given(configs)
def test_uneven_batch_counts_are_named(c):
    """The last rank's final batch split in two (a per-rank batch size): same samples, one more batch."""
    assume(c["world"] >= 2 and math.ceil(c["size"] / c["world"]) >= 2)
    epochs = epochs_of(**{**c, "drop_last": False})
    for ranks in epochs:
        last = ranks[-1][-1]
        if len(last) < 2:
            ranks[-1][-1:] = [last[:1], []]  # an empty trailing batch still counts as a batch
        else:
            ranks[-1][-1:] = [last[:1], last[1:]]
    verdict = analyse(epochs, c["size"], c["shuffle"])
    assert not verdict.ok
    assert "uneven batch counts" in verdict.diagnosis


def test_the_documented_tiny_wrap_is_padding_not_a_bug():
    """N=2, R=5 -> [[0],[1],[0],[1],[0]] (ddp-facts.md): identical ranks, but exactly DistributedSampler."""
    ranks = [[[0]], [[1]], [[0]], [[1]], [[0]]]
    verdict = analyse([ranks, ranks], 2, shuffle=False)
    assert verdict.ok, verdict.diagnosis
    assert verdict.figures["padding_duplicates"] == 3


@settings(max_examples=50, deadline=None)
@given(configs)
def test_a_loader_that_never_shuffles_is_named(c):
    size, world = c["size"], c["world"]
    share = size // world if c["drop_last"] else math.ceil(size / world)
    assume(share >= 2 and share * world >= ORDER_MIN_SIZE)
    verdict = analyse(epochs_of(**{**c, "shuffle": False}), size, shuffle=True)
    assert not verdict.ok
    assert "does not shuffle" in verdict.diagnosis


@settings(max_examples=60, deadline=None)
@given(configs)
def test_a_sampler_told_the_epoch_every_other_epoch_is_named(c):
    """set_epoch(epoch // 2): epochs 0 and 1 alike, epoch 2 new. Not every epoch repeats the first, so a
    rule asking only "is every epoch the same?" passes it."""
    size, world = c["size"], c["world"]
    share = size // world if c["drop_last"] else math.ceil(size / world)
    assume(share >= 2 and share * world >= ORDER_MIN_SIZE)
    epochs = epochs_of(**{**c, "shuffle": True}, told=lambda epoch: epoch // 2)
    assume(epochs[2] != epochs[0])  # two seeds' shuffles of a tiny share can agree
    verdict = analyse(epochs, size, True)
    assert not verdict.ok
    assert "epoch 1 replays epoch 0's order" in verdict.diagnosis
    assert verdict.figures["order_changes"] is False


@settings(max_examples=150, deadline=None)
@given(configs, st.lists(st.floats(0, 1), min_size=8, max_size=8))
def test_what_the_ranks_drew_of_a_started_epoch_passes_however_far_each_got(c, reached):
    """Any prefix of each rank's DistributedSampler share (a fit stopped mid-epoch, ranks at
    different points): no overlap beyond padding."""
    assume(not c["drop_last"] or c["size"] >= c["world"])
    ranks = epochs_of(**c)[0]
    drawn = [[i for batch in batches for i in batch] for batches in ranks]
    prefixes = [seq[: round(len(seq) * reached[r])] for r, seq in enumerate(drawn)]
    verdict = analyse_started_epoch(prefixes, c["size"], epoch=3)
    assert verdict.ok, verdict.diagnosis


@settings(max_examples=60, deadline=None)
@given(configs, st.integers(2, 40))
def test_a_started_epoch_of_an_unsharded_loader_is_named(c, reached):
    """Every rank iterating the whole dataset with the same shuffle, stopped after `reached` samples."""
    assume(c["world"] >= 2 and c["size"] >= reached)
    whole = [i for batch in distributed(c["size"], 1, c["batch"], False, True, c["seed"], 2, 0) for i in batch]
    verdict = analyse_started_epoch([whole[:reached]] * c["world"], c["size"], epoch=2, sampler="RandomSampler")
    assert not verdict.ok
    assert f"ranks 0 and 1 receive identical samples in epoch 2 (the first {reached} of each" in verdict.diagnosis
    assert "no DistributedSampler" in verdict.diagnosis


def test_a_started_epoch_with_an_index_outside_the_dataset_is_named():
    verdict = analyse_started_epoch([[0, 1], [2, 9]], 4, epoch=2)
    assert not verdict.ok
    assert "rank 1 receives index 9 outside the dataset of 4 samples in epoch 2" in verdict.diagnosis


def test_subsets_drawn_per_rank_are_named_as_such_and_shards_or_one_shared_split_are_not():
    from ddp_conformance.checks.support.sampling import per_rank_split

    drawn = per_rank_split([[0, 1, 2, 4], [1, 2, 3, 5]])  # two random_split parts drawn on each rank
    assert drawn.startswith("each rank draws from its own random_split subset") and "2 of their 4 and 4" in drawn
    assert "seed the split's generator identically on every rank" in drawn
    assert per_rank_split([[0, 2, 4], [1, 3, 5]]) == ""  # each rank's own shard: a scheme of its own
    assert per_rank_split([[0, 1, 3], [0, 1, 3]]) == ""  # one split, seeded alike
    assert per_rank_split([[0, 1, 3], None]) == ""  # only one rank over a Subset: not this cause


def accelerate_shards(size: int, world: int, batch: int, split: bool, seeds: list[int]) -> list[list[list[int]]]:
    """Each rank's batches of one epoch from accelerate's own BatchSamplerShard (`even_batches`, the default),
    over a BatchSampler that keeps its last batch and a RandomSampler seeded with `seeds[rank]` (one seed for
    every rank: accelerate synchronises the generator), and the share `loader_wrappers.padded_share` reads."""
    import torch
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, RandomSampler

    ranks, shares = [], set()
    for rank in range(world):
        sampler = RandomSampler(range(size), generator=torch.Generator().manual_seed(seeds[rank]))
        shard = BatchSamplerShard(BatchSampler(sampler, batch * world if split else batch, drop_last=False),
                                  num_processes=world, process_index=rank, split_batches=split)
        ranks.append([list(b) for b in shard])
        shares.add(loader_wrappers.padded_share(shard))
    assert len(shares) == 1
    return ranks, shares.pop()


shards = st.fixed_dictionaries({"size": st.integers(1, 200), "world": st.integers(1, 6), "batch": st.integers(1, 9),
                                "split": st.booleans(), "seed": st.integers(0, 2**31 - 1)})


@settings(max_examples=100, deadline=None)
@given(shards)
def test_accelerate_s_batch_shards_pass_with_the_whole_batches_they_pad(c):
    """accelerate evens the ranks' batches by looping back to the epoch's first samples, whole batches at a time:
    more repeats than DistributedSampler's padding, and no fault (before: "the ranks shuffle with different
    permutations" on 187 samples at batch size 4)."""
    pytest.importorskip("accelerate", reason=NEEDS_ACCELERATE)
    ranks, share = accelerate_shards(c["size"], c["world"], c["batch"], c["split"], [c["seed"]] * c["world"])
    verdict = analyse([ranks], c["size"], False, "RandomSampler", share=share)
    assert verdict.ok, verdict.diagnosis
    assert all(sum(map(len, r)) == share for r in ranks)
    assert verdict.figures["uncovered"] == 0 and verdict.figures["padding_duplicates"] <= share * c["world"] - c["size"]


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({"size": st.integers(320, 600), "world": st.integers(2, 4), "batch": st.integers(1, 4),
                              "split": st.booleans(), "seed": st.integers(0, 2**31 - 1)}))
def test_accelerate_s_batch_shards_of_unsynchronised_generators_are_named(c):
    """The same shards where each rank's generator draws its own permutation (accelerate's synchronisation
    defeated): the allowance for whole batches does not hide it."""
    pytest.importorskip("accelerate", reason=NEEDS_ACCELERATE)
    ranks, share = accelerate_shards(c["size"], c["world"], c["batch"], c["split"],
                                     [c["seed"] + rank for rank in range(c["world"])])
    verdict = analyse([ranks], c["size"], False, "RandomSampler", share=share)
    assert not verdict.ok and "different permutations" in verdict.diagnosis, verdict.diagnosis
    assert "accelerate's even_batches" in verdict.diagnosis
