"""amp_watch: the precision a loop ran at and its GradScaler use, from one process's loops on CPU."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddp_conformance.checks.support.amp_watch import AmpRecord, AmpWatch, autocast_state
from ddp_conformance.checks.support.observe import FitRecorder

SCALE = 2.0 ** 10


def _cpu_autocasts_fp16() -> bool:
    """Whether this torch's CPU autocast takes float16 (one that does not warns and runs without autocast)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.is_autocast_enabled("cpu")


FP16 = pytest.param(torch.float16, "16-mixed", marks=pytest.mark.skipif(
    not _cpu_autocasts_fp16(), reason="this torch's CPU autocast does not take float16"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=generator)
    return x, (x.sum(dim=1) > 0).long()


def _loop(step: Callable[[nn.Module, Any, Any, torch.Tensor], None], steps: int = 2,
          dtype: torch.dtype | None = None, forwards: bool = True) -> AmpRecord:
    """`steps` iterations of a loop whose backward and step are `step(model, optimizer, scaler, loss)`."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    x, y = _batch()
    with AmpWatch(forwards=forwards) as watch:
        for _ in range(steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            step(model, optimizer, scaler, loss)
    return watch.record


def _plain(model: nn.Module, optimizer: Any, _scaler: Any, loss: torch.Tensor) -> None:
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _clip_after_unscale(model: nn.Module, optimizer: Any, scaler: Any, loss: torch.Tensor) -> None:
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def _clip_before_unscale(model: nn.Module, optimizer: Any, scaler: Any, loss: torch.Tensor) -> None:
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


def _direct_step(model: nn.Module, optimizer: Any, scaler: Any, loss: torch.Tensor) -> None:
    scaler.scale(loss).backward()
    optimizer.step()


def test_autocast_dtype_is_read_per_device() -> None:
    assert autocast_state("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_state("cpu") is torch.bfloat16
    if _cpu_autocasts_fp16():
        with torch.autocast("cpu", dtype=torch.float16):
            assert autocast_state("cpu") is torch.float16


@pytest.mark.parametrize(("dtype", "precision"), [(None, "32-true"), (torch.bfloat16, "bf16-mixed"), FP16])
def test_the_precision_is_the_autocast_the_forwards_ran_under(dtype: torch.dtype | None, precision: str) -> None:
    record = _loop(_plain, dtype=dtype)
    assert record.micro_batches == 2
    assert record.precision == precision
    assert record.clips == 2 and not record.clipped_scaled and not record.scaled_steps


class _Wrapper(nn.Module):
    """What DDP is to the model it wraps: an outer module whose forward calls the model's."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _autocast_inside(dtype: torch.dtype, enabled: bool = True) -> nn.Module:
    """accelerate's `prepare` under mixed precision: the model's own forward wrapped in autocast (an instance
    attribute, as `model.forward = autocast(...)(model.forward)`), then the model wrapped in DDP; autocast is
    entered after the outer forward began, inside the model's."""
    model = _model()
    model.forward = torch.autocast("cpu", dtype=dtype, enabled=enabled)(model.forward)
    return _Wrapper(model)


@pytest.mark.parametrize("recorder", [False, True], ids=["alone", "recorder"])
def test_autocast_entered_inside_the_model_s_forward_is_the_precision_it_ran_at(recorder: bool) -> None:
    """The state is read where the model computes: a run whose wrapper enters autocast inside the forward is not
    taken for fp32, and a model that turns autocast off inside its forward is not taken for bf16."""
    x, y = _batch()
    for wrapped, outer, precision in [(_autocast_inside(torch.bfloat16), False, "bf16-mixed"),
                                      (_autocast_inside(torch.bfloat16, enabled=False), True, "32-true")]:
        with (FitRecorder() if recorder else AmpWatch(forwards=True)) as watching:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer):
                    F.cross_entropy(wrapped(x), y).backward()
        record = watching.record.amp if recorder else watching.record
        assert record.micro_batches == 2 and record.precision == precision, record
        assert record.described() == ("cpu autocast to bfloat16 at every one of its 2 training micro-batches"
                                      if precision == "bf16-mixed" else
                                      "no autocast at any of its 2 training micro-batches")


def test_a_model_cast_to_half_without_autocast_is_a_true_half_precision() -> None:
    record = AmpRecord()
    record.micro_batches, record.states = 3, {("off", "bfloat16"): 3}
    assert record.precision == "bf16-true"
    assert AmpRecord().precision is None  # no micro-batch: nothing observed


