"""What bucket_view_memory's two measurements share (the trainer's own DDP measured through `wrap`, and
a script's fit measured from the inside, `fit_memory.py`): the steps measured, the noise floor and
the judgement of a measured saving and of the gradients' layout."""

from __future__ import annotations

from typing import Any

from ..support.check_context import CheckContext, all_gather, hide_on_verdict
from ..support.fit_record import FitRecord
from ..support.fit_watch import FitWatcher
from ..support.memory import shares_its_base

MIN_GRAD_BYTES = 1 << 20
REQUIRED_SAVING = 0.9
STEPS = 3  # as in docs/ddp-facts.md: grads are views only after the first step, buckets rebuilt after it
PAIRS = 3  # (off, on) pairs after the two warm-up runs; the median pair is judged, robust to one stray allocation
#: what a skip for a flag left off says instead of the saving, which is advice and measured on request
ADVICE = "nothing to judge (--ddp-advise measures what turning it on would save)"


class GradViews(FitWatcher):
    """Whether every gradient the first optimizer step of a DDP model applied was a view into DDP's buckets
    (`were_views`; None: no such step, or no gradient)."""

    def __init__(self) -> None:
        self.were_views: bool | None = None

    def on_step(self, record: FitRecord) -> None:
        if self.were_views is None and record.ddp is not None and record.model is not None:
            grads = [p.grad for p in record.model.parameters() if p.grad is not None]
            self.were_views = all(shares_its_base(g) for g in grads) if grads else None


def gathered_views(record: FitRecord) -> list[bool | None]:
    """Every rank's `GradViews.were_views` of its fit (None where the fit had no such watcher). Collective."""
    watcher = record.watched(GradViews)
    return all_gather(watcher.were_views if watcher is not None else None)


def gradient_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def fit_keeps_the_views(ctx: CheckContext, fit_flags: list[bool | None], views: list[bool | None]) -> None:
    """With the flag on in the fit's DDP, the gradients its optimizer step applies must still be
    DDP's bucket views: `p.grad = f(p.grad)` between backward and the step (a hook that sanitises
    gradients) allocates a second copy of every gradient at every step, which train_step never shows."""
    __tracebackhide__ = hide_on_verdict
    ctx.figures["fit_grads_were_views_per_rank"] = views
    lost = [rank for rank, (flag, view) in enumerate(zip(fit_flags, views, strict=True)) if flag and view is False]
    if lost:
        raise ctx.fail(f"the gradients the fit's first optimizer step applies are not DDP's bucket views (rank "
                       f"{lost[0]}) in the fit, although its DDP has gradient_as_bucket_view=True: something "
                       "moves p.grad to new storage between backward and the step (p.grad = f(p.grad) or "
                       "p.grad.data = f(p.grad.data), e.g. torch.nan_to_num in on_before_optimizer_step; change it "
                       "in place, p.grad.nan_to_num_() or out=p.grad), so every step allocates the gradient copy "
                       "the flag saves")


def within_noise(grad_bytes: int, noise: float) -> bool:
    """Whether runs of one setting disagreed by more than the shortfall the promise tolerates, so that a
    saving measured below it says nothing. Seen on CUDA under nccl at world size 1 (an H200, torch 2.11):
    14 MB between runs on 1.5 MB of gradients, one saving read 69% and another 800%; under gloo on the same
    GPU, and on a 256 MB model under nccl, readings agreed to the byte."""
    return noise > (1 - REQUIRED_SAVING) * grad_bytes


def saving_problem(saving: float, grad_bytes: int) -> str | None:
    """The measured saving against the promise: one copy of the gradients, within measurement noise."""
    if saving < REQUIRED_SAVING * grad_bytes:
        return f"gradient_as_bucket_view saves less than {int(100 * REQUIRED_SAVING)}% of one gradient copy"
    return None
