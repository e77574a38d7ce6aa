"""The wire types' own rules (wire.py), tested without processes."""

from __future__ import annotations

from ddp_conformance.runner.wire import PASSED, PoolRun, RankReply


def test_a_pool_out_of_step_is_poisoned() -> None:
    run = PoolRun()
    run.replies = {0: RankReply(0, PASSED, sequence=4), 1: RankReply(1, PASSED, sequence=5)}
    assert run.poisoned
    run.replies[1].sequence = 4
    assert not run.poisoned
    run.replies[1].group_healthy = False
    assert run.poisoned
