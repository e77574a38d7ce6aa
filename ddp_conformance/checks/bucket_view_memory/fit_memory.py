"""bucket_view_memory for a trainer that cannot build its model on its own (a `script:` SPEC): its
own DDP and its gradients at the optimizer step, from its real run.

- The setting: a fit of STEPS optimizer steps under the fit recorder gives the settings of the DDP
  the fit builds (`record.ddp`: DDP's own attribute) and whether the gradients its first optimizer
  step applied were views into DDP's buckets (`grad_views.GradViews`, a watcher of the fit).
- No DDP: fail when the config claims the flag, else skip (rank_participation judges wrapping).
- Off in the fit's DDP while `--ddp-config` claims it: fail ("never reaches DDP"), naming that the
  fit's own DDP reports False. Off and not claimed: skipped, with the would-be saving.
- On: the gradients at the optimizer step must be the buckets' views (a `p.grad = p.grad.clone()`
  or `torch.nan_to_num(p.grad)` before the step fails), and the measured saving must be at least
  REQUIRED_SAVING of one gradient copy.
- Memory: the same fit run again with the flag of the fit's `DistributedDataParallel(...)` call
  forced (its constructor is wrapped for the run; every other argument is the script's), in pairs
  (off, on) after one discarded warm-up run. Each run reads what is in use (glibc's heap on CPU,
  `torch.cuda.memory_allocated` on CUDA) at the pre-hook of its last optimizer step (where a GradScaler
  steps, as its `scaler.step` begins, so that a step it skips counts as the script counts it), relative to
  just before the run: with the flag on the gradients there are the buckets; off, a second copy.
  The median pair's saving is judged, on the worst rank. A model with less than MIN_GRAD_BYTES of
  gradients is not measured (its saving is within allocator noise): the verdict then rests on the
  gradients' layout alone, and a note says so; nothing is passed on a number that cannot resolve it.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch.amp import GradScaler
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...adapter import NotProvided
from ...trainers.spec import SCRIPT
from ..support.check_context import CheckContext, all_gather, hide_on_verdict, human_bytes
from ..support.fit_watch import FitPlan
from ..support.memory import heap_counter, settle
from ..support.observe import ddp_argument_forced
from ..support.progress import guarded_fit
from .grad_views import (
    ADVICE,
    MIN_GRAD_BYTES,
    PAIRS,
    STEPS,
    GradViews,
    fit_keeps_the_views,
    gathered_views,
    gradient_bytes,
    saving_problem,
    within_noise,
)

WARM_UPS = 1  # measured runs discarded before the pairs: the first forced run pays one-off allocations


def judge_the_fit(ctx: CheckContext, missing: NotProvided) -> dict[str, Any]:
    """The verdict on the DDP the trainer's own fit builds; `missing` (no make_model) is raised where
    the trainer has no fit either."""
    __tracebackhide__ = hide_on_verdict
    ctx.require_shared_workdir()
    declared = ctx.config.trainer.strategy.gradient_as_bucket_view
    try:
        guarded_fit(ctx, "fit-setting", STEPS, _fit(ctx), FitPlan(watchers=(GradViews,)))
    except NotProvided as exc:
        if exc.what != "fit":
            raise
        raise missing from None
    record = ctx.recordings.pop("fit-setting")
    flags = all_gather(None if record.ddp is None else bool(record.ddp.get("gradient_as_bucket_view")))
    views = gathered_views(record)
    grad_bytes = max(all_gather(0 if record.model is None else gradient_bytes(record.model)))
    device_type = _where_it_trains(ctx, record.model)
    del record  # its model and data are not held through the measured runs
    ctx.figures.update(fit_ddp_gradient_as_bucket_view_per_rank=flags, grad_bytes=grad_bytes)
    if None in flags:
        problem = (f"the fit's model is not wrapped in DistributedDataParallel (rank {flags.index(None)}): there are "
                   "no buckets for the gradients to be views of")
        if declared:
            raise ctx.fail(f"{problem}, although the config sets gradient_as_bucket_view: true")
        pytest.skip(f"{problem}; nothing to measure (rank_participation judges the wrapping)")
    if all(flags):
        fit_keeps_the_views(ctx, flags, views)  # the layout first: a copy made before the step fails here
    off = [rank for rank, flag in enumerate(flags) if not flag]
    if off:
        builder = "the script's own" if ctx.spec.kind == SCRIPT else "the trainer's fit's own"
        where = "on every rank" if len(off) == len(flags) else f"on rank {off[0]}"
        reports = f"{builder} DistributedDataParallel reports gradient_as_bucket_view=False {where}"
        if not declared and not ctx.advise:  # the saving is advice, not a verdict: measured on request
            ctx.figures["summary"] = "off"
            pytest.skip(f"gradient_as_bucket_view is off ({reports}; the config does not set it): {ADVICE}")
    saving, unmeasured = _saving(ctx, grad_bytes, device_type)
    if off:
        if declared:
            raise ctx.fail(f"gradient_as_bucket_view: true never reaches DDP: the config sets it, but {reports}: the "
                           "fit builds its DDP without the config's value (pass gradient_as_bucket_view=True where "
                           f"it builds DistributedDataParallel){saving or unmeasured}", **ctx.figures)
        ctx.figures["summary"] = "off"
        pytest.skip(f"gradient_as_bucket_view is off ({reports}; the config does not set it)"
                    f"{saving or unmeasured}")
    if saving is None:
        ctx.note(f"the gradients at the fit's optimizer step are DDP's bucket views{unmeasured}")
        ctx.figures["summary"] = "views; not measured"
        return {}
    problem = saving_problem(ctx.figures["saved_bytes"], grad_bytes)
    if problem and within_noise(grad_bytes, ctx.figures["measurement_noise_bytes"]):
        ctx.note(f"the saving{saving} is not judged: runs of one setting differed by "
                 f"{human_bytes(ctx.figures['measurement_noise_bytes'])}, more than the shortfall the check allows")
        ctx.figures["summary"] = "views; saving in noise"
        return {}
    if problem:
        raise ctx.fail(f"{problem}{saving}", **ctx.figures)
    ctx.figures["summary"] = f"saved {ctx.figures['saved_pct_of_grad_bytes']}% of grads"
    return {}


def _fit(ctx: CheckContext) -> Callable[[Any], Any]:
    return lambda observer: ctx.adapter().fit(STEPS, observer=observer)


def _where_it_trains(ctx: CheckContext, model: Any) -> str:
    """The device type of the fit's model: a script chooses its own (one that trains on the CPU under
    `--ddp-device cuda` holds its gradients in the heap, which the CUDA counter never sees)."""
    own = next((p.device.type for p in model.parameters()), None) if model is not None else None
    if own is not None and own != ctx.rank_ctx.device_type:
        ctx.note(f"the fit's model trains on {own}, not on the harness's {ctx.rank_ctx.device_type}: its memory is "
                 f"measured on {own}")
    return own or ctx.rank_ctx.device_type


def _saving(ctx: CheckContext, grad_bytes: int, device_type: str) -> tuple[str | None, str]:
    """Measure the saving (collective): (the clause that states it, None when it was not measured;
    the clause that says why not)."""
    read = _counter(device_type)
    if read is None:
        return None, ("; the saving was not measured: no heap counter on this platform (glibc's mallinfo2, glibc "
                      ">= 2.33, measures CPU memory)")
    if grad_bytes < MIN_GRAD_BYTES:
        return None, (f"; the saving was not measured: the fit's model has {human_bytes(grad_bytes)} of gradients, "
                      f"too small to measure against allocator noise (>= {human_bytes(MIN_GRAD_BYTES)} needed)")
    flags = [True] * WARM_UPS + [flag for _ in range(PAIRS) for flag in (False, True)]
    gc.freeze()  # the runs' collections then skip the process's old objects (see bucket_view_memory.run)
    try:
        held = [_held_at_last_step(ctx, read, flag, run) for run, flag in enumerate(flags)]
    finally:
        gc.unfreeze()
    measured = held[WARM_UPS:]
    off, on = measured[0::2], measured[1::2]
    mine = {"saving": statistics.median(o - n for o, n in zip(off, on, strict=True)),
            "noise": max(max(rs) - min(rs) for rs in (off, on)), "on": statistics.median(on),
            "off": statistics.median(off)}
    everyone = all_gather(mine)
    worst = min(everyone, key=lambda m: m["saving"])
    ctx.figures.update(
        memory_counter="torch.cuda.memory_allocated" if device_type == "cuda" else "glibc mallinfo2",
        measured_at=f"the pre-hook of optimizer step {STEPS} of the fit, its DDP's flag forced",
        saved_bytes=worst["saving"], saved_pct_of_grad_bytes=round(100 * worst["saving"] / grad_bytes, 1),
        held_bytes_flag_on=worst["on"], held_bytes_flag_off=worst["off"],
        measurement_noise_bytes=max(m["noise"] for m in everyone),
        saved_bytes_per_rank=[m["saving"] for m in everyone])
    return (f" (measured saving {human_bytes(worst['saving'])}, {ctx.figures['saved_pct_of_grad_bytes']}% of one "
            f"gradient copy ({human_bytes(grad_bytes)}), at the fit's optimizer step {STEPS}, on the worst rank)"), ""


def _counter(device_type: str) -> Callable[[], int] | None:
    if device_type == "cuda":
        return torch.cuda.memory_allocated
    return heap_counter()


def _held_at_last_step(ctx: CheckContext, read: Callable[[], int], flag: bool, run: int) -> int:
    """What is in use at the pre-hook of the fit's last optimizer step, relative to just before the
    fit, with the flag of every DistributedDataParallel the fit builds forced to `flag`."""

    seen: dict[str, Any] = {"steps": 0, "in_scaler_step": False}

    def before_step(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        seen.setdefault("optimizer", optimizer)
        if optimizer is seen["optimizer"] and not seen["in_scaler_step"]:
            seen["steps"] += 1
            if seen["steps"] == STEPS:
                seen["held"] = settle(read)

    def scaler_step(original: Any) -> Any:
        """A GradScaler's step is the trainer's step whether or not it calls `optimizer.step()` (it skips it on
        gradients that hold inf or NaN, as fp16's first steps often do): counted, and read, where it begins."""
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before_step(optimizer, args, kwargs)
            seen["in_scaler_step"] = True
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                seen["in_scaler_step"] = False

        return step

    label = f"memory-{run}"
    base = settle(read)
    handle = register_optimizer_step_pre_hook(before_step)
    try:
        with ddp_argument_forced("gradient_as_bucket_view", flag), \
                mock.patch.object(GradScaler, "step", scaler_step(GradScaler.step)):
            guarded_fit(ctx, label, STEPS, _fit(ctx))
    finally:
        handle.remove()
        ctx.recordings.pop(label, None)
    if "held" not in seen:
        raise RuntimeError(f"the fit took {seen['steps']} optimizer steps, not {STEPS}")
    return int(seen["held"]) - base
