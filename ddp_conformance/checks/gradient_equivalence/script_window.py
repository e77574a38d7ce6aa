"""accumulation_equivalence for a trainer known only by its run (a `script:` SPEC): the script's first
accumulation window against the same script at k = 1 on all the window's samples.

A rerun of the script at its own k (gradient_equivalence's `script_step.py`) inherits the setting under test:
a loss never divided by k, or divided twice, is so in the rerun too, and the two agree. So the reference is
the script run again as in a world of one (`script_step._Rerun`: a process group of its own, the DDP run's
first parameters, `torch.nn.functional`'s dropouts off in both runs) with `{accumulate_grad_batches}` at 1 on
its command line, its training loader yielding one batch: every micro-batch of the window, on every rank,
concatenated along the batch dimension. The gradients its one-micro-batch step applies are the single-process
gradient of the window's samples with the script's own model and loss, and are compared with the DDP run's as
fit_step.py compares a fit's (`gradients.fit_diagnosis`): a ratio of k or 1/k, or the last micro-batches'
gradient alone (the same rerun fed only the ranks' last micro-batches), is accumulation_equivalence's verdict.
Only a SPEC that carries `{accumulate_grad_batches}` can be run at k = 1; what else a rerun on the global
batch cannot redo is script_step's skip, with its words. A `zero_grad` inside the window, which a rerun repeats,
is seen in the DDP run itself (`accumulation_watch.HeldWatch`), with or without the placeholder.
"""

from __future__ import annotations

from typing import Any

import pytest

from ...adapter import NotProvided
from ..support.accumulation_watch import HeldWatch, at_k, thrown_away, window_per_step
from ..support.check_context import CheckContext, all_gather, hide_on_verdict, rounded
from ..support.fit_watch import FitPlan
from ..support.gradients import FirstStepShape, Recompute, clipping, fit_diagnosis, is_accumulation_cause, max_delta
from ..support.progress import guarded_fit
from ..support.vacuity import skip_as_vacuous
from .script_step import (
    Unjudged,
    _attempt,
    _first_step_problem,
    _judged_or_none,
    _own_group_of_one,
    _Rerun,
    _size_problem,
    _skip_unless_all,
    _vacuous,
    concatenated,
    without_dropout,
)
from .tolerance import observed_rtol

LABEL = "accumulation_window"
#: how script_step's rerun says the script took another number of micro-batches than it was fed
_OTHER_WINDOW = "in a world of one it takes "


def judge_script_window(ctx: CheckContext, adapter: Any, carried: bool, figures: dict[str, Any]) -> dict[str, Any]:
    """Fail when the script's first accumulation window threw its earlier micro-batches' gradients away
    (`HeldWatch`, seen in the fit), or, where its SPEC carries `{accumulate_grad_batches}` (`carried`), applied k
    or 1/k times the gradient of its samples, or the last micro-batches' alone; skip, naming why, where the
    window cannot be redone at k = 1."""
    __tracebackhide__ = hide_on_verdict
    ctx.require_shared_workdir()
    watch = HeldWatch()
    try:
        with without_dropout():
            guarded_fit(ctx, LABEL, 1, lambda observer: adapter.fit(1, observer=observer), FitPlan(first_step=True,
                        keep_batches=True), watch)
    except NotProvided as exc:
        pytest.skip(str(exc))
    finally:
        watch.close()
    record = ctx.recordings[LABEL]
    first = record.first_step
    window = (window_per_step(first.micro_batches, first.overflowed) or 0) if first is not None else 0
    thrown = thrown_away(window, all_gather(watch.first_thrown(window)))
    if thrown:
        raise ctx.fail(thrown, **figures)
    if not carried:
        pytest.skip(f"the script accumulates {window} micro-batches a step by its own setting, and its SPEC passes "
                    "no {accumulate_grad_batches}: the reference for the window, the script at 1 micro-batch a step, "
                    "cannot be run (put {accumulate_grad_batches} where its command line takes the accumulation); "
                    "the window keeps its earlier micro-batches' gradients (seen in the fit)")
    _, rtol = observed_rtol(ctx, record.amp, "the script's fit")
    _skip_unless_all(_first_step_problem(record))
    first = record.first_step
    assert first is not None and first.grads is not None
    ranks = all_gather(first.batches)
    _skip_unless_all(_size_problem(ranks))
    try:
        window = concatenated([batch for rank in ranks for batch in rank])
        last = concatenated([rank[-1] for rank in ranks])
        own = concatenated(ranks[ctx.rank])
    except Unjudged as exc:
        _skip_unless_all(str(exc))
    rerun = _Rerun(ctx, record, _own_group_of_one(ctx), at_k(ctx.config, 1))
    whole = _attempt(lambda: rerun.gradients([window]))
    _skip_unless_all(_at_one_problem(whole) if isinstance(whole, str) else "")
    assert isinstance(whole, dict)
    fit = dict(zip(whole, first.grads, strict=True))
    name, delta, scale = max_delta(fit, whole)
    figures.update({"rtol": rtol, "window_max_rel_delta": delta / scale if scale else 0.0,
                    "worst_parameter": name})
    vacuous = [v for v in all_gather(_vacuous(fit, whole)) if v]
    if vacuous:
        skip_as_vacuous(vacuous[0])
    where = f"(parameter {name}, max |delta| {rounded(delta)}, tolerance {rounded(rtol * scale)})"
    verdict = "" if delta <= rtol * scale else fit_diagnosis(
        fit, whole, Recompute(lambda: _judged_or_none(lambda: rerun.gradients([own])),
                              lambda: _judged_or_none(lambda: rerun.gradients([last]))),
        FirstStepShape(ctx.world_size, first.micro_batches, rtol), where)
    verdicts = [v for v in all_gather(verdict) if v]
    if verdicts and is_accumulation_cause(verdicts[0]):
        raise ctx.fail(verdicts[0], **figures)
    if verdicts:
        pytest.skip(f"the script's first step differs from its own step at accumulate_grad_batches 1 on the "
                    f"window's samples by a cause outside the accumulation window, gradient_equivalence's to name "
                    f"({verdicts[0][:120]}...), so the accumulated gradient cannot be judged by it")
    if delta > rtol * scale:
        ctx.note(f"the script's first step's gradients are {clipping(fit, whole, rtol)}")
    figures["summary"] = f"{first.micro_batches} micro-batches a step"
    return figures


def _at_one_problem(problem: str) -> str:
    """script_step's reason, or, where the script at accumulate_grad_batches 1 still took several micro-batches,
    that the placeholder does not set its accumulation."""
    if problem.startswith(_OTHER_WINDOW):
        return ("with {accumulate_grad_batches} at 1 on its command line, the script does not step after one "
                f"micro-batch, so the argument that carries it does not set the accumulation ({problem})")
    return problem
