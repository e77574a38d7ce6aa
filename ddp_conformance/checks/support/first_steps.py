"""The trainer's own fit under a changed config: its first optimizer step's gradients, or its final state.

The checks that hold a setting to "the same training either way" (mixed_precision's steps against
fp32's, bucket_cap_mb_invariance's fits across bucket sizes, static_graph's with and without) run the
fit once per setting with the config's dropout at 0, so that the runs differ by the setting alone,
and compare the gradients the first optimizer step applied (`first_step`: `fit_record.FirstStep`, read in
its pre-step hook) or the final states (`final_floats`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from ...adapter import TrainerAdapter, TrainState
from ...config import RunConfig
from .check_context import CheckContext
from .fit_record import FitRecord
from .fit_watch import FitPlan
from .observe import unwrapped
from .progress import guarded_fit


def without_dropout(config: RunConfig) -> RunConfig:
    return replace(config, model=replace(config.model, dropout=0.0))


#: the dropout layers that draw from the RNG as the model trains
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def dropout_layers(model: nn.Module) -> list[nn.Module]:
    """The model's dropout layers that draw (p > 0), attention's included."""
    return [m for m in model.modules() if (isinstance(m, DROPOUT) and m.p > 0)
            or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)]


def zero_dropout(model: nn.Module) -> None:
    """Set the dropout of the model (or the model DDP wraps) to 0, where a trainer that ignores the config's
    dropout keeps its own: two fits that must agree then draw no masks."""
    for module in dropout_layers(unwrapped(model)):
        setattr(module, "dropout" if isinstance(module, nn.MultiheadAttention) else "p", 0.0)


def with_strategy(config: RunConfig, **changes: Any) -> RunConfig:
    """`config` with these DDP settings (`trainer.strategy`) changed."""
    return replace(config, trainer=replace(config.trainer, strategy=replace(config.trainer.strategy, **changes)))


def own_config(ctx: CheckContext, config: RunConfig) -> RunConfig:
    """The trainer's config after its own `setup` (a trainer may set a DDP flag or its accumulation there): the
    setting a check judges is the trainer's, not only the `--ddp-config` file's."""
    return getattr(ctx.adapter(config), "config", None) or config


def final_floats(state: TrainState) -> dict[str, Any]:
    """A fit's final floating-point tensors (parameters and buffers) by name, on the CPU: what two fits
    that differ by one setting are compared by (`gradients.max_delta`). In their own precision, half
    types in float32: the difference of two floats within a factor 2 of each other is exact in their
    precision (Sterbenz), and a float64 copy of a large model costs a visible share of the check
    (benchmarks/RESULTS.md)."""
    return {name: t.detach().to("cpu", torch.float32 if t.element_size() < 4 else t.dtype)
            for name, t in state.params.items() if isinstance(t, torch.Tensor) and t.is_floating_point()}


def overflow_reason(skipped: int) -> str:
    """Why a first applied step that followed GradScaler-skipped steps is not compared: their micro-batches
    ran, their gradients were thrown away."""
    return (f"a GradScaler skipped the fit's first {skipped} optimizer step(s) (their scaled gradients overflowed, as "
            "at its initial scale), so the first step it applied does not hold the gradient of the micro-batches "
            "before it")


def first_step(ctx: CheckContext, label: str, adapter: TrainerAdapter) -> tuple[dict[str, Any], FitRecord]:
    """The gradients the fit's first optimizer step applied, by parameter name (float64, CPU), and the
    fit's record (as `ctx.recordings[label]`); skips when it applied none."""
    guarded_fit(ctx, label, 1, lambda observer: adapter.fit(1, observer=observer), FitPlan(first_step=True))
    record = ctx.recordings[label]
    first = record.first_step
    if first is None or first.grads is None or record.model is None:
        pytest.skip(f"the {label} fit's one iteration applied no optimizer step with gradients (a GradScaler skips "
                    "the step whose scaled gradients overflow), so there is no step to compare")
    if first.overflowed:
        pytest.skip(f"the {label} fit: {overflow_reason(first.overflowed)}; there is no first step to compare")
    names = [name for name, _ in unwrapped(record.model).named_parameters()]
    return dict(zip(names, first.grads, strict=False)), record
