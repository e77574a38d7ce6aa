"""bucket_view_memory: with `gradient_as_bucket_view: true` the gradients are views into DDP's
buckets, and a measured training step holds at least 90% of one gradient copy less than the same
step with the flag off.

- The flag is forced on for this check when the config does not set it (noted in the figures):
  the property is what the flag promises, whatever the user's config says.
- The model must be big enough to measure: when the trainer's model (from the config's `model`
  section) has less than MIN_GRAD_BYTES of gradients, the check asks for MEASURE_MODEL through the
  same section and says so; a trainer whose model ignores the section and stays too small is
  skipped with the sizes, never passed on a number it cannot resolve.
- Memory (`memory.py`): two warm-up runs first (the first model a process builds pays one-off
  allocations: 87.8 vs 64.1 MB in ../shared/notes/ddp-facts.md), then three off/on pairs. The
  saving is the median pair's (a stray 128-256 KiB allocation in one run was seen), judged on the
  worst rank; the spread between runs of one setting is reported as `measurement_noise_bytes`.
- Structure, from the flag-on runs: `wrap` returned a DDP; DDP itself reports the flag
  (`_get_ddp_logging_data`); every grad is a view and they share one storage per bucket.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import replace
from typing import Any

import pytest

from ..config import ModelConfig
from .base import CheckContext, all_gather, hide_on_verdict, human_bytes
from .memory import StepMemory, heap_counter, measure_step

MIN_GRAD_BYTES = 1 << 20
MEASURE_MODEL = ModelConfig(input_dim=256, hidden=(512, 512), num_classes=16)
REQUIRED_SAVING = 0.9
STEPS = 3  # as in ddp-facts.md: grads are views only after the first step, buckets rebuilt after it
WARM_UP = (True, False)  # one-off allocations of the first runs in a process are not the step's
PAIRS = 3  # (off, on) pairs after the warm-up; the median pair is judged, robust to one stray allocation


def _with_flag(config: Any, flag: bool) -> Any:
    strategy = replace(config.trainer.strategy, gradient_as_bucket_view=flag)
    return replace(config, trainer=replace(config.trainer, strategy=strategy))


def _grad_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    device_type = ctx.rank_ctx.device_type
    if device_type == "cpu" and heap_counter() is None:
        pytest.skip("no heap counter on this platform: measuring CPU memory needs glibc's mallinfo2 (glibc >= 2.33)")
    config = ctx.config
    if not config.trainer.strategy.gradient_as_bucket_view:
        ctx.note("gradient_as_bucket_view forced to true for this check (the config does not set it)")
    config = _with_flag(config, True)
    size = _grad_bytes(ctx.adapter(config).make_model())
    if size < MIN_GRAD_BYTES:
        config = replace(config, model=MEASURE_MODEL)
        bigger = _grad_bytes(ctx.adapter(config).make_model())
        if bigger < MIN_GRAD_BYTES:
            pytest.skip(f"the trainer's model has {human_bytes(size)} of gradients, too small to measure against "
                        f"allocator noise (>= {human_bytes(MIN_GRAD_BYTES)} needed), and it ignores the config's "
                        "model section, so no bigger model can be asked for")
        ctx.note(f"model section replaced by {MEASURE_MODEL} for the measurement: the configured model has "
                 f"{human_bytes(size)} of gradients, {human_bytes(bigger)} are needed to measure reliably")
    adapters = {flag: ctx.adapter(_with_flag(config, flag)) for flag in (True, False)}
    data = adapters[True]
    per_rank = config.data.batch_size * config.trainer.accumulate_grad_batches
    dataset = data.make_dataset(max(config.data.size, per_rank * ctx.world_size))
    start = ctx.rank * per_rank
    batch = data.collate([dataset[i] for i in range(start, start + per_rank)])

    runs: list[StepMemory] = []
    # a full collection scans every object of the process (0.3 s once torch._dynamo is imported);
    # frozen (garbage included: it then cannot be freed in the middle of a measured run), the old
    # objects are skipped and the collections between runs only see the runs' own
    gc.freeze()
    try:
        order = (*WARM_UP, *(flag for _ in range(PAIRS) for flag in (False, True)))
        with ctx.training(STEPS * len(order)):
            for flag in order:
                runs.append(measure_step(adapters[flag], batch, flag, STEPS, device_type))
    finally:
        gc.unfreeze()
    measured = runs[len(WARM_UP):]
    on = [r for r in measured if r.gradient_as_bucket_view]
    off = [r for r in measured if not r.gradient_as_bucket_view]
    pairs = [o.footprint - n.footprint for o, n in zip(off, on, strict=True)]
    grad_bytes = on[0].grad_bytes
    spread = [max(r.footprint for r in rs) - min(r.footprint for r in rs) for rs in (on, off)]
    mine = {"saving": statistics.median(pairs), "grad_bytes": grad_bytes,
            "peak_off": statistics.median(r.peak for r in off),
            "footprint_on": statistics.median(r.footprint for r in on),
            "footprint_off": statistics.median(r.footprint for r in off), "noise": max(spread)}
    everyone = all_gather(mine)
    worst = min(everyone, key=lambda m: m["saving"] / m["grad_bytes"])
    first = on[-1]
    figures: dict[str, Any] = {
        "memory_counter": "torch.cuda.max_memory_allocated" if device_type == "cuda" else "glibc mallinfo2",
        "grad_bytes": grad_bytes, "saved_bytes": worst["saving"],
        "saved_pct_of_grad_bytes": round(100 * worst["saving"] / grad_bytes, 1),
        "saved_pct_of_step_peak": round(100 * worst["saving"] / worst["peak_off"], 1) if worst["peak_off"] else None,
        "step_peak_bytes_flag_off": worst["peak_off"], "footprint_bytes_flag_on": worst["footprint_on"],
        "footprint_bytes_flag_off": worst["footprint_off"],
        "measurement_noise_bytes": max(m["noise"] for m in everyone),
        "saved_bytes_per_rank": [m["saving"] for m in everyone],
        "wrapped_type": first.wrapped_type, "ddp_gradient_as_bucket_view": first.ddp_flag,
        "grads_are_views": first.all_views, "grad_storages": first.grad_storages, "buckets": first.buckets,
    }
    saved = (f"measured saving {human_bytes(worst['saving'])}, {figures['saved_pct_of_grad_bytes']}% of one gradient "
             f"copy ({human_bytes(grad_bytes)})")
    # the layout verdict of every rank, so all ranks give the same one (rank 0's is not the only witness)
    problems = [p for p in all_gather(layout_problem(first)) if p]
    if problems:
        raise ctx.fail(f"{problems[0]} ({saved})", **figures)
    problem = saving_problem(worst["saving"], grad_bytes)
    if problem:
        raise ctx.fail(f"{problem}: {saved}, on the worst rank", **figures)
    figures["summary"] = f"saved {figures['saved_pct_of_grad_bytes']}% of grads"
    return figures


def layout_problem(step: Any) -> str | None:
    """What is wrong with the gradients' layout after a step with the flag on, if anything."""
    if not step.is_ddp:
        return (f"the model is not wrapped in DistributedDataParallel (wrap returned a {step.wrapped_type}): "
                "there are no buckets for the gradients to be views of")
    if not step.ddp_flag:
        return ("gradient_as_bucket_view: true never reaches DDP: the DistributedDataParallel the trainer "
                "builds reports gradient_as_bucket_view=False (the config value is not passed on)")
    # one storage per bucket once DDP reports its rebuilt buckets; before that, at least shared ones
    shared = step.grad_storages <= step.buckets if step.buckets else step.grad_storages < step.grads
    if not step.all_views or not shared:
        return ("the gradients are not DDP's bucket views after the step although DDP has "
                "gradient_as_bucket_view=True: something replaces param.grad after backward (a clone?), "
                f"keeping a second copy ({step.grad_storages} grad storages for {step.buckets} buckets)")
    return None


def saving_problem(saving: float, grad_bytes: int) -> str | None:
    """The measured saving against the promise: one copy of the gradients, within measurement noise."""
    if saving < REQUIRED_SAVING * grad_bytes:
        return f"gradient_as_bucket_view saves less than {int(100 * REQUIRED_SAVING)}% of one gradient copy"
    return None
