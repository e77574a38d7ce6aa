"""bucket_view_memory: the trainer's own `gradient_as_bucket_view` setting, judged by what it does.

- The setting is the trainer's: what its DDP reports (`_get_ddp_logging_data`) when it wraps a model
  with the run's config, and what its config says after its own `setup` (the `--ddp-config` file, or
  what the trainer made of it). Nothing is forced on the trainer's verdict.
- The DDP measured is `wrap`'s, a restatement: a one-step fit (the probe other checks share,
  `shared_fit.probe`) shows the setting of the DDP the fit itself builds (`observe.FitRecorder`),
  and the two must agree. A Lightning `strategy()` that lists
  the DDP kwargs by hand and drops the flag passes `wrap` and fails here.
- On (DDP reports it): the gradients must be views into DDP's buckets, and a measured training step
  must hold at least 90% of one gradient copy less than the same step with the flag off; else fail.
- Claimed by the config but off in DDP: fail ("never reaches DDP"), with the measured figures.
- Off and not claimed: skipped; under `--ddp-advise` (the figure is advice, and costs three more
  runs) with the measured saving turning it on would give. For that figure
  the flag is set through the config; a trainer whose wrap ignores the config is measured with a
  plain `DistributedDataParallel` (its find_unused_parameters and static_graph) around its model
  and train_step, and the notes say so.
- No DDP at all: fail when the config claims the flag, else skip (rank_participation judges wrapping).
- The model must be big enough to measure: when the trainer's model (from the config's `model`
  section) has less than MIN_GRAD_BYTES of gradients, the check asks for MEASURE_MODEL through the
  same section and says so; a trainer whose model ignores the section and stays too small is
  skipped with the sizes, never passed on a number it cannot resolve.
- Memory (`memory.py`): two warm-up runs first (the first model a process builds pays one-off
  allocations: 87.8 vs 64.1 MB in docs/ddp-facts.md): the trainer as configured, which
  tells its setting, and one with the flag on; then three off/on pairs. The saving is the median
  pair's (a stray 128-256 KiB allocation in one run was seen), judged on the worst rank; the spread
  between runs of one setting is reported as `measurement_noise_bytes`. For a flag that is off (a
  skip, whose saving is a figure, not a verdict) the first pair is enough when it already shows at
  least 90% of a gradient copy on every rank (`pairs_measured`).
- Structure, from the flag-on runs: `wrap` returned a DDP; DDP itself reports the flag; every grad
  is a view and they share one storage per bucket.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import replace
from typing import Any

import pytest
from torch.nn.parallel import DistributedDataParallel

from ...adapter import NotProvided
from ...config import ModelConfig
from ..support import shared_fit
from ..support.check_context import CheckContext, all_gather, hide_on_verdict, human_bytes
from ..support.memory import DdpSetting, StepMemory, ddp_setting, heap_counter, measure_step
from .fit_memory import judge_the_fit
from .grad_views import (
    ADVICE,
    MIN_GRAD_BYTES,
    PAIRS,
    REQUIRED_SAVING,
    STEPS,
    GradViews,
    fit_keeps_the_views,
    gathered_views,
    gradient_bytes,
    saving_problem,
    within_noise,
)

#: what this check reads of the shared probe fit (`checks.PROBE_READERS`)
PROBE_WATCHER = GradViews
MEASURE_MODEL = ModelConfig(input_dim=256, hidden=(512, 512), num_classes=16)


def _with_flag(config: Any, flag: bool) -> Any:
    strategy = replace(config.trainer.strategy, gradient_as_bucket_view=flag)
    return replace(config, trainer=replace(config.trainer, strategy=strategy))


def _declared(adapter: Any, fallback: Any) -> bool | None:
    """The flag in the trainer's config after its own setup (None: not set); the run's when it keeps none."""
    config = getattr(adapter, "config", None) or fallback
    return config.trainer.strategy.gradient_as_bucket_view


class PlainDDP:
    """The trainer's adapter with the wrapping done here, for a trainer whose `wrap` ignores the
    config's flag: the would-be saving is still measured on its model and its train_step."""

    def __init__(self, adapter: Any, flag: bool, kwargs: dict[str, Any]) -> None:
        self._adapter, self.flag, self.kwargs = adapter, flag, kwargs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def wrap(self, model: Any) -> Any:
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=self.flag, **self.kwargs)


