"""gradient_equivalence for a trainer known only by its run (a `script:` SPEC): no dataset, model or
loss to compute a reference with, so the reference is the same script, run again as in a world of one.

The script's one-step fit runs under the recorder (`observe.FitRecorder`), which keeps, on every
rank, the parameters before its first micro-batch, the gradients its first optimizer step applied,
and the batches its DataLoader yielded for that step's micro-batches (CPU copies). Every rank then
runs the same script again (`adapter.fit(1)`) inside `world_of_one`, with
- its DDP given a process group of this rank alone (singleton groups, made once by all ranks), so
  that DDP averages over one process and no rank's run mixes with another's;
- no comm hook (`one_world.without_comm_hooks`): the reference for a run with a hook runs DDP's own
  all-reduce, so it neither inherits the hook under judgement nor needs the hook to work in a world of
  one; a world-size factor is then named as the hook's where the DDP run had one (`in_the_hook`), and a
  hook that all-reduces in float16 or bfloat16 is judged at that precision's tolerance;
- the parameters the DDP run started from, set at its first training forward;
- (in both runs) `torch.nn.functional`'s dropouts as the identity, as fit_step sets the config's
  dropout to 0: masks drawn for one shape cannot be redrawn for another;
- its training loader's yields replaced by the global batch: micro-batch j is the ranks' j-th
  micro-batches concatenated along the batch dimension.
The gradients its first optimizer step applies are the single-process gradient of the global batch
with the script's own model, loss and loop, and are compared with the DDP run's as fit_step.py
compares a fit's (same tolerance, `gradients.fit_diagnosis`); `own` there is the same rerun fed only
this rank's micro-batches, run only when a diagnosis needs it.

What a world-of-one run of the same script cannot redo is a skip naming what the script lacks: no
DataLoader (nanoGPT's `get_batch` draws with `torch.randint`: no batches to substitute), a loader read
ahead of its forwards, random numbers drawn during the step (random augmentation, attention dropout),
BatchNorm in training mode, micro-batches of unequal size or that cannot be concatenated, a script
that takes another number of micro-batches per step in a world of one (an accumulation divided by
the world size, as nanoGPT's). A bug the script makes alike in any world (a `zero_grad` inside the
accumulation window) is the same in both runs and is not this comparison's to see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ...adapter import NotProvided
from ..support import session_evidence
from ..support.check_context import CheckContext, all_gather, hide_on_verdict, rounded
from ..support.first_steps import overflow_reason
from ..support.fit_record import FitRecord
from ..support.fit_watch import FitPlan
from ..support.gradients import FirstStepShape, Recompute, clipping, fit_diagnosis, max_delta
from ..support.loader_watch import children, rebuilt
from ..support.observe import FitRecorder, ddp_argument_forced, trains_batchnorm, unwrapped
from ..support.one_world import without_comm_hooks, world_of_one
from ..support.progress import guarded_fit
from ..support.vacuity import skip_as_vacuous
from .tolerance import RTOL, observed_rtol

LABEL = "script_step"
DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
_GROUPS: dict[str, Any] = {}  # the singleton process groups, made once per default group


class Unjudged(Exception):
    """Why the script's first step cannot be redone in a world of one: the skip's reason."""


def judge_script_step(ctx: CheckContext, adapter: Any, missing: NotProvided) -> dict[str, Any]:
    """Fail when the script's first optimizer step under DDP applied other gradients than the same
    script in a world of one on the global batch its ranks drew, beyond the tolerance of the precision
    its fit was seen to run at (the script's own autocast, not the harness's config); skip, naming why,
    where that rerun cannot be made; `missing` is why the adapter gives no pieces (the skip if it has no fit)."""
    __tracebackhide__ = hide_on_verdict
    ctx.require_shared_workdir()
    try:
        with without_dropout():
            guarded_fit(ctx, LABEL, 1, lambda observer: adapter.fit(1, observer=observer), FitPlan(first_step=True,
                        keep_batches=True))
    except NotProvided:
        pytest.skip(str(missing))
    record = ctx.recordings[LABEL]
    precision, rtol = observed_rtol(ctx, record.amp, "the script's fit")
    rtol = _compressed_rtol(ctx, record, rtol)
    _skip_unless_all(_first_step_problem(record))
    first = record.first_step
    assert first is not None and first.grads is not None
    ranks = all_gather(first.batches)
    _skip_unless_all(_size_problem(ranks))
    try:
        whole_batch = [concatenated([rank[j] for rank in ranks]) for j in range(first.micro_batches)]
    except Unjudged as exc:
        _skip_unless_all(str(exc))
    group = _own_group_of_one(ctx)
    rerun = _Rerun(ctx, record, group)
    whole = _attempt(lambda: rerun.gradients(whole_batch))
    _skip_unless_all(whole if isinstance(whole, str) else "")
    assert isinstance(whole, dict)
    fit = dict(zip(whole, first.grads, strict=True))
    name, delta, scale = max_delta(fit, whole)
    figures: dict[str, Any] = {"precision": precision, "rtol": rtol, "fit_step": "judged",
                               "fit_step_micro_batches": first.micro_batches, "worst_parameter": name,
                               "max_abs_delta": delta, "tolerance": rtol * scale,
                               "max_rel_delta": delta / scale if scale else 0.0,
                               "per_rank_batch": _samples(first.batches[0])}
    where = f"(parameter {name}, max |delta| {rounded(delta)}, tolerance {rounded(rtol * scale)})"
    vacuous = [v for v in all_gather(_vacuous(fit, whole)) if v]
    if vacuous:
        skip_as_vacuous(vacuous[0])
    verdict = ("" if delta <= rtol * scale else fit_diagnosis(
        fit, whole, Recompute(lambda: _judged_or_none(lambda: rerun.gradients(ranks[ctx.rank])), lambda: None),
        FirstStepShape(ctx.world_size, first.micro_batches, rtol), where))
    failing = [v for v in all_gather(in_the_hook(verdict, record)) if v]
    if failing:
        raise ctx.fail(failing[0], **figures)
    if delta > rtol * scale:  # no bug's signature: clipping by norm or by value
        ctx.note(f"the script's first step's gradients are {clipping(fit, whole, rtol)}")
    figures["summary"] = f"max rel delta {rounded(figures['max_rel_delta'])}"
    return figures


#: fit_diagnosis's causes of a world-size factor, and what they are where the fit's DDP runs a comm hook of its own
_HOOK_CAUSES = {
    "the fit's loop sums gradients over ranks: ":
        "the fit sums gradients over ranks without dividing by the world size: its DDP runs the comm hook {hook} "
        "(a hook that all-reduces with SUM and never divides?), or its loop sums them again: ",
    "the fit's loop divides the loss or the gradients by the world size on top of DDP's own averaging: ":
        "the fit divides by the world size twice: its DDP runs the comm hook {hook} (a hook that divides what DDP "
        "already averaged?), or its loop divides too: ",
}


#: comm hooks that all-reduce the gradients in a narrower dtype (torch's own, by the name DDP logs), and the
#: precision whose tolerance their rounding falls within: fp16_compress_hook measured 4.4e-4 relative at world
#: size 2 (script_comm_hook_averages with torch's hook in place of its own), which fp32's 1e-5 failed
COMPRESSING = {"fp16_compress": "16-mixed", "FP16_COMPRESS": "16-mixed", "bf16_compress": "bf16-mixed"}


def _compressed_rtol(ctx: CheckContext, record: FitRecord, rtol: float) -> float:
    """The tolerance for a fit whose DDP all-reduces through a compressing hook: the reference runs without
    it (`one_world.without_comm_hooks`), so the hook's rounding is allowed as its dtype's (noted)."""
    hook = str((record.ddp or {}).get("comm_hook") or "")
    precision = next((p for name, p in COMPRESSING.items() if name in hook), None)
    wider = RTOL.get(ctx.rank_ctx.device_type, {}).get(precision or "", rtol)
    if wider > rtol:
        ctx.note(f"the fit all-reduces through {hook}, which rounds the gradients to {precision}'s dtype: judged "
                 f"at {precision}'s tolerance ({rounded(wider)})")
    return max(rtol, wider)


def in_the_hook(verdict: str, record: FitRecord) -> str:
    """A world-size factor where the fit's DDP ran a comm hook: the hook is named as the likely cause (the
    reference runs without it, `one_world.without_comm_hooks`)."""
    hook = (record.ddp or {}).get("comm_hook")
    for cause, hooked in _HOOK_CAUSES.items():
        if hook and verdict.startswith(cause):
            return hooked.format(hook=hook) + verdict[len(cause):]
    return verdict


def _skip_unless_all(problem: str) -> None:
    """Skip on every rank when some rank found a problem (collective): the first rank's, in one line."""
    found = [p for p in all_gather(problem) if p]
    if found:
        pytest.skip(f"this script's first optimizer step cannot be redone in a world of one: {found[0]}")


