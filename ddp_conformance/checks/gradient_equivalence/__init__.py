"""gradient_equivalence: one DDP step on the ranks' shards of a global batch gives, for every
parameter, the single-process gradient of the whole global batch. (That the ranks' parameters stay
identical step after step is judged on the real fit: rank_participation's fit, and the long fit
resume_fidelity digests after every step.)

How: every rank takes the same global batch (the dataset's first `world_size * per_rank` items),
runs the trainer's own `train_step` on its consecutive shard through the trainer's `wrap`, and
computes locally, without DDP and as in a world of one process (`world_of_one`), the gradient of the
global batch and of its own shard with the trainer's `loss`. `per_rank` is batch_size x
accumulate_grad_batches, so the trainer's accumulation splits the shard into equal micro-batches
(equal sizes are what makes mean-of-means the mean).
Models are in eval mode for this comparison: dropout masks and BatchNorm batch statistics
legitimately differ between a shard and the whole batch, and are not what DDP synchronises.

Tolerances, per parameter: max |ddp - single| <= rtol * max |single|, rtol by the precision the DDP
step was seen to run at (autocast and its dtype at its forward, `amp_watch`; the config's
trainer.precision is a claim, and a note says where the run showed another), from docs/ddp-facts.md and
our own runs (`tolerance.py`): fp32 observed ~1e-7 relative, bound 1e-5; bf16 autocast observed ~2e-3
relative L2, bound 2e-2; fp16 bound 2e-2 on CPU, 5e-2 on CUDA.
Gradients that are all exactly zero on both sides prove nothing ("0 equals 0"): the check skips,
naming rank_participation, whose verdict a fit that never trains is (`vacuity.py`).
A failure names the parameter, its max |delta| and the tolerance, and a cause when the evidence
points to one: a ratio of exactly 1/world_size (a loss divided by the world size on top of DDP's
averaging, when the trainer's loss in the real world is 1/world of the same loss computed in a
world of one, `world_of_one`; else a loss summed where DDP averages), world_size
(gradients summed over ranks), or gradients equal to the rank's own shard (no all-reduce).

A trainer that gives no dataset, model or loss to compute a reference with (a `script:` SPEC) is
judged from its run instead: its first optimizer step against the same script rerun in a world of
one on the global batch its ranks drew (`script_step.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch

from ...adapter import NotProvided
from ...runner.ranks import ranks_label
from ..support.amp_watch import AmpWatch, scaled_clipping
from ..support.check_context import (
    CheckContext,
    all_gather,
    from_rank_zero,
    hide_on_verdict,
    on_every_rank,
    rounded,
    tensors_from_rank_zero,
)
from ..support.gradients import clipping, closeness, grads_of, max_delta, scale_ratio, single_process_adapter
from ..support.model_state import item_digest
from ..support.one_world import world_of_one
from ..support.vacuity import skip_as_vacuous
from .fit_step import judge_fit_step
from .script_step import judge_script_step
from .tolerance import RTOL, observed_rtol

__all__ = ["RTOL", "run"]

@dataclass
class GlobalBatch:
    """The same global batch on every rank, cut into the ranks' consecutive shards."""

    adapter: Any
    items: list[Any]
    world: int
    per_rank: int

    def whole(self) -> Any:
        return self.adapter.collate(self.items[:self.per_rank * self.world])

    def shard(self, rank: int) -> Any:
        start = rank * self.per_rank
        return self.adapter.collate(self.items[start:start + self.per_rank])


