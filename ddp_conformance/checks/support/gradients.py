"""Gradients compared the way gradient_equivalence compares them: per parameter, on the CPU (float32 or
wider; sums over a whole model in float64), relative to the single-process gradient's largest value,
with the least-squares scale between two sets (a bug that scales every gradient alike reads as one
number: 1/world, world...), and the single-process side computed as in a world of one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from .check_context import CheckContext, rounded
from .observe import unwrapped
from .one_world import world_of_one


def grads_of(model: Any) -> dict[str, Any]:
    """The model's gradients by name, CPU copies in float32 or wider (half types widened). A difference or a
    largest value of two float32 tensors rounds to 6e-8 of itself, far inside any tolerance here; sums over
    whole models (`scale_ratio`) are taken in float64, not whole copies (a float64 copy of a large model is slow:
    benchmarks/RESULTS.md)."""
    return {name: (_widened(p.grad.detach().to("cpu", copy=True)) if p.grad is not None else None)
            for name, p in unwrapped(model).named_parameters() if p.requires_grad}


def _widened(tensor: Any) -> Any:
    return tensor.float() if tensor.is_floating_point() and tensor.element_size() < 4 else tensor


# A gradient summed over samples rounds relative to its summands, which can cancel: a 2-class head's
# bias gradient measured 3.9e-4 while the same step's largest gradient was ~0.15, and two correct fp32
# computations of it (DDP's average of the ranks' shards, one process on the whole batch) differed by
# 7.5e-9, twice rtol x its own max (fixtures/mutants/script_rank_shards_in_place_grads.py). So a
# parameter's scale is at least this fraction of the largest gradient of the step; a parameter whose
# gradients are all wrong by O(1) of themselves is still caught unless they are ~1e-7 of that largest.
SCALE_FLOOR = 1e-2


def max_delta(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, float, float]:
    """(parameter, max |a - b|, its scale) of the parameter whose delta is largest relative to its
    scale: max |b| of that parameter, at least SCALE_FLOOR x the largest |b| of any parameter."""
    worst = ("", 0.0, 0.0)
    worst_rel = -1.0
    largest = {name: _largest(ref) for name, ref in b.items() if ref is not None and ref.numel()}
    floor = SCALE_FLOOR * max(largest.values(), default=0.0)
    for name, ref in b.items():
        got = a.get(name)
        if got is None or ref is None:
            continue
        delta = _largest(got - ref) if ref.numel() else 0.0
        scale = max(largest[name], floor) if ref.numel() else 0.0
        rel = delta / scale if scale > 0 else (0.0 if delta == 0 else float("inf"))
        if rel > worst_rel:
            worst, worst_rel = (name, delta, scale), rel
    return worst


def _largest(tensor: Any) -> float:
    """max |tensor|, from its extremes: no |tensor| copy (58 MB of float64 gradients a model, in the demo)."""
    low, high = (float(v) for v in torch.aminmax(tensor))
    return float("nan") if math.isnan(low) or math.isnan(high) else max(high, -low)


def scale_ratio(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Least-squares scale r with a ~ r*b over all parameters, and the relative residual (in float64)."""
    pairs = [(a[n].double() if a.get(n) is not None else None, g.double()) for n, g in b.items() if g is not None]
    dot = sum(float((x * g).sum()) for x, g in pairs if x is not None)
    bb = sum(float((g * g).sum()) for _, g in pairs)
    if bb == 0:
        return float("nan"), float("inf")
    r = dot / bb
    res = sum(float(((x - r * g) ** 2).sum()) for x, g in pairs if x is not None)
    aa = sum(float((a[n].double() * a[n].double()).sum()) for n in b if a.get(n) is not None)
    return r, (res / aa) ** 0.5 if aa > 0 else float("inf")


def closeness(rtol: float) -> float:
    """How near a measured ratio must come to a bug's exact ratio (1/W, W, 1/A...) to be that bug:
    ten times the precision's gradient tolerance, and never below float64 noise."""
    return 10 * rtol + 1e-6


def clipping(a: dict[str, Any], b: dict[str, Any], rtol: float) -> str:
    """How gradients `a` are the reference gradients `b` clipped, or "" when they are not. Clipping
    acts on the averaged gradient, the same on every rank, so a trainer that clips is correct."""
    return _clipped_by_norm(a, b, rtol) or _clipped_by_value(a, b, rtol)


def _clipped_by_norm(a: dict[str, Any], b: dict[str, Any], rtol: float) -> str:
    """A uniform scale strictly between 0 and 1 (no bug's ratio: those are checked first)."""
    close = closeness(rtol)
    ratio, residual = scale_ratio(a, b)
    if residual < close and close < ratio < 1 - close:
        return f"{rounded(ratio)}x the single-process gradients, uniformly: gradient clipping by norm (not judged)"
    return ""


def _clipped_by_value(a: dict[str, Any], b: dict[str, Any], rtol: float) -> str:
    """`b` clamped to +-c, c the largest |a| (well above the tolerance), some element beyond it, and
    every parameter within its own tolerance of its clamped reference: the unclamped elements are
    judged as any gradient is."""

    pairs = [(a[n], g) for n, g in b.items() if g is not None and a.get(n) is not None and g.numel()]
    if not pairs:
        return ""
    bound = max(float(x.abs().max()) for x, _ in pairs)
    if bound <= rtol * max(float(g.abs().max()) for _, g in pairs):
        return ""  # all zero, or nearly: no clipping leaves nothing
    clipped = sum(int((g.abs() > bound * (1 + closeness(rtol))).sum()) for _, g in pairs)
    off = any(float((x - torch.clamp(g, -bound, bound)).abs().max()) > rtol * float(g.abs().max()) for x, g in pairs)
    if not clipped or off:
        return ""
    total = sum(g.numel() for _, g in pairs)
    return (f"the single-process gradients clamped to +-{rounded(bound)}: gradient clipping by value (the {clipped} of "
            f"{total} elements beyond it are not judged, the others match)")


