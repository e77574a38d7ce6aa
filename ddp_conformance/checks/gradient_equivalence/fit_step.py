"""gradient_equivalence's second look: the trainer's own fit, at its first optimizer step.

`train_step` is the adapter's restatement of one step; the loop `fit` runs may scale, accumulate or
zero gradients differently (a loss divided by the world size in the loop, `zero_grad` on every
micro-batch of an accumulation window, a loss never divided by the accumulation). So the
dropout-free fit other checks share (`shared_fit.steady`) runs under the recorder
(`fit_record.FirstStep`), which keeps the parameters before its first micro-batch, the gradients its
first optimizer step applied, and the dataset indices each rank's loader drew.
Every rank then recomputes in one process (`world_of_one`, the trainer as set up in a world of one)
the gradient of all the samples the ranks drew for that step, from those parameters, with the
trainer's `loss`, and compares per parameter with the same tolerance as the first look.

Where one process cannot recompute that step exactly, the step is noted as not judged rather than
guessed at: the fit drew random numbers during the step (dropout, random augmentation), BatchNorm in
training mode (each rank normalises by its own micro-batch), no dataset indices (batches of keys),
micro-batches of unequal sizes, a model whose parameters do not match `make_model`'s. Dropout from the
run config is set to 0 for this fit. A uniform scale below 1 that is no known bug's ratio is gradient
clipping by norm, and the gradients clamped to one bound are clipping by value (`gradients.clipping`),
both legitimately applied to the averaged gradient: noted, not failed. A cause inside the
accumulation window (a loss divided by the accumulation twice or never, micro-batches thrown away by
`zero_grad`) is accumulation_equivalence's verdict, which reads the same comparison
(`first_step_compared`): noted here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...adapter import NotProvided
from ..support import shared_fit
from ..support.amp_watch import scaled_clipping
from ..support.check_context import CheckContext, all_gather, hide_on_verdict, on_every_rank, rounded
from ..support.first_steps import overflow_reason
from ..support.fit_record import FitRecord
from ..support.gradients import (
    FirstStepShape,
    Recompute,
    clipping,
    fit_diagnosis,
    is_accumulation_cause,
    max_delta,
    single_process_adapter,
)
from ..support.model_state import item_digest
from ..support.observe import trains_batchnorm
from ..support.one_world import world_of_one


def judge_fit_step(ctx: CheckContext, single: Any, rtol: float, figures: dict[str, Any]) -> None:
    """Fail when the gradients the fit's first optimizer step applied are not the single-process
    gradient of the samples its ranks drew; `single` is the first look's world-of-one adapter. A cause
    inside the accumulation window is accumulation_equivalence's verdict: noted here."""
    __tracebackhide__ = hide_on_verdict
    compared = first_step_compared(ctx, single, rtol)
    if isinstance(compared, str):
        figures["fit_step"] = "not judged"
        ctx.note(compared)
        return
    figures.update(compared.figures)
    verdicts = [v for v in all_gather(compared.verdict) if v]
    scaled = scaled_clipping(all_gather(ctx.recordings["steady"].amp)) if verdicts else ""
    if scaled:
        ctx.note(f"the fit's first optimizer step differs from the single-process gradient because {scaled}")
    elif verdicts and is_accumulation_cause(verdicts[0]):
        ctx.note(f"the fit's first optimizer step is accumulation_equivalence's to judge: {verdicts[0]}")
    elif verdicts:
        raise ctx.fail(verdicts[0], **figures)
    elif compared.clipped:
        ctx.note(f"the fit's first step's gradients are {compared.clipped}")


@dataclass
class FirstStepCompared:
    """The fit's first optimizer step against the single-process gradient of the samples its ranks drew."""

    verdict: str  # this rank's diagnosis (`gradients.fit_diagnosis`), "" when within the tolerance or clipped
    clipped: str  # clipping by norm or value, in words, when that is what the difference is
    micro_batches: int  # in that step, on this rank
    figures: dict[str, Any]


def first_step_compared(ctx: CheckContext, single: Any, rtol: float,
                        reference: Callable[[CheckContext, Any], Any] | None = None) -> FirstStepCompared | str:
    """The comparison of the dropout-free fit's first optimizer step (`shared_fit.steady`), or why it
    cannot be made (collective: every rank returns the same kind). `reference(ctx, config)`: how `single` is
    built again for the dropout-free config (accumulation_equivalence's holds it at k = 1)."""
    __tracebackhide__ = hide_on_verdict
    if not ctx.shared:
        return "the fit's first step is not judged: the ranks share no directory to watch a fit through"
    config = shared_fit.steady_config(ctx)
    adapter = ctx.adapter(config)
    if config is not ctx.config:  # the reference without dropout too (else the dropout-free adapter)
        single = reference(ctx, config) if reference is not None else single_process_adapter(ctx, config) or adapter
    try:
        record = shared_fit.steady(ctx).record
    except NotProvided as exc:  # the first look stands on its own
        return f"the fit's first optimizer step is not judged: {exc}"
    problems = [p for p in all_gather(_unjudgeable(record)) if p]
    if problems:
        return f"the fit's first optimizer step is not recomputed: {problems[0]}"
    first = record.first_step
    assert first is not None and first.grads is not None
    dataset = adapter.make_dataset()
    sampled = _as_in(dataset, record.training_passes()[0])
    drawn = all_gather(sampled[:first.micro_batches])
    if len({len(batch) for batches in drawn for batch in batches}) > 1:
        return ("the fit's first optimizer step is not recomputed: its micro-batches differ in size, so their mean "
                "is not the mean over their samples")
    if any(all_gather(_fed_other_items(adapter, dataset, first, sampled))):
        return ("the fit's first optimizer step is not recomputed: make_dataset() does not hold the items the fit's "
                "loader yielded at the indices it drew (data built anew per call, as random tensors drawn without "
                "a seed; see data_consistency)")
    return _compare(ctx, (adapter, single), record, Drawn(drawn, dataset), rtol)


