"""Sampling schemes other than a partition, each held to its own invariant."""

from __future__ import annotations


def test_batches_without_indices_are_judged_by_what_each_rank_was_fed():
    from ddp_conformance.checks.sampler_disjointness.loader_schemes import ORDER_MIN_BATCHES, inputs_verdict

    batches = [f"b{i}" for i in range(2 * ORDER_MIN_BATCHES)]
    mine, theirs = batches[:ORDER_MIN_BATCHES], batches[ORDER_MIN_BATCHES:]
    sound = [[mine, mine[::-1]], [theirs, theirs[::-1]]]  # everyone[rank][epoch]
    figures = {"indices_from": "the fit's inputs", "batches_seen_per_rank": [8, 8], "order_changes": True,
               "summary": "inputs differ by rank"}
    assert inputs_verdict(sound, True, "Mine") == (figures, "")
    unsharded = [[mine, mine[::-1]], [mine, mine[::-1]]]
    assert inputs_verdict(unsharded, True, "Mine")[1].startswith(
        "ranks 0 and 1 train on the same batch in epoch 0 (batch 0 of rank 1, inputs identical): the batches (Mine) "
        "are not sharded by rank")
    padded = [[mine, mine[::-1]], [[*theirs[:-1], mine[0]], theirs[::-1]]]  # a last batch repeats rank 0's
    assert inputs_verdict(padded, True, "Mine")[1] == ""
    replayed = [[mine, mine], [theirs, theirs[::-1]]]
    assert "rank 0 trains on the same batches in the same order in epoch 0 and epoch 1" in inputs_verdict(
        replayed, True, "Mine")[1]
    assert inputs_verdict(replayed, False, "Mine")[1] == ""  # a loader that does not shuffle may replay
    every_other = [[mine, mine[::-1], mine], [theirs, theirs[::-1], theirs[1:] + theirs[:1]]]
    assert "rank 0 trains on the same batches in the same order in epoch 0 and epoch 2" in inputs_verdict(
        every_other, True, "Mine")[1]
    few = [[mine[:3], mine[:3]], [theirs[:3], theirs[:3]]]  # 3 fixed batches replay by chance 1 time in 6
    assert inputs_verdict(few, True, "Mine") == (dict(figures, batches_seen_per_rank=[3, 3], order_changes=None), "")
