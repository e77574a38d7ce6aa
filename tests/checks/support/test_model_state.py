"""Training states compared: tensors stepped outside the model."""

from __future__ import annotations


def test_tensors_stepped_outside_the_model_are_compared_only_where_they_start_alike():
    from ddp_conformance.checks.support.model_state import drifted

    replica, shard = "optimizer param_groups[0][4], a scalar", "optimizer param_groups[1][0], shape (8, 4)"
    ranks = [{replica: ("s", "a"), shard: ("r0", "x")}, {replica: ("s", "b"), shard: ("r1", "y")}]
    assert drifted(ranks) == ([replica], [shard])
    assert drifted([{replica: ("s", "a")}, {replica: ("s", "a")}]) == ([], [])
    assert drifted([]) == ([], [])
