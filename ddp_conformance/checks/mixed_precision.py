"""mixed_precision: the mixed precision a trainer runs at (`bf16-mixed`, `16-mixed`) reaches the forward, and
the updates its optimizer applies are its fp32 gradients up to rounding: no loss scale is left in them, none
is clipped in scaled units.

The guides promise bf16-mixed as a free speed-up. Its silent bugs are the precision that never reaches
the forward (autocast not entered: the run is fp32 and slower than the user believes), a loss scale that
is never divided out (`optimizer.step()` where `scaler.step(optimizer)` belongs, or a static loss scale
copied from an fp16 recipe: every update is the scale times too large, and the loss often still falls for
a while), and gradients clipped before `scaler.unscale_` (minGPT's DDP script: the norm is clipped in
scaled units, so the applied gradients' norm is at most 1/scale of the threshold).

The precision is observed, not assumed (`amp_watch`): at every training micro-batch the recorder reads
whether autocast was on and its dtype, and it watches the GradScaler's `scale`, `unscale_` and `step`, the
clipping functions of `torch.nn.utils`, and every optimizer step. Any fit that clipped gradients a scaler
had not unscaled for the optimizer that then stepped them, or stepped an optimizer directly on a scaled
loss's gradients never unscaled, fails, naming the function and the scale.

A trainer that takes the harness's config, which claims a mixed precision: runs the trainer's own fit
twice for one optimizer step, watched by the recorder (`fit_record.FirstStep`: the gradients the optimizer
applied, read in its pre-step hook, after `scaler.step` has unscaled them): once with the config as given,
once with `trainer.precision: 32-true`, both with the config's dropout at 0. Both start from the same seeded
model and data, so they differ only by the precision. On a GPU the two precisions' dropout masks differ
(measured on an H200: the advanced config's dropout 0.1 made bf16 and fp32 gradients differ by 0.81-1.02 of
their norm, 0.0078 without it; on CPU they agree), so a fit that draws random numbers during its step (a
trainer's own dropout) is skipped on CUDA.

The two steps are compared as one vector, norm-wise (`relative_difference`): a parameter whose fp32
gradient is tiny (a BatchNorm bias) differs elementwise by far more than the step as a whole.
- at most `REACHES` (1e-7, float32's rounding): the precision never reached the forward (fail);
- a multiple of the fp32 gradients, at least `SCALED` times them with a residual below `RESIDUAL`
  (`gradients.scale_ratio`): a loss scale never divided out, named with its factor (fail);
- anything else passes. How far rounding alone moves a step is measured, not bounded: bf16 over
  BatchNorm layers of 4 samples moved the references' first step by up to half its norm (`NOISE`), so
  no tolerance can tell a legitimate step from a model cast wholly to half precision. A difference
  beyond the largest measured for that device and precision is a note, with the figure.

Any other trainer (a `script:` one runs its own command line, so the harness cannot run it in fp32; one
whose config claims `32-true`) is judged from the dropout-free fit the checks share, as observed: its
GradScaler use as above; where it ran under autocast, a note says so beside the config's claim. A fit
with neither autocast nor a GradScaler skips: there is no mixed precision to compare.

Skips, with the reason: a fit with no mixed precision and no GradScaler (`-true` half precision is not
promised to match fp32), a first step whose scaled gradients overflowed (a GradScaler skipped it) where the
config claims the precision, random draws during the step on a GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from ..adapter import NotProvided
from .gradient_equivalence.tolerance import precision_seen
from .support import shared_fit
from .support.amp_watch import AmpRecord
from .support.check_context import CheckContext, all_gather, hide_on_verdict, rounded
from .support.first_steps import first_step, without_dropout
from .support.gradients import scale_ratio
from .support.reproducible import require_reproducible

#: the largest norm-wise difference from the fp32 step measured, by device and precision, over both
#: references and every config in fixtures/configs/ at that precision, seeds 0 and 1, dropout 0.
#: CPU bf16-mixed, world sizes 1-4: 0.502 (basic.yaml, seed 0, world size 3: BatchNorm over micro-batches of
#: 4), 0.078 without BatchNorm. CUDA (an H200, gloo with ranks sharing it at world size 2, nccl at 1):
#: bf16-mixed 0.0767 (advanced.yaml, world size 1), 0.0078 at 2; 16-mixed 0.0047 at 2, under 0.025 at 1.
NOISE = {
    "cpu": {"bf16-mixed": 0.502},
    "cuda": {"bf16-mixed": 0.0767, "16-mixed": 0.025},
}
#: at or below this norm-wise difference the gradients are fp32's: the precision never reached the forward
REACHES = 1e-7
#: a step at least this many times the fp32 one, and a multiple of it within RESIDUAL, holds a loss scale
SCALED = 2.0
RESIDUAL = 0.5


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    claimed = ctx.config.trainer.precision
    config = without_dropout(ctx.config)
    adapter = ctx.adapter(config)  # tells whether the trainer takes the config
    if ctx.takes_config and claimed.endswith("-mixed"):
        return _against_fp32(ctx, claimed, adapter)
    return _as_observed(ctx, claimed)


def _as_observed(ctx: CheckContext, claimed: str) -> dict[str, Any]:
    """A trainer whose precision is its own (a script's command line) or whose config claims none: judged
    from what its fit did (the dropout-free fit the checks share): the precision its forwards ran at and how
    its GradScaler's scale left the gradients the optimizer applied."""
    __tracebackhide__ = hide_on_verdict
    try:
        amps = all_gather(shared_fit.steady(ctx).record.amp)
    except NotProvided as missing:
        pytest.skip(f"{missing}: there is no fit to observe, and the config's trainer.precision is {claimed!r}: there "
                    "is no mixed precision to compare with fp32")
    seen = next((a for a in amps if a.precision), amps[0])
    figures: dict[str, Any] = {"precision": seen.precision or claimed, "claimed": claimed,
                               "autocast_micro_batches": seen.autocast_batches, "micro_batches": seen.micro_batches,
                               "loss_scales": seen.scales, "scaler_skipped_steps": seen.skipped}
    if not (seen.precision or "").endswith("-mixed") and not any(a.scaled for a in amps):
        owner = "the config's" if ctx.takes_config else "the harness's config (not the script's own)"
        pytest.skip(f"the fit ran at {seen.precision or claimed} ({seen.described()}, no GradScaler; {owner} "
                    f"trainer.precision is {claimed!r}): there is no mixed precision to compare with fp32")
    precision_seen(ctx, seen, "the fit")
    _fail_on_scaler_use(ctx, amps, figures)
    if not ctx.takes_config:
        ctx.note("the script runs its own command line, so its step is not compared with an fp32 step: judged are its "
                 "autocast and its GradScaler's scale (a model cast wholly to half precision or a loss scale applied "
                 "by hand is not seen)")
    figures["summary"] = f"{seen.precision}, {seen.scaler_words()}"
    return figures


def _fail_on_scaler_use(ctx: CheckContext, amps: list[AmpRecord], figures: dict[str, Any]) -> None:
    """Fail, naming the cause and the factor, where some rank's fit left a GradScaler's scale in what its
    optimizer applied (collective: `amps` is every rank's)."""
    __tracebackhide__ = hide_on_verdict
    failing = [v for v in (scaler_verdict(a) for a in amps) if v]
    if failing:
        raise ctx.fail(failing[0], **figures)


def scaler_verdict(amp: AmpRecord) -> str:
    """What a fit's GradScaler use left in the applied updates, in words, or "" where it is sound."""
    if amp.clipped_scaled:
        clip = amp.clipped_scaled[0]
        return (f"{clip.words()} ({len(amp.clipped_scaled)} time(s) in the fit): the clipping threshold "
                f"is applied in scaled units, so once scaler.step unscales them the applied gradients' norm is at most "
                f"1/{clip.scale:g} of the threshold (Adam's normalised step hides part of it, SGD none); call "
                "scaler.unscale_(optimizer) before clipping")
    if amp.scaled_steps:
        step = amp.scaled_steps[0]
        return (f"the optimizer stepped directly (optimizer.step(), not scaler.step(optimizer)) on the gradients of a "
                f"loss scaled by {step.scale:g} that were never unscaled, at optimizer step {step.step}: the loss "
                f"scale is left in the applied gradients, {step.scale:g}x the true ones (an SGD update {step.scale:g}x "
                "too large; Adam's normalisation hides most of it) (call scaler.step(optimizer), or "
                "scaler.unscale_(optimizer) before optimizer.step())")
    return ""


def _against_fp32(ctx: CheckContext, precision: str, adapter: Any) -> dict[str, Any]:
    """A trainer that takes the config, which claims a mixed precision: its first step against the same fit's
    at 32-true, and its GradScaler use as observed."""
    __tracebackhide__ = hide_on_verdict
    config = without_dropout(ctx.config)
    try:
        mixed, record = first_step(ctx, "mixed", adapter)
    except pytest.skip.Exception:  # a first step a GradScaler skipped: its clipping was watched all the same
        if "mixed" in ctx.recordings:
            _fail_on_scaler_use(ctx, all_gather(ctx.recordings["mixed"].amp), {"precision": precision})
        raise
    _fail_on_scaler_use(ctx, all_gather(record.amp), {"precision": precision})
    if ctx.config.model.dropout:
        ctx.note(f"config model.dropout {ctx.config.model.dropout} set to 0 for both fits: the precisions draw "
                 "different dropout masks on a GPU")
    require_reproducible(ctx, f"trainer.precision {precision}")  # else any difference passes as rounding
    fp32 = replace(config, trainer=replace(config.trainer, precision="32-true"))
    full, _ = first_step(ctx, "fp32", ctx.adapter(fp32))
    device = ctx.rank_ctx.device_type
    drew = any(ctx.recordings[label].first_step.rng_drawn for label in ("mixed", "fp32"))
    if device == "cuda" and any(all_gather(drew)):
        pytest.skip("the fit draws random numbers during its first step (its own dropout, random augmentation): on a "
                    "GPU the two precisions draw them differently, so their gradients are not comparable")
    relative, name = relative_difference(mixed, full)
    noise = NOISE.get(device, {}).get(precision)
    figures: dict[str, Any] = {"precision": precision, "max_rel_delta": relative, "largest_measured": noise,
                               "parameter": name, "summary": f"step {rounded(relative)} from fp32"}
    failing = [v for v in all_gather(_verdict(precision, mixed, full, relative)) if v]
    if failing:
        raise ctx.fail(failing[0], **figures)
    if noise is not None and relative > noise:
        ctx.note(f"the {precision} step differs from the fp32 step by {rounded(relative)} of its norm, most at "
                 f"parameter {name}: more than the {rounded(noise)} measured on {device} (ill-conditioned layers, as "
                 "BatchNorm over few samples, or more of the step in low precision than autocast runs)")
    return figures


def relative_difference(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    """(|got - want| / |want| over all parameters as one vector, the parameter whose own is largest)."""
    pairs = [(name, got[name], ref) for name, ref in want.items() if ref is not None and got.get(name) is not None]
    delta = sum(float((g - r).square().sum()) for _, g, r in pairs) ** 0.5
    norm = sum(float(r.square().sum()) for _, _, r in pairs) ** 0.5
    worst = max(pairs, key=lambda p: float((p[1] - p[2]).norm()) / max(float(p[2].norm()), 1e-30), default=None)
    return (delta / norm if norm else (0.0 if delta == 0 else float("inf"))), (worst[0] if worst else "")


def _verdict(precision: str, mixed: dict[str, Any], full: dict[str, Any], relative: float) -> str:
    if mixed.keys() != full.keys() or any(
            (mixed[k] is None) != (full[k] is None) or (full[k] is not None and mixed[k].shape != full[k].shape)
            for k in full):
        return (f"the {precision} fit trains other parameters than the fp32 fit ({len(mixed)} against {len(full)}): "
                "the precision changes the model")
    if relative <= REACHES:
        return (f"trainer.precision {precision} never reaches the model: the first step's gradients are the fp32 "
                f"gradients (max relative difference {rounded(relative)}), so the forward does not run under autocast")
    ratio, residual = scale_ratio(mixed, full)
    if ratio >= SCALED and residual <= RESIDUAL:
        return (f"the {precision} gradients are {rounded(ratio)}x the fp32 gradients: a loss scale is never divided "
                "out before the optimizer step (call scaler.step(optimizer), or scaler.unscale_(optimizer) before "
                "anything reads the gradients; a static loss scale needs its division too)")
    return ""