def _first_step_problem(record: FitRecord) -> str:
    """What this rank's DDP run lacks for a rerun on the global batch, or ""."""
    first = record.first_step
    if first is None or first.grads is None:
        return "no optimizer step of its fit was seen"
    if first.overflowed:
        return overflow_reason(first.overflowed)
    if any(record.passes[index].dispatched for index, _ in first.sources if index is not None):
        return ("its loader dispatches the batches (accelerate's dispatch_batches: rank 0 reads every rank's batch "
                "and sends each its slice), so no rank's own DataLoader yields the batch it trains")
    if not first.batches or any(b is None for b in first.batches):
        return ("it reads its batches from no DataLoader (a get_batch of its own, drawing with torch.randint?), so "
                "there are no batches to give the rerun")
    passes = {index for index, _ in first.sources}
    if len(passes) > 1 or [count for _, count in first.sources] != list(range(1, first.micro_batches + 1)):
        return ("its loader is not read one batch per micro-batch (read ahead of the forwards, or the first step "
                "spans two loader passes), so which batch fed which micro-batch is not known")
    if first.rng_drawn:
        return ("it draws random numbers during the step (random augmentation, dropout other than "
                "torch.nn.functional's, which is turned off here), which a run on the global batch cannot redraw")
    if trains_batchnorm(record.model):
        return "its model has BatchNorm in training mode, which normalises each micro-batch by its own statistics"
    return ""


