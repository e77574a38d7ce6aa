"""mixed_precision's verdicts, from made-up gradients."""

from __future__ import annotations


def test_mixed_precision_names_fp32_steps_and_loss_scales_and_passes_rounding():
    import torch

    from ddp_conformance.checks.mixed_precision import _verdict, relative_difference

    generator = torch.Generator().manual_seed(0)
    fp32 = {"w": torch.randn(8, 4, generator=generator, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    rounded = {name: grad.to(torch.bfloat16).double() for name, grad in fp32.items()}
    noisy = {name: grad + 0.4 * torch.randn(grad.shape, generator=generator, dtype=torch.float64)
             for name, grad in fp32.items()}  # half the step's norm away, as bf16 over tiny BatchNorm batches
    for step in (rounded, noisy):
        assert _verdict("bf16-mixed", step, fp32, relative_difference(step, fp32)[0]) == ""
    assert "never reaches the model" in _verdict("bf16-mixed", dict(fp32), fp32, 0.0)
    scaled = {name: 128 * grad for name, grad in rounded.items()}
    text = _verdict("bf16-mixed", scaled, fp32, relative_difference(scaled, fp32)[0])
    assert text.startswith("the bf16-mixed gradients are 128x the fp32 gradients: a loss scale is never divided out")
    relative, worst = relative_difference({"w": fp32["w"], "b": 2 * fp32["b"]}, fp32)
    assert worst == "b" and 0 < relative < 1