def test_clipping_after_unscale_is_sound() -> None:
    record = _loop(_clip_after_unscale, dtype=torch.float16)
    assert record.scaled == 2 and record.scales[0] == SCALE
    assert record.unscaled == 2  # explicit ones; scaler.step's own, once unscaled, is not counted
    assert record.scaler_steps == 2 and record.clips == 2
    assert not record.clipped_scaled and not record.scaled_steps


def test_clipping_before_unscale_is_named_with_the_scale() -> None:
    record = _loop(_clip_before_unscale, dtype=torch.float16)
    assert [(c.function, c.scale, c.step) for c in record.clipped_scaled] == [
        ("clip_grad_norm_", SCALE, 1), ("clip_grad_norm_", SCALE, 2)]
    assert not record.scaled_steps and record.unscaled == 0


def test_a_step_outside_the_scaler_on_a_scaled_loss_is_named() -> None:
    record = _loop(_direct_step)
    assert [(s.scale, s.step) for s in record.scaled_steps] == [(SCALE, 1), (SCALE, 2)]
    assert record.scaler_steps == 0


def test_a_step_outside_the_scaler_after_unscale_is_sound() -> None:
    def unscaled_then_step(model: nn.Module, optimizer: Any, scaler: Any, loss: torch.Tensor) -> None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        optimizer.step()
        scaler.update()

    record = _loop(unscaled_then_step)
    assert not record.scaled_steps and not record.clipped_scaled


def test_a_disabled_scaler_scales_nothing() -> None:
    model, x, y = _model(), *_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with AmpWatch(forwards=True) as watch:
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
    assert watch.record.scaled == 0 and not watch.record.clipped_scaled and watch.record.scaler_steps == 0


def test_a_skipped_step_is_counted() -> None:
    model, x, y = _model(), *_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with AmpWatch() as watch:
        scaler.scale(F.cross_entropy(model(x), y) * float("inf")).backward()
        scaler.step(optimizer)
        scaler.update()
    assert watch.record.scaler_steps == 1 and watch.record.skipped == 1


def test_clipping_a_generator_still_clips_every_tensor() -> None:
    model, x, y = _model(), *_batch()
    F.cross_entropy(model(x), y).mul(100).backward()
    with AmpWatch():
        norm = nn.utils.clip_grad_norm_((p for p in model.parameters()), 1e-3)
    assert float(norm) > 1e-3
    total = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    assert float(total) == pytest.approx(1e-3, rel=1e-3)


def test_a_clipping_of_other_parameters_is_not_judged_at_this_optimizers_step() -> None:
    model, other, x, y = _model(), nn.Linear(8, 2), *_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with AmpWatch() as watch:
        scaler.scale(F.cross_entropy(model(x), y) + other(x).sum()).backward()
        nn.utils.clip_grad_norm_(other.parameters(), 1.0)
        scaler.step(optimizer)
    # not the stepped optimizer's: kept as a clipping no optimizer step followed (a step's restatement, alone)
    assert watch.record.clips == 1 and [c.step for c in watch.record.clipped_scaled] == [0]


def test_the_fit_recorder_keeps_the_record() -> None:
    model, x, y = _model(), *_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    originals = (torch.amp.GradScaler.step, torch.amp.GradScaler.scale, torch.nn.utils.clip_grad_norm_)
    with FitRecorder() as recorder:
        for _ in range(2):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            _clip_before_unscale(model, optimizer, scaler, loss)
    record = recorder.record
    assert record.amp.micro_batches == record.micro_batches == 2
    assert record.amp.precision == "bf16-mixed" and len(record.amp.clipped_scaled) == 2
    assert record.optimizer_steps == 2
    assert (torch.amp.GradScaler.step, torch.amp.GradScaler.scale, torch.nn.utils.clip_grad_norm_) == originals


def test_a_clipping_no_step_follows_is_judged_as_the_watch_ends() -> None:
    model, x, y = _model(), *_batch()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with AmpWatch() as watch:  # a train_step: backward and clipping, no optimizer
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        nn.utils.clip_grad_value_(model.parameters(), 1.0)
    assert [(c.function, c.scale, c.step) for c in watch.record.clipped_scaled] == [("clip_grad_value_", SCALE, 0)]
