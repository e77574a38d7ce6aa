"""A step digest tells one changed bit of one parameter, and nothing else."""

from __future__ import annotations


def test_a_step_digest_tells_one_ulp_in_one_parameter_and_nothing_else() -> None:
    import torch

    from ddp_conformance.checks.support.digests import step_digest

    torch.manual_seed(0)
    parameters = [torch.randn(300, 7), torch.randn(11)]
    same = [p.clone() for p in parameters]
    assert step_digest(parameters) == step_digest(same)
    for index in (0, 1):
        moved = [p.clone() for p in parameters]
        flat = moved[index].view(-1)
        flat[5] = torch.nextafter(flat[5], torch.tensor(float("inf")))
        assert step_digest(moved) != step_digest(parameters)
    assert step_digest(parameters) != step_digest(parameters[::-1])  # which tensor holds what counts too


def test_inputs_that_hold_no_positional_tensor_are_not_taken_for_one_batch():
    import dataclasses

    import numpy as np
    import torch

    from ddp_conformance.checks.support.digests import fed_digest

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    assert fed_digest(((), {})) is None and fed_digest((3, "a")) is None  # model(input_ids=x): args are ()
    one, two = torch.ones(2), torch.zeros(2)
    assert fed_digest((Batch(one),)) != fed_digest((Batch(two),)) is not None
    assert fed_digest(({"ids": one},)) != fed_digest(({"ids": two},))
    assert fed_digest((np.ones(2),)) != fed_digest((np.zeros(2),)) is not None