def _samples(batch: Any) -> int | None:
    """The batch dimension of a batch's first tensor (None when it holds none)."""

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    for item in children(batch) or []:
        found = _samples(item)
        if found is not None:
            return found
    return None


def _size_problem(ranks: list[list[Any]]) -> str:
    """Unequal micro-batches: DDP averages the ranks' means, which is the global mean only for equal sizes."""
    sizes = [[_samples(batch) for batch in batches] for batches in ranks]
    if len({len(s) for s in sizes}) > 1:
        return f"its ranks took different numbers of micro-batches for the first step ({[len(s) for s in sizes]})"
    if len({n for s in sizes for n in s}) > 1:
        return (f"its micro-batches differ in size ({sizes} samples per rank), so the mean of their means is not the "
                "mean over their samples")
    return ""


def concatenated(batches: list[Any]) -> Any:
    """The ranks' micro-batches as one: tensors concatenated along dim 0, containers item by item,
    anything else as long as it is the same on every rank; Unjudged naming what cannot be joined."""

    head = batches[0]
    if isinstance(head, torch.Tensor):
        if any(not isinstance(b, torch.Tensor) or b.dim() == 0 or b.shape[1:] != head.shape[1:] for b in batches):
            raise Unjudged(f"its batches cannot be concatenated into one (tensors of shapes "
                           f"{[tuple(getattr(b, 'shape', ())) for b in batches]})")
        return torch.cat(batches)
    items = children(head)
    if items is None:
        if any(b != head for b in batches):
            raise Unjudged(f"its batches cannot be concatenated into one (they hold {type(head).__name__} values "
                           "that differ between ranks)")
        return head
    parts = [children(b) for b in batches]
    if any(p is None or len(p) != len(items) or type(b) is not type(head) for p, b in zip(parts, batches, strict=True)):
        raise Unjudged("its batches cannot be concatenated into one (the ranks' batches differ in structure)")
    return rebuilt(head, [concatenated([p[i] for p in parts]) for i in range(len(items))])  # type: ignore[index]


def _own_group_of_one(ctx: CheckContext) -> Any:
    """This rank's own process group of one (collective the first time: every rank makes every
    singleton group, as `new_group` requires), so a rerun's DDP averages over this process alone."""

    key = f"{id(dist.group.WORLD)}:{ctx.world_size}"
    if key not in _GROUPS:
        _GROUPS.clear()
        groups = [dist.new_group([r]) for r in range(ctx.world_size)]
        _GROUPS[key] = (dist.group.WORLD, groups)  # the default group kept alive: its id is the key
    return _GROUPS[key][1][ctx.rank]


def _attempt(run: Callable[[], dict[str, Any]]) -> dict[str, Any] | str:
    try:
        return run()
    except Unjudged as exc:
        return str(exc)