def single_process_adapter(ctx: CheckContext, config: Any = None) -> Any:
    """A fresh adapter set up as rank 0 of a world of one, inside `world_of_one`, with the config's
    `devices` and `num_nodes` at 1: a trainer that reads the world size once, at setup (`self.world =
    dist.get_world_size()`, `ctx.world_size`), or from its config (`devices * num_nodes`), reads 1
    there, as it would in a real single-process run. None (with a note) if its setup cannot do that."""
    one = replace(ctx.rank_ctx, rank=0, local_rank=0, world_size=1, num_nodes=1)
    config = config or ctx.config  # as the harness reconciles it for one process: devices 1, num_nodes 1
    config = replace(config, trainer=replace(config.trainer, devices=1, num_nodes=1))
    try:
        with world_of_one():
            return ctx.adapter(config, one)
    except Exception as exc:  # its setup needs the real world: the real adapter stands in
        ctx.note(f"the single-process reference uses the trainer as set up for world size {ctx.world_size}: "
                 f"its setup as rank 0 of 1 raised {type(exc).__name__}: {exc}")
        return None


#: how `fit_diagnosis` begins each cause that lies in the accumulation window, not in DDP's averaging: those
#: are accumulation_equivalence's verdicts, and gradient_equivalence only notes them
ACCUMULATION_CAUSES = ("the loop divides each micro-batch's loss by the accumulation twice",
                       "the loop adds up its ", "only the last micro-batch of each ")


def is_accumulation_cause(verdict: str) -> bool:
    return verdict.startswith(ACCUMULATION_CAUSES)


class Recompute(NamedTuple):
    """Other single-process gradients of a fit's first step, each computed only when a diagnosis needs it: of
    this rank's samples alone (`own`), and of each rank's last micro-batch alone (`last`)."""

    own: Callable[[], Any]
    last: Callable[[], Any]


class FirstStepShape(NamedTuple):
    """What a fit's first step is judged under: the world size, its micro-batches, the relative tolerance."""

    world: int
    micro: int
    rtol: float


def fit_diagnosis(fit: dict[str, Any], whole: dict[str, Any], recompute: Recompute, shape: FirstStepShape,
                  where: str) -> str:
    """Why the gradients a fit's first optimizer step applied differ from `whole`, the single-process
    gradient of the samples its ranks drew for it, or "" for clipping (gradient_equivalence's
    fit_step.py, script_step.py); `where`: the worst parameter, its |delta| and the tolerance, as the verdict
    names them."""
    own, last = recompute
    world, micro, rtol = shape
    drew = f"the single-process gradient of the samples its ranks drew for it ({micro} micro-batch(es) per rank)"

    def applies(how: str) -> str:  # the evidence, after the cause: a failure's first line names the cause
        return f"the fit's first optimizer step applies {how} {drew} {where}"

    missing = [n for n, g in fit.items() if g is None and whole.get(n) is not None]
    if missing:
        return f"parameter {missing[0]} gets no gradient in the fit: {applies('none to it, where it has one in')}"
    ratio, residual = scale_ratio(fit, whole)
    close = closeness(rtol)
    uniform = residual < close
    if uniform and world > 1 and abs(ratio * world - 1) < close:
        return (f"the fit's loop divides the loss or the gradients by the world size on top of DDP's own averaging: "
                f"{applies(f'exactly 1/{world} of')}")
    if uniform and world > 1 and abs(ratio / world - 1) < close:
        return f"the fit's loop sums gradients over ranks: {applies(f'exactly {world}x')}"
    if uniform and micro > 1 and abs(ratio * micro - 1) < close:
        return (f"the loop divides each micro-batch's loss by the accumulation twice: "
                f"{applies(f'exactly 1/{micro} of')}")
    if uniform and micro > 1 and abs(ratio / micro - 1) < close:
        return (f"the loop adds up its {micro} accumulated micro-batch losses without dividing by the accumulation: "
                f"{applies(f'exactly {micro}x')}")
    if clipping(fit, whole, rtol):
        return ""  # clipping by norm or value acts on the averaged gradient: the caller notes it
    if micro > 1 and proportional(fit, last(), close):
        return (f"only the last micro-batch of each {micro}-batch accumulation window counts, the earlier ones are "
                "thrown away (zero_grad inside the accumulation window?): "
                + applies("the last micro-batch's gradient alone, not"))
    if world > 1 and proportional(fit, own(), close, exact=True):
        return ("each rank applies the gradient of its own samples, no all-reduce in the fit (the model it trains "
                "is not the DDP-wrapped one?): " + applies("each rank its own samples' gradient, not"))
    return f"the trainer's own fit applies other gradients at its first optimizer step than {drew} {where}"


def proportional(a: dict[str, Any], b: dict[str, Any] | None, close: float, exact: bool = False) -> bool:
    if b is None:
        return False
    ratio, residual = scale_ratio(a, b)
    return residual < close and (not exact or abs(ratio - 1) < close)
