"""Whether two identical fits of the trainer agree: the precondition of every check that compares two fits.

compiled_model, static_graph, bucket_cap_mb_invariance and mixed_precision each run the trainer's fit twice,
once with the setting they judge changed, and blame that setting for what differs. That holds only where the
same fit run twice ends in the same place. A torchrun script that never seeds its model or its data (the DDP
tutorial's, minGPT's) draws a fresh model every fit, as every rank starts each fit with fresh seeds (as under
torchrun): compiled_model then found its compiled and eager fits 1.88 and 1.98 apart and blamed torch.compile,
where a seeded copy of the same script passes. resume_fidelity fails such a fit as "the fit is not
reproducible" (two fits from scratch already differ); a check that compares two fits skips on it, naming that
verdict, and never blames its own setting.

The evidence: the dropout-free fit the checks share (`shared_fit.steady`) and the same fit run again from
scratch (`repeat`, kept for the session like the fits it repeats, so every check of a trainer reuses one
repeat), their final parameters and buffers compared per tensor relative to each tensor's largest value
(`gradients.max_delta`), the largest over the ranks. Two fits agree where that is within the tolerance the
asking check allows between the fits it compares (bitwise on CPU: a seeded fit repeats exactly there).

When to ask: a check that passes on agreement asks only once its fits disagree, since two fits that agree
under different settings show the fit repeats (no cost on a trainer that passes); a check that passes on
anything but certain differences (mixed_precision, whose rounding is measured, not bounded) asks before it
compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from ...adapter import NotProvided, TrainState
from .adapter_errors import AdapterError
from .check_context import CheckContext, all_gather, rounded
from .first_steps import final_floats
from .gradients import max_delta
from .progress import PeerFitFailed, guarded_fit
from .shared_fit import STEADY_STEPS, evidence_key, held_or_run, steady, steady_config

#: where a check names no tolerance: the tightest of the two-fit checks' (static_graph's and
#: bucket_cap_mb_invariance's 1e-4), far above rounding and far below another model (0.1 and more apart)
AGREE = 1e-4
LABEL = "steady-repeat"
#: resume_fidelity's verdict on a fit whose two fits from scratch differ, which the skip names
VERDICT = "the fit is not reproducible"


@dataclass(frozen=True)
class Repeat:
    """The shared dropout-free fit against the same fit run again: the largest relative difference of a final
    tensor over the ranks (NaN: a fit ended with non-finite tensors, which cannot be compared), its tensor and
    rank."""

    relative: float
    tensor: str
    rank: int
    ran_in: str


def require_reproducible(ctx: CheckContext, judged: str, tolerance: float = AGREE) -> None:
    """Skip, naming resume_fidelity's "not reproducible", where two identical fits from scratch end further
    apart than `tolerance`: a difference between two fits then cannot be blamed on `judged` (the setting the
    check changes). Collective. A fit that raises here is not judged: the check goes on to its own verdict."""
    _judge(ctx, repeat(ctx), judged, tolerance)


def require_agreement(ctx: CheckContext, first: TrainState, again: Any, judged: str, tolerance: float) -> None:
    """As `require_reproducible`, for a check whose side to compare is a fit of its own, run twice (`first`,
    `again`): compiled_model's eager fit with dropout at 0, or under `force_eager`. Collective."""
    _judge(ctx, _compared(ctx, again, first), judged, tolerance)


def _judge(ctx: CheckContext, found: Repeat | None, judged: str, tolerance: float) -> None:
    """Skip where `found` parts beyond `tolerance`; its figures are reported either way (how far two identical
    fits part, measured on every device the suite runs on)."""
    if found is None:
        return
    ctx.figures.update(repeat_max_rel_delta=found.relative, repeat_worst_tensor=found.tensor)
    if not math.isnan(found.relative) and found.relative > tolerance:
        pytest.skip(not_reproducible(found, judged, tolerance))


def not_reproducible(found: Repeat, judged: str, tolerance: float) -> str:
    return (f"{VERDICT} (resume_fidelity's verdict): two identical fits from scratch already end apart after "
            f"{STEADY_STEPS} steps ({found.tensor} by {rounded(found.relative)} of its largest value on rank "
            f"{found.rank}, where {rounded(tolerance)} is allowed between the fits this check compares), so what "
            f"differs between two fits cannot be blamed on {judged}: an unseeded model, data order or dropout? (every "
            "rank starts each fit with its own fresh seeds, as under torchrun; seed them to have this judged)")


def repeat(ctx: CheckContext) -> Repeat | None:
    """The shared dropout-free fit against the same fit again, run here unless every rank holds it (None: one of
    the fits raised, or the trainer has no fit, so there is nothing to compare)."""
    try:
        first = steady(ctx)
    except (AdapterError, PeerFitFailed, NotProvided):  # no fit to repeat: the check judges what it can
        return None
    config = steady_config(ctx)

    def run() -> Repeat | None:
        adapter = ctx.adapter() if config is ctx.config else ctx.adapter(config)  # as the shared fit builds it
        try:
            state, _ = guarded_fit(ctx, LABEL, STEADY_STEPS, lambda obs: adapter.fit(STEADY_STEPS, observer=obs))
        except (AdapterError, PeerFitFailed):
            return None
        return _compared(ctx, state, first.state)

    return held_or_run(ctx, LABEL, evidence_key(ctx, config, LABEL, STEADY_STEPS), run)


def _compared(ctx: CheckContext, again: Any, first: TrainState) -> Repeat:
    """Every rank's largest per-tensor relative difference, the largest over the ranks (collective)."""
    assert isinstance(again, TrainState)
    name, delta, scale = max_delta(final_floats(again), final_floats(first))
    mine = delta / scale if scale else (0.0 if delta == 0 else math.inf)
    every = all_gather((mine, name))
    nan = [r for r, (rel, _) in enumerate(every) if math.isnan(rel)]
    rank = nan[0] if nan else max(range(len(every)), key=lambda r: every[r][0])
    return Repeat(every[rank][0], every[rank][1], rank, ctx.check_id)