def _measurable(ctx: CheckContext) -> Any:
    """The run's config, with MEASURE_MODEL when the trainer's model is too small to measure."""
    config = ctx.config
    size = gradient_bytes(ctx.adapter(config).make_model())
    if size >= MIN_GRAD_BYTES:
        return config
    config = replace(config, model=MEASURE_MODEL)
    bigger = gradient_bytes(ctx.adapter(config).make_model())
    if bigger < MIN_GRAD_BYTES:
        pytest.skip(f"the trainer's model has {human_bytes(size)} of gradients, too small to measure against "
                    f"allocator noise (>= {human_bytes(MIN_GRAD_BYTES)} needed), and it ignores the config's "
                    "model section, so no bigger model can be asked for")
    ctx.note(f"model section replaced by {MEASURE_MODEL} for the measurement: the configured model has "
             f"{human_bytes(size)} of gradients, {human_bytes(bigger)} are needed to measure reliably")
    return config


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    device_type = ctx.rank_ctx.device_type
    try:
        config = _measurable(ctx)
    except NotProvided as exc:  # a script: only its run builds its model and its DDP
        if exc.what != "make_model":
            raise
        return judge_the_fit(ctx, exc)
    if device_type == "cpu" and heap_counter() is None:
        pytest.skip("no heap counter on this platform: measuring CPU memory needs glibc's mallinfo2 (glibc >= 2.33)")
    own = ctx.adapter(config)
    declared = _declared(own, config)
    read = _read_without_a_step(ctx, own, declared)
    if read is not None:
        (mode, own_run), runs = read, []
    else:
        per_rank = config.data.batch_size * config.trainer.accumulate_grad_batches
        dataset = own.make_dataset(max(config.data.size, per_rank * ctx.world_size))
        start = ctx.rank * per_rank
        batch = own.collate([dataset[i] for i in range(start, start + per_rank)])
        # a full collection scans every object of the process (a large part of a second once torch._dynamo is in);
        # frozen (garbage included: it then cannot be freed in the middle of a measured run), the old
        # objects are skipped and the collections between runs only see the runs' own
        gc.freeze()
        try:
            with ctx.training():
                mode, own_run, runs = _measure_runs(ctx, config, own, declared, batch, device_type)
        finally:
            gc.unfreeze()
    ctx.observed_steps += STEPS * (len(runs) + (1 if runs else 0))  # the pairs, and the warm-up before them
    ctx.figures["pairs_measured"] = len(runs) // 2
    views = None
    if mode != "no-ddp":  # decided from every rank's runs: all ranks run the fit, or none
        views = _fit_agrees(ctx, declared, own_run)
    figures = _judge(ctx, mode, declared, own_run, runs)
    if views is not None:  # the step's own layout is sound (judged first: its verdict names more)
        fit_keeps_the_views(ctx, *views)
    return figures


def _fit_agrees(ctx: CheckContext, declared: bool | None,
                own_run: StepMemory | DdpSetting) -> tuple[list[bool | None], list[bool | None]] | None:
    """Fail when the DDP the trainer's own fit builds has another gradient_as_bucket_view than the
    DDP its `wrap` builds (measured above): the memory judged would not be the fit's. Returns every
    rank's fit flag and whether its first step's gradients were views, for `fit_keeps_the_views`."""
    __tracebackhide__ = hide_on_verdict
    if not ctx.shared:  # no directory to watch a fit through
        ctx.note("the DDP the fit builds is not compared with wrap's: the ranks share no directory to watch a fit")
        return None
    try:
        record = shared_fit.probe(ctx)  # the one-step fit the other checks measure an epoch with
    except NotProvided as exc:
        ctx.note(f"the DDP the fit builds is not compared with wrap's: {exc}")
        return None
    fit_flags = all_gather(None if record.ddp is None else bool(record.ddp.get("gradient_as_bucket_view")))
    ctx.figures["fit_ddp_gradient_as_bucket_view_per_rank"] = fit_flags
    if None in fit_flags or all(flag == bool(own_run.ddp_flag) for flag in fit_flags):
        return fit_flags, gathered_views(record)
    if declared and not all(fit_flags):
        raise ctx.fail("gradient_as_bucket_view: true never reaches DDP in the fit: the DistributedDataParallel the "
                       "trainer's fit builds reports gradient_as_bucket_view=False, while its wrap() passes it on "
                       "(does the fit build its DDP, or a Lightning strategy's, from kwargs listed by hand?)")
    raise ctx.fail(f"the fit's DistributedDataParallel reports gradient_as_bucket_view={fit_flags} (per rank) but the "
                   f"trainer's wrap() builds it with {bool(own_run.ddp_flag)}: wrap restates a DDP the fit does not "
                   "build, so its memory is not the fit's")


