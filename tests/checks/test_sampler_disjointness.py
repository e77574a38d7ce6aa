"""sampler_disjointness's verdicts, from made-up loader passes."""

from __future__ import annotations


def test_a_sampler_that_cannot_say_draws_with_replacement_when_a_rank_repeats_an_index():
    from ddp_conformance.checks.sampler_disjointness import _draws_with_replacement
    from ddp_conformance.checks.support.fit_record import LoaderPass

    def drew(batches, replacement=None):
        return LoaderPass(length=len(batches), dataset_size=8, sampler="Mine", shuffle=None,
                          replacement=replacement, batches=batches)

    assert not _draws_with_replacement(drew([[0, 2], [4, 6]]))  # a share of a partition
    assert _draws_with_replacement(drew([[0, 2], [2, 6]]))  # index 2 twice in one rank's epoch
    assert not _draws_with_replacement(drew([[0, 2], [2, 6]], replacement=False))  # the sampler says
    assert _draws_with_replacement(drew([[0, 2], [4, 6]], replacement=True))