def _judged_or_none(run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    result = _attempt(run)
    return result if isinstance(result, dict) else None


class _Rerun:
    """The script run again as in a world of one, from the DDP run's first parameters, fed given batches."""

    def __init__(self, ctx: CheckContext, record: FitRecord, group: Any, config: Any = None) -> None:
        """`config`: the run config the rerun's adapter is set up with (default: the run's own)."""
        first = record.first_step
        assert first is not None
        self.ctx, self.group, self.start, self.config = ctx, group, first.params, config
        self.names = [name for name, _ in unwrapped(record.model).named_parameters()]
        self.micro_batches = first.micro_batches
        self.loader_pass = first.sources[0][0]  # the how-manieth DataLoader pass of the fit trained

    def gradients(self, batches: list[Any]) -> dict[str, Any]:
        """The gradients the rerun's first optimizer step applied, by parameter name (float64, CPU)."""
        fed = _Fed(batches)
        mismatch: list[str] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(world_of_one())
            stack.enter_context(without_dropout())
            stack.enter_context(ddp_argument_forced("process_group", self.group))
            stack.enter_context(fed.patched(self.loader_pass))
            hooks = stack.enter_context(without_comm_hooks())
            recorder = stack.enter_context(FitRecorder(plan=FitPlan(
                first_step=True, on_first_micro_batch=lambda m: self._set(m, mismatch))))
            try:
                with self.ctx.training(1):
                    (self.ctx.adapter(self.config) if self.config is not None else self.ctx.adapter()).fit(1)
            except Exception as exc:
                session_evidence.forget()  # as after any fit that raised (`guarded_fit`)
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                raise Unjudged(f"the script raised in a world of one: {type(exc).__name__}: {first_line}") from exc
        self._note_hooks(hooks)
        return self._read(recorder.record, fed, mismatch)

    def _note_hooks(self, hooks: list[str]) -> None:
        """Say once that the reference ran without the script's comm hook (`one_world.without_comm_hooks`)."""
        note = (f"the reference (the script in a world of one) ran DDP's own all-reduce, without the script's comm "
                f"hook ({', '.join(sorted(set(hooks)))}): a reference never inherits the hook it judges")
        if hooks and note not in self.ctx.notes:
            self.ctx.note(note)

    def _set(self, model: Any, mismatch: list[str]) -> None:
        """The DDP run's first parameters, into the rerun's model at its first training forward."""

        mine = list(unwrapped(model).parameters())
        if [tuple(p.shape) for p in mine] != [tuple(p.shape) for p in self.start]:
            mismatch.append("its model in a world of one has other parameters than under DDP")
            return
        with torch.no_grad():
            for target, value in zip(mine, self.start, strict=True):
                target.copy_(value)

    def _read(self, record: FitRecord, fed: _Fed, mismatch: list[str]) -> dict[str, Any]:
        first = record.first_step
        if mismatch:
            raise Unjudged(mismatch[0])
        if first is None or first.grads is None:
            raise Unjudged("the script took no optimizer step in a world of one")
        if fed.served < len(fed.batches):
            raise Unjudged("in a world of one its training forwards did not read the loader the DDP run trained from")
        if first.micro_batches != len(fed.batches):
            raise Unjudged(f"in a world of one it takes {first.micro_batches} micro-batch(es) per optimizer step where "
                           f"its ranks took {len(fed.batches)} each (an accumulation divided by the world size?)")
        return dict(zip(self.names, first.grads, strict=True))


class _Fed:
    """The batches the rerun's training loader yields in place of its own, then its own."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.served = batches, 0

    @contextlib.contextmanager
    def patched(self, index: int | None) -> Iterator[None]:
        """DataLoader's `index`th pass of the rerun (the one the DDP run trained from) yields `batches`."""

        original = DataLoader.__iter__
        calls = [0]

        def __iter__(loader: Any) -> Any:
            calls[0] += 1
            if calls[0] - 1 != index:
                return original(loader)
            return self._yields(lambda: original(loader))

        with mock.patch.object(DataLoader, "__iter__", __iter__):
            yield

    def _yields(self, own: Callable[[], Any]) -> Iterator[Any]:
        for batch in self.batches:
            self.served += 1
            yield batch
        yield from own()  # a loop that reads on past the step's micro-batches (a prefetch) gets its own


@contextlib.contextmanager
def without_dropout() -> Iterator[None]:
    """`torch.nn.functional`'s dropouts (which `nn.Dropout` and its kin call) as the identity, for
    both runs alike: the masks depend on the batch's shape, so a run on the global batch could never
    draw the ranks' masks, and what DDP synchronises does not depend on them. So is the attention dropout
    of `scaled_dot_product_attention` (`dropout_p`, which transformers' attention passes in training). Other
    random numbers drawn in the step still make it unjudgeable (`FirstStep.rng_drawn`)."""

    def identity(input: Any, *args: Any, **kwargs: Any) -> Any:
        return input

    with contextlib.ExitStack() as stack:
        for name in DROPOUTS:
            if not hasattr(F, name):
                raise AssertionError(f"torch.nn.functional.{name} is gone: update ddp_conformance.checks.script_step")
            stack.enter_context(mock.patch.object(F, name, identity))
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention",
                                              _without_attention_dropout(F.scaled_dot_product_attention)))
        yield


def _without_attention_dropout(attention: Callable[..., Any]) -> Callable[..., Any]:
    """`scaled_dot_product_attention` with its `dropout_p` (query, key, value, attn_mask, dropout_p: the fifth
    argument, or by keyword) at 0."""

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            return attention(*args[:4], 0.0, *args[5:], **kwargs)
        return attention(*args, **{**kwargs, "dropout_p": 0.0})

    return scaled_dot_product_attention


def _vacuous(fit: dict[str, Any], whole: dict[str, Any]) -> str:
    if any(g is not None and bool(g.any()) for g in (*fit.values(), *whole.values())):
        return ""
    return ("training does not change the model: every gradient is exactly zero, in the script's DDP step and in "
            "the same script in a world of one on the global batch")
