"""Gradients compared per parameter: clipping told from a wrong gradient."""

from __future__ import annotations


def test_clipping_by_norm_or_value_is_told_from_a_wrong_gradient():
    import torch

    from ddp_conformance.checks.support.gradients import clipping

    single = {"w": torch.tensor([0.5, -2.0, 0.1], dtype=torch.float64), "b": torch.tensor([3.0], dtype=torch.float64)}
    assert clipping({n: g * 0.1 for n, g in single.items()}, single, 1e-5) == (
        "0.1x the single-process gradients, uniformly: gradient clipping by norm (not judged)")
    clamped = {n: g.clamp(-1.0, 1.0) for n, g in single.items()}
    assert clipping(clamped, single, 1e-5) == ("the single-process gradients clamped to +-1: gradient clipping by "
                                               "value (the 2 of 4 elements beyond it are not judged, the others match)")
    wrong = dict(clamped, w=torch.tensor([0.4, -1.0, 0.1], dtype=torch.float64))  # an unclamped element is off
    assert clipping(wrong, single, 1e-5) == ""
    small = {"w": torch.tensor([0.5, -2.0], dtype=torch.float64), "b": torch.tensor([1e-3], dtype=torch.float64)}
    doubled_bias = {"w": small["w"].clamp(-1.0, 1.0), "b": small["b"] * 2}  # off by its own scale, not w's
    assert clipping(doubled_bias, small, 1e-5) == ""
    assert clipping({n: g * 2 for n, g in single.items()}, single, 1e-5) == ""  # larger: no clipping does that
    assert clipping({n: -g for n, g in single.items()}, single, 1e-5) == ""  # a sign flip is no clipping
    assert clipping({n: g * 0 for n, g in single.items()}, single, 1e-5) == ""  # nor are zero gradients
