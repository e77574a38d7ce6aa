"""What a training step holds: a gradient moved out of its bucket is no bucket view."""

from __future__ import annotations


def test_a_gradient_moved_out_of_its_bucket_through_data_is_no_bucket_view():
    """`p.grad.data = f(p.grad.data)` leaves `_is_view()` true: the storages tell (torch's `_base`
    and `_is_view` are private; if either changes meaning, this fails)."""
    import torch

    from ddp_conformance.checks.support.memory import shares_its_base

    bucket = torch.zeros(10)
    grad = bucket[2:5]
    assert shares_its_base(grad)
    grad.data = torch.nan_to_num(grad.data)
    assert grad._is_view() and not shares_its_base(grad)
    assert not shares_its_base(torch.zeros(3))