def _global_batch(ctx: CheckContext, adapter: Any) -> GlobalBatch:
    """The dataset's first items, enough for one global batch; skips when the ranks' datasets differ (then
    there is no one global batch to compare DDP's gradient with)."""
    # the trainer's own config after its setup: a trainer that sets its own accumulation splits its shard by it,
    # and a shard that does not divide evenly (4 items in 3 micro-batches) averages unequal micro-batches
    config = getattr(adapter, "config", None) or ctx.config
    per_rank = config.data.batch_size * config.trainer.accumulate_grad_batches
    need = per_rank * ctx.world_size
    dataset = adapter.make_dataset(max(need, config.data.size))
    size = _sized(dataset)
    if size is not None and size < need:  # a dataset of its own size (a DataModule's) may hold fewer
        ctx.note(f"the dataset holds {size} items, fewer than the {need} of one global batch: it reads them "
                 "again from the start (any global batch has a single-process gradient)")
    items = [dataset[i % size if size else i] for i in range(need)]
    batches = all_gather(item_digest(items))
    if len(set(batches)) > 1:
        rank = next(r for r, d in enumerate(batches) if d != batches[0])
        pytest.skip(f"the ranks' datasets differ (rank {rank}'s first {need} items are not rank 0's; see "
                    "data_consistency): there is no one global batch whose gradient DDP's could be compared with")
    return GlobalBatch(adapter, items, ctx.world_size, per_rank)


def _sized(dataset: Any) -> int | None:
    """The dataset's length; None without one. Reading past it cannot be left to IndexError: some
    datasets (Lightning's WikiText2 demo) return empty items there instead of raising."""
    try:
        return len(dataset) or None
    except TypeError:
        return None


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    adapter = ctx.adapter()
    try:
        batch = _global_batch(ctx, adapter)
        single = single_process_adapter(ctx) or adapter
        figures = _first_step(ctx, adapter, single, batch)
    except NotProvided as missing:  # no pieces to compute a reference with (a script): judged by its run
        return judge_script_step(ctx, adapter, missing)
    judge_fit_step(ctx, single, figures["rtol"], figures)
    figures["summary"] = f"max rel delta {rounded(figures['max_rel_delta'])}"
    return figures


def _first_step(ctx: CheckContext, adapter: Any, single: Any, batch: GlobalBatch) -> dict[str, Any]:
    """The trainer's DDP step on this rank's shard against the single-process gradient of the
    global batch (and of the shard alone), both computed by `single`, the trainer as set up in a
    world of one, within the tolerance of the precision the step was seen to run at; fails, naming a
    cause, where they differ."""
    world, rank = ctx.world_size, ctx.rank
    with ctx.training(1), AmpWatch(forwards=True) as watch:
        wrapped = adapter.wrap(adapter.make_model().eval())
        adapter.train_step(wrapped, batch.shard(rank))
    precision, rtol = observed_rtol(ctx, watch.record, "the trainer's DDP step")
    single_g, single_loss = _single_process_gradient(ctx, single, batch, alone=single is not adapter)
    ddp_g = grads_of(wrapped)
    name, delta, scale = max_delta(ddp_g, single_g)
    tolerance = rtol * scale
    cause = _scale_cause(adapter, single, batch, single_loss) if delta > tolerance else ""
    figures: dict[str, Any] = {"precision": precision, "rtol": rtol,
                               "per_rank_batch": batch.per_rank, "worst_parameter": name, "max_abs_delta": delta,
                               "tolerance": tolerance, "max_rel_delta": delta / scale if scale else 0.0}
    missing = [n for n, g in ddp_g.items() if g is None and single_g.get(n) is not None]
    accumulate = ctx.config.trainer.accumulate_grad_batches
    left_out: list[int] = []
    own_g: dict[str, Any] = {}  # the gradient of this rank's shard alone: a cause, asked only of gradients that differ
    if not all(all_gather(delta <= tolerance)):
        own_g = _own_shard_backward(ctx, single, batch)
        left_out = [r for r, out in enumerate(all_gather(_left_out(ddp_g, single_g, own_g, rtol, world))) if out]
    vacuous = [v for v in all_gather(_vacuous(ddp_g, single_g, single_loss)) if v]
    if vacuous:
        skip_as_vacuous(vacuous[0])
    verdicts = all_gather(_verdict(StepGradients(ddp_g, single_g, own_g, missing), Worst(name, delta, tolerance),
                                   Setting(rtol, world, accumulate), cause, left_out))
    failing = [v for v in verdicts if v]
    scaled = scaled_clipping(all_gather(watch.record)) if failing else ""
    if scaled:  # the step is ~1/scale of the reference for a reason of the scaler's, alike in any world
        ctx.note(f"the DDP step's gradients differ from the single-process gradients because {scaled}")
    elif failing:  # every rank raises the first failing rank's verdict, so the ranks' reports merge
        raise ctx.fail(failing[0], **figures)
    if delta > tolerance and not scaled:
        ctx.note(f"the DDP step's gradients are {clipping(ddp_g, single_g, rtol)}")
    return figures