def _fed_other_items(adapter: Any, dataset: Any, first: Any, sampled: list[list[int]]) -> bool:
    """Whether a batch the fit's loader yielded for the first step (`FirstStep.batches`, the n-th of its
    pass: a loop that fetches ahead, as Lightning's, keeps the next one) is not `dataset`'s items at the
    indices the n-th batch drew, collated: then a recompute from `dataset` computes another step."""
    return any(item_digest(adapter.collate([dataset[i] for i in sampled[count - 1]])) != item_digest(kept)
               for kept, (_, count) in zip(first.batches, first.sources, strict=False)
               if kept is not None and 0 < count <= len(sampled))


def _as_in(dataset: Any, first: Any) -> list[list[int]]:
    """The fit's first batches as indices of `dataset` (`make_dataset()`'s): the Subset's own where
    it is as long as the Subset the loader read (a random_split the adapter returns as it is), else
    the underlying dataset's (a rank's own Subset shard of the dataset the adapter returns)."""
    if first.index_map is None or len(dataset) == first.dataset_size:
        return first.batches
    return first.base_batches()


def _unjudgeable(record: FitRecord) -> str:
    """Why this rank's first step cannot be recomputed in one process, or ""."""
    first = record.first_step
    if first is None or first.grads is None:
        return "no optimizer step of the fit was seen"
    if first.overflowed:
        return overflow_reason(first.overflowed)
    if first.rng_drawn:
        return "the fit drew random numbers during it (dropout, random augmentation), which one process cannot redraw"
    if trains_batchnorm(record.model):
        return "the model has BatchNorm in training mode, which normalises each micro-batch by its own statistics"
    passes = record.training_passes()
    if not passes or not passes[0].indexed or len(passes[0].batches) < first.micro_batches:
        return "its loader draws no dataset indices through a BatchSampler"
    return ""


class Drawn(NamedTuple):
    """What the fit's first step drew: every rank's micro-batches as dataset indices, and the dataset they index."""

    batches: list[list[list[int]]]
    dataset: Any


def _compare(ctx: CheckContext, trainers: tuple[Any, Any], record: FitRecord, drawn_from: Drawn,
             rtol: float) -> FirstStepCompared | str:
    """The fit's first step against the single-process gradient of what it drew, recomputed by the second of
    `trainers` (the trainer's adapter, the single-process reference)."""
    adapter, single = trainers
    drawn, dataset = drawn_from
    first = record.first_step
    assert first is not None and first.grads is not None

    def items_of(batches: list[list[list[int]]]) -> list[Any]:
        return [dataset[i] for rank in batches for batch in rank for i in batch]

    def gradient(batches: list[list[list[int]]]) -> dict[str, Any] | None:
        return _recomputed(single, adapter.collate, first.params, items_of(batches))

    # every rank recomputes from its own make_dataset(): one that builds other data per rank or per call (random
    # tensors drawn without a seed, as Lightning's BoringModel's RandomDataset) gives each rank another "whole"
    held = all_gather(item_digest(items_of(drawn)))
    if len(set(held)) > 1:
        rank = next(r for r, d in enumerate(held) if d != held[0])
        return ("the fit's first optimizer step is not recomputed: the ranks' datasets differ (rank "
                f"{rank}'s make_dataset() holds other items than rank 0's at the indices the fit drew; see "
                "data_consistency)")
    try:  # a rank whose reference cannot be computed: every rank says so, or the others wait for it below
        whole = on_every_rank(lambda: gradient(drawn))
    except NotProvided as exc:
        return f"the fit's first optimizer step is not recomputed: {exc}"
    if any(all_gather(whole is None)):
        return ("the fit's first optimizer step is not recomputed: the fit's model has other parameters than "
                "make_model()'s")
    assert whole is not None
    fit = dict(zip(whole, first.grads, strict=True))
    name, delta, scale = max_delta(fit, whole)
    figures = {"fit_step": "judged", "fit_step_micro_batches": first.micro_batches,
               "fit_step_max_rel_delta": delta / scale if scale else 0.0}
    where = f"(parameter {name}, max |delta| {rounded(delta)}, tolerance {rounded(rtol * scale)})"
    verdict = "" if delta <= rtol * scale else fit_diagnosis(
        fit, whole, Recompute(lambda: gradient([drawn[ctx.rank]]), lambda: gradient([[rank[-1]] for rank in drawn])),
        FirstStepShape(ctx.world_size, first.micro_batches, rtol), where)
    clipped = clipping(fit, whole, rtol) if delta > rtol * scale and not verdict else ""
    return FirstStepCompared(verdict, clipped, first.micro_batches, figures)


def _recomputed(single: Any, collate: Any, params: list[Any], items: list[Any]) -> dict[str, Any] | None:
    """The single-process gradient of `items` from `params`, by name; None if the shapes differ."""

    with world_of_one():
        model = single.make_model().train()
        mine = list(model.parameters())
        if [tuple(p.shape) for p in mine] != [tuple(p.shape) for p in params]:
            return None
        with torch.no_grad():
            for target, value in zip(mine, params, strict=True):
                target.copy_(value)
        single.loss(model, collate(items)).backward()
    return {name: p.grad.detach().double().cpu() if p.grad is not None else None
            for name, p in model.named_parameters()}