def _read_without_a_step(ctx: CheckContext, own: Any, declared: bool | None) -> tuple[str, DdpSetting] | None:
    """Where the config claims nothing and no advice is asked for, the setting read off `wrap` without a
    step, nor a batch built for one: off, or no DDP, is then a skip with nothing to measure ((mode, the
    setting), as `_measure_runs` names them); None where it must be measured."""
    if declared or ctx.advise:
        return None
    with ctx.training():
        read = ddp_setting(own)
    gathered = all_gather((read.is_ddp, bool(read.ddp_flag)))
    if not all(is_ddp for is_ddp, _ in gathered):
        return "no-ddp", read
    if not any(flag for _, flag in gathered):
        return "off", read
    # to be measured: the DDP just read off wrap (its model, its buckets) must not be freed inside a measured
    # step; a full collection is costly once torch._dynamo is imported, so only here
    gc.collect()
    return None


def _measure_runs(ctx: CheckContext, config: Any, own: Any, declared: bool | None, batch: Any,
                  device_type: str) -> tuple[str, StepMemory | DdpSetting, list[StepMemory]]:
    """The trainer as configured (its setting), then the off/on pairs: (mode, that run, the pairs).
    mode: "on" (judged), "unhonoured" (claimed, off in DDP), "off" (measured for the skip), "no-ddp"."""
    own_run = measure_step(own, batch, bool(declared), STEPS, device_type)
    ctx.observed_steps += STEPS
    setting = all_gather((own_run.is_ddp, bool(own_run.ddp_flag)))
    if not all(is_ddp for is_ddp, _ in setting):
        return "no-ddp", own_run, []
    on = all(flag for _, flag in setting)
    mode = "on" if on else "unhonoured" if declared else "off"
    if mode == "off" and not ctx.advise:  # the saving is advice, not a verdict: measured on request
        return mode, own_run, []
    adapters: dict[bool, Any] = {flag: ctx.adapter(_with_flag(config, flag)) for flag in (True, False)}
    # the second warm-up: does the setting the comparison needs (the one the trainer does not use) reach DDP
    # through the config? An unhonoured flag is measured as the trainer builds it, to show what it costs
    probe = measure_step(adapters[not on], batch, not on, STEPS, device_type)
    if mode != "unhonoured" and not all(all_gather(bool(probe.ddp_flag) is not on)):
        kwargs = {"find_unused_parameters": own_run.extra.get("find_unused_parameters", False),
                  "static_graph": own_run.extra.get("static_graph", False)}
        adapters = {flag: PlainDDP(adapters[flag], flag, kwargs) for flag in (True, False)}
        ctx.note("the trainer's wrap does not take gradient_as_bucket_view from the config: the runs compared are "
                 f"measured with DistributedDataParallel(model, gradient_as_bucket_view=..., "
                 f"{', '.join(f'{k}={v}' for k, v in kwargs.items())}) around the trainer's model and train_step")
    runs: list[StepMemory] = []
    for pair in range(PAIRS):
        runs += [measure_step(adapters[flag], batch, flag, STEPS, device_type) for flag in (False, True)]
        if pair == 0 and mode == "off" and all(all_gather(_saves_enough(*runs))):
            # a skip's figure, already consistent with the promise: the pairs left would only refine it
            ctx.note("the saving was measured in one off/on pair, which already showed it at least "
                     f"{int(100 * REQUIRED_SAVING)}% of a gradient copy (a flag that is on is judged on the "
                     f"median of {PAIRS} pairs)")
            break
    return mode, own_run, runs


def _saves_enough(off: StepMemory, on: StepMemory) -> bool:
    return saving_problem(off.footprint - on.footprint, on.grad_bytes) is None


