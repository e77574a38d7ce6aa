"""What a check's collectives rest on: every rank takes the same branch (`checks/support/check_context.py`)."""

from __future__ import annotations

import pytest


@pytest.mark.ddp(world_size=2)
def test_a_missing_piece_on_one_rank_is_missing_on_every_rank(ddp):
    """A Lightning probe whose loader gave rank 1 no batch tells rank 1 alone that its dataset is not provided:
    every rank must take the NotProvided branch, with rank 1's words, or rank 0 goes on to a collective alone."""
    import torch.distributed as dist

    from ddp_conformance.adapter import NotProvided
    from ddp_conformance.checks.support.check_context import on_every_rank

    def make_dataset():
        if ddp.rank == 1:
            raise NotProvided("lit_module", "make_dataset", "its train loader yielded no batch on rank 1")
        return "dataset"

    with pytest.raises(NotProvided) as missing:
        on_every_rank(make_dataset)
    assert missing.value.what == "make_dataset"
    assert str(missing.value) == ("trainer lit_module does not provide make_dataset: its train loader yielded no "
                                  "batch on rank 1")
    assert on_every_rank(lambda: ddp.rank) == ddp.rank  # where every rank answers, each keeps its own answer
    dist.barrier()
