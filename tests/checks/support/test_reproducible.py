"""The precondition of the checks that compare two fits (`checks/support/reproducible.py`): two identical fits
that part beyond the asking check's tolerance skip it with resume_fidelity's verdict and the figures, and
nothing else does. The nested sessions judge it on real fits (fixtures script_unseeded_model,
unseeded_init_comm_hook); here the decision and the comparison alone."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ddp_conformance.adapter import TrainState
from ddp_conformance.checks.support import reproducible
from ddp_conformance.checks.support.reproducible import Repeat, require_reproducible


def context() -> Any:
    return SimpleNamespace(figures={}, check_id="compiled_model")


@pytest.mark.parametrize("found", [None, Repeat(0.0, "0.weight", 0, "static_graph"),
                                   Repeat(1e-3, "0.weight", 0, "static_graph"),
                                   Repeat(math.nan, "0.weight", 1, "static_graph")])
def test_fits_that_agree_within_the_tolerance_or_cannot_be_compared_go_on(monkeypatch, found) -> None:
    monkeypatch.setattr(reproducible, "repeat", lambda ctx: found)
    ctx = context()
    require_reproducible(ctx, "torch.compile", 1e-3)
    assert ctx.figures == ({} if found is None else {"repeat_max_rel_delta": found.relative,
                                                     "repeat_worst_tensor": found.tensor})


def test_fits_apart_skip_naming_resume_fidelity_s_verdict_the_tensor_and_the_setting(monkeypatch) -> None:
    monkeypatch.setattr(reproducible, "repeat", lambda ctx: Repeat(1.88, "fc.bias", 1, "compiled_model"))
    ctx = context()
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_reproducible(ctx, "torch.compile", 1e-3)
    message = str(skipped.value)
    assert message.startswith("the fit is not reproducible (resume_fidelity's verdict): two identical fits from "
                              "scratch already end apart after 3 steps (fc.bias by 1.88 of its largest value on rank 1")
    assert "cannot be blamed on torch.compile" in message and "0.001 is allowed" in message
    assert ctx.figures == {"repeat_max_rel_delta": 1.88, "repeat_worst_tensor": "fc.bias"}


def state(**params: torch.Tensor) -> TrainState:
    return TrainState(params=params, optimizer={}, scheduler=None, epoch=0, global_step=3, position=0)


def test_the_comparison_is_per_tensor_relative_to_its_largest_value() -> None:
    first = state(a=torch.tensor([10.0, 0.0]), b=torch.tensor([1.0]), step=torch.tensor(3))
    again = state(a=torch.tensor([10.0, 0.5]), b=torch.tensor([1.0]), step=torch.tensor(3))
    found = reproducible._compared(context(), again, first)
    assert (found.relative, found.tensor, found.rank) == (0.05, "a", 0)
    assert reproducible._compared(context(), first, first).relative == 0.0
