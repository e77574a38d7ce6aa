"""gradient_equivalence's verdicts, from made-up gradients."""

from __future__ import annotations


def test_a_summed_loss_is_named_with_accumulation_too():
    import torch

    from ddp_conformance.checks.gradient_equivalence import Setting, StepGradients, Worst, _verdict

    single = {"w": torch.ones(4)}
    own = {"w": torch.full((4,), 7.0)}
    text = _verdict(StepGradients({"w": single["w"] / 2}, single, own, []), Worst("w", 0.5, 1e-5), Setting(1e-5, 2))
    assert "exactly 1/2" in text and "summed" in text
    text = _verdict(StepGradients({"w": single["w"] / 4}, single, own, []), Worst("w", 0.75, 1e-5),
                    Setting(1e-5, 2, accumulate=2))
    assert "exactly 1/4" in text and "summed" in text


def test_zero_gradients_on_both_sides_are_not_equivalence():
    import torch

    from ddp_conformance.checks.gradient_equivalence import _vacuous

    zero = {"w": torch.zeros(3), "b": None}
    assert _vacuous(zero, zero, 0.0).startswith("training does not change the model: every gradient is exactly zero")
    assert _vacuous(zero, {"w": torch.tensor([0.0, 1e-30, 0.0]), "b": None}, 0.3) == ""