def _single_process_gradient(ctx: CheckContext, single: Any, batch: GlobalBatch,
                             alone: bool) -> tuple[dict[str, Any], float]:
    """The single-process run's gradient of the whole batch's loss (by name) and that loss. `alone` (`single`
    is an adapter of its own, set up in a world of one): rank 0 computes it and hands it to every rank, since
    each rank's would be the same computation on the same items (`_global_batch`), and ranks sharing cores
    paid it world-size times. Where some rank cannot give a loss there (NotProvided), every rank raises it,
    with that rank's words, and `run` judges the fit's first step instead on all of them alike: the ranks
    that could would otherwise go on to collectives the others never join."""

    def backward() -> tuple[dict[str, Any], float] | None:
        if alone and ctx.rank != 0:
            return None
        with world_of_one():  # the single-process run: whatever the trainer reads of the world says 1 rank
            reference = single.make_model().eval()
            single_loss = single.loss(reference, batch.whole())
            single_loss.backward()
        return grads_of(reference), float(single_loss.detach())

    mine = on_every_rank(backward)
    if not alone:
        assert mine is not None
        return mine
    grads, loss = mine if mine is not None else (None, None)
    return tensors_from_rank_zero(grads), from_rank_zero(loss)


def _own_shard_backward(ctx: CheckContext, single: Any, batch: GlobalBatch) -> dict[str, Any]:
    """The single-process gradient of this rank's shard alone (collective, as `_single_process_gradient`)."""

    def backward() -> dict[str, Any]:
        with world_of_one():
            own = single.make_model().eval()
            single.loss(own, batch.shard(ctx.rank)).backward()
        return grads_of(own)

    return on_every_rank(backward)


def _scale_cause(adapter: Any, single: Any, batch: GlobalBatch, single_loss: float) -> str:
    """What would make gradients 1/world of the single-process ones, from the losses alone: "divided"
    when the trainer's loss in the real world is the world-of-one loss / world size, "summed" when the
    whole batch's loss is the sum of the shards' losses, "mean" when it is their mean (then the loss
    is not to blame: something after backward divides the gradients), "" when none fits."""

    close = 1e-4 * abs(single_loss)
    with torch.no_grad():
        if batch.world > 1 and abs(float(adapter.loss(adapter.make_model().eval(), batch.whole())) * batch.world
                                   - single_loss) <= close != 0:
            return "divided"
        with world_of_one():
            model = single.make_model().eval()
            shards = [float(single.loss(model, batch.shard(r))) for r in range(batch.world)]
    if abs(sum(shards) - single_loss) <= close:
        return "summed"
    if abs(sum(shards) / len(shards) - single_loss) <= close:
        return "mean"
    return ""


def _vacuous(ddp_g: dict[str, Any], single_g: dict[str, Any], single_loss: float) -> str:
    """A diagnosis when neither the DDP step nor the single-process loss gives any nonzero gradient:
    "0 equals 0" is no evidence of equivalence, and such a trainer never changes its model."""
    if any(g is not None and bool(g.any()) for g in (*ddp_g.values(), *single_g.values())):
        return ""
    return (f"training does not change the model: every gradient is exactly zero, from the DDP step and from the "
            f"single-process loss of the global batch (which is {rounded(single_loss)}): a loss that does not depend "
            "on the parameters (e.g. cross_entropy over a one-column output, identically 0)")


def _left_out(ddp_g: dict[str, Any], single_g: dict[str, Any], own_g: dict[str, Any], rtol: float,
              world: int) -> bool:
    """Whether DDP's gradient is the single-process one without this rank's shard, `single - own /
    world` (equal shards and a mean loss make `single` the mean of the ranks' own): this rank's
    samples count for nothing, while it still steps in sync."""
    if world < 2:
        return False
    without = {n: single_g[n] - own_g[n] / world for n, g in single_g.items()
               if g is not None and own_g.get(n) is not None}
    _, delta, scale = max_delta(ddp_g, without)
    return scale > 0 and delta <= closeness(rtol) * scale