def _judge(ctx: CheckContext, mode: str, declared: bool | None, own_run: StepMemory | DdpSetting,
           runs: list[StepMemory]) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    if mode == "no-ddp":
        ctx.figures["wrapped_type"] = own_run.wrapped_type
        problem = layout_problem(own_run)
        if declared:
            raise ctx.fail(f"{problem}, although the config sets gradient_as_bucket_view: true")
        pytest.skip(f"{problem}; nothing to measure (rank_participation judges the wrapping)")
    setting = "its config sets it false" if declared is False else "its config does not set it"
    if mode == "off" and not runs:
        pytest.skip(f"gradient_as_bucket_view is off (the trainer's DDP reports False; {setting}): {ADVICE}")
    figures, worst = _figures(ctx, runs)
    saved = (f"{human_bytes(worst['saving'])}, {figures['saved_pct_of_grad_bytes']}% of one gradient copy "
             f"({human_bytes(worst['grad_bytes'])})")
    if mode == "unhonoured":
        raise ctx.fail(f"{layout_problem(own_run)} (measured saving {saved})", **figures)
    # the layout verdict of every rank, so all ranks give the same one (rank 0's is not the only witness);
    # with the flag on, of the trainer's own DDP too
    mine = [layout_problem(r) for r in ([own_run] if mode == "on" else []) + [runs[-1]]]
    problems = [p for p in all_gather(next((p for p in mine if p), None)) if p]
    if mode == "off":
        ctx.figures.update(figures, summary=f"off; on saves {figures['saved_pct_of_grad_bytes']}%")
        but = f"; but with it on: {problems[0]}" if problems else ""
        pytest.skip(f"gradient_as_bucket_view is off (the trainer's DDP reports False; {setting}): turning it on would "
                    f"save {saved} in the measured step, {figures['saved_pct_of_step_peak']}% of its peak{but}")
    if problems:
        raise ctx.fail(f"{problems[0]} (measured saving {saved})", **figures)
    problem = saving_problem(worst["saving"], worst["grad_bytes"])
    if problem and within_noise(worst["grad_bytes"], figures["measurement_noise_bytes"]):
        ctx.note(f"the measured saving ({saved}) is not judged: runs of one setting differed by "
                 f"{human_bytes(figures['measurement_noise_bytes'])}, more than the shortfall the check allows; the "
                 "gradients are DDP's bucket views (the layout is judged)")
        figures["summary"] = "views; saving in noise"
        return figures
    if problem:
        raise ctx.fail(f"{problem}: measured saving {saved}, on the worst rank", **figures)
    figures["summary"] = f"saved {figures['saved_pct_of_grad_bytes']}% of grads"
    return figures


def _figures(ctx: CheckContext, runs: list[StepMemory]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The measured figures (the worst rank's saving) and that rank's raw numbers (collective)."""
    on = [r for r in runs if r.gradient_as_bucket_view]
    off = [r for r in runs if not r.gradient_as_bucket_view]
    pairs = [o.footprint - n.footprint for o, n in zip(off, on, strict=True)]
    grad_bytes = on[0].grad_bytes
    spread = [max(r.footprint for r in rs) - min(r.footprint for r in rs) for rs in (on, off)]
    mine = {"saving": statistics.median(pairs), "grad_bytes": grad_bytes,
            "peak_off": statistics.median(r.peak for r in off),
            "footprint_on": statistics.median(r.footprint for r in on),
            "footprint_off": statistics.median(r.footprint for r in off), "noise": max(spread)}
    everyone = all_gather(mine)
    worst = min(everyone, key=lambda m: m["saving"] / m["grad_bytes"])
    last = on[-1]
    figures: dict[str, Any] = {
        "memory_counter": ("torch.cuda.max_memory_allocated" if ctx.rank_ctx.device_type == "cuda"
                           else "glibc mallinfo2"),
        "grad_bytes": grad_bytes, "saved_bytes": worst["saving"],
        "saved_pct_of_grad_bytes": round(100 * worst["saving"] / grad_bytes, 1),
        "saved_pct_of_step_peak": round(100 * worst["saving"] / worst["peak_off"], 1) if worst["peak_off"] else None,
        "step_peak_bytes_flag_off": worst["peak_off"], "footprint_bytes_flag_on": worst["footprint_on"],
        "footprint_bytes_flag_off": worst["footprint_off"],
        "measurement_noise_bytes": max(m["noise"] for m in everyone),
        "saved_bytes_per_rank": [m["saving"] for m in everyone],
        "wrapped_type": last.wrapped_type, "ddp_gradient_as_bucket_view": last.ddp_flag,
        "grads_are_views": last.all_views, "grad_storages": last.grad_storages, "buckets": last.buckets,
    }
    return figures, worst


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