@dataclass(frozen=True)
class StepGradients:
    """This rank's gradients of one step by name: DDP's, the single-process gradient of the global batch, the
    gradient of this rank's shard alone ({} where not asked), and the parameters DDP gave none."""

    ddp: dict[str, Any]
    single: dict[str, Any]
    own: dict[str, Any]
    missing: list[str]


class Worst(NamedTuple):
    """The parameter whose DDP gradient is farthest from the single-process one, and the tolerance it had."""

    name: str
    delta: float
    tolerance: float


class Setting(NamedTuple):
    """What the gradients are judged under: the relative tolerance, the world size, the config's accumulation."""

    rtol: float
    world: int
    accumulate: int = 1


def _verdict(grads: StepGradients, worst: Worst, setting: Setting, cause: str = "",
             left_out: list[int] | None = None) -> str:
    """This rank's diagnosis, or "" when the gradients match; `cause`: what the losses say about a
    gradient of 1/world (`_scale_cause`); `left_out`: the ranks whose shard DDP's gradient lacks."""
    ddp_g, single_g, own_g, missing = grads.ddp, grads.single, grads.own, grads.missing
    name, delta, tolerance = worst
    rtol, world, accumulate = setting
    if missing:
        return (f"parameter {missing[0]} gets no gradient from the DDP step but does from the single-process "
                f"loss ({len(missing)} parameter(s) in all): the trainer's step does not backpropagate into them")
    if delta <= tolerance:
        return ""
    where = f"(parameter {name}, max |delta| {rounded(delta)}, tolerance {rounded(tolerance)})"
    ratio, residual = scale_ratio(ddp_g, single_g)
    close = closeness(rtol)
    if world > 1 and abs(ratio * world - 1) < close and residual < close:
        if cause == "divided":
            return (f"gradients are exactly 1/{world} of the single-process gradients: the loss is divided by the "
                    f"world size (dist.get_world_size(), Lightning's trainer.world_size, or devices x num_nodes "
                    f"from the config) on top of DDP's own averaging {where}")
        if cause == "mean":
            return (f"gradients are exactly 1/{world} of the single-process gradients although the loss is a mean: "
                    f"the gradients are divided by the world size after backward, on top of DDP's own averaging "
                    f"(a leftover of hand-written all-reduce averaging?) {where}")
        return (f"gradients are exactly 1/{world} of the single-process gradients: the loss is summed where DDP "
                f"averages (use a mean reduction) {where}")
    if accumulate > 1 and abs(ratio * world * accumulate - 1) < close and residual < close:
        return (f"gradients are exactly 1/{world * accumulate} (1/world size x 1/accumulation) of the single-process "
                f"gradients: the loss is summed where DDP averages (use a mean reduction) {where}")
    if world > 1 and abs(ratio / world - 1) < close and residual < close:
        return (f"gradients are exactly {world}x the single-process gradients: they are summed over ranks, not "
                f"averaged {where}")
    _, own_delta, own_scale = max_delta(ddp_g, own_g)
    if world > 1 and own_delta <= rtol * own_scale:
        return (f"each rank's gradients equal the gradients of its own shard: no all-reduce happened (the model is "
                f"not wrapped in DDP, its forward bypasses DDP as model.module(x), or its gradients are never "
                f"synchronised) {where}")
    if left_out:
        return (f"gradients are the single-process gradients of the global batch without {ranks_label(left_out)}'s "
                f"shard: those samples count for nothing (a loss zeroed or masked on that rank) {where}")
    if clipping(ddp_g, single_g, rtol):
        return ""  # clipping by norm or value acts on the averaged gradient alike on every rank: noted
    if abs(ratio - 1) >= close and residual < close:
        return f"gradients are {rounded(ratio)}x the single-process gradients {where}"
    return f"gradients differ from the single-process gradients of the global batch {where}"
