"""uneven_inputs: a trainer that uses DDP's join finishes when its ranks are given different batch
counts, with the same parameters on every rank.

A rank whose loader runs out before the others' leaves them waiting in DDP's gradient all-reduce,
forever: DDP needs every rank in every collective. Trainers avoid that one of two ways. Most give
every rank the same count (DistributedSampler pads or drops; sampler_disjointness judges the counts).
The others enter DDP's join (`with model.join():`, or `torch.distributed.algorithms.Join([model,
...])`) around their loop over the batches: a rank that leaves the context early answers the others'
collectives with zeros until every rank has left, and the last rank to leave sends its parameters to
all (`_sync_final_model`).

Runs, where the trainer's one-step probe fit (`shared_fit.probe`) entered an enabled join of a
DistributedDataParallel: a fit of `STEPS` optimizer steps in which the last rank is given one step
fewer (`fit(STEPS - 1)` there, the adapter's own contract), so it runs out while the others still train.
Verdicts: the others hang (the join does not enclose the loop, or a collective of the trainer's own
runs inside it), named with the rank that ran out and where the others wait; the fit raises (DDP's
`throw_on_early_termination=True` with no handler for the error it raises on every rank); the ranks end
with different parameters. A trainer that calls a collective of its own inside the join (a loss
all-reduced for logging) pairs it with one of the join's shadow collectives: gloo then aborts the
process on the size mismatch (measured, torch 2.13), which the runner reports as that rank's crash
with gloo's "collective mismatch" in its last words, not as this check's verdict.

Skips, with the reason: a world of one (nothing to wait for), and a fit that enters no join: its ranks
must be given equal counts, which the skip says, with the counts its loaders gave each rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ..adapter import TrainState
from ..runner.ranks import ranks_label
from .support import shared_fit
from .support.adapter_errors import AdapterError
from .support.check_context import CheckContext, CheckFailed, all_gather, hide_on_verdict
from .support.digests import step_digest
from .support.fit_record import FitRecord, JoinUse
from .support.progress import PeerFitFailed, guarded_fit

#: optimizer steps of the fit on every rank but the last, which is given one fewer
STEPS = 3
JOIN_REMEDY = ("the join context must enclose the whole loop over the batches (`with model.join(): for batch in "
               "loader: ...`), and nothing inside it may call a collective the join does not shadow")


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    if ctx.world_size == 1:
        pytest.skip("world size 1: no other rank waits for a rank that runs out of batches")
    probe = shared_fit.probe(ctx)
    joins = all_gather(_ddp_join(probe))
    if not all(joins):
        pytest.skip(_no_join(probe, joins))
    short = ctx.world_size - 1
    mine = STEPS - 1 if ctx.rank == short else STEPS
    figures: dict[str, Any] = {"steps": STEPS, "short_rank": short, "join": joins[0]._asdict()}
    adapter = ctx.adapter(ctx.config)
    try:
        state, _ = guarded_fit(ctx, "uneven", mine, lambda observer: adapter.fit(mine, observer=observer))
    except CheckFailed as exc:
        if "failed with" in str(exc):  # progress.stall_verdict: a rank's fit raised and the others wait for it
            raise
        raise ctx.fail(f"given one optimizer step fewer than the others, rank {short} leaves its fit after step "
                       f"{STEPS - 1} and the other ranks never finish step {STEPS}: {JOIN_REMEDY}. {exc}",
                       **figures) from None
    except (AdapterError, PeerFitFailed) as exc:  # the latter on a rank whose fit ended while another's raised
        raise ctx.fail(f"given one optimizer step fewer than the others, rank {short} runs out and the fit raises"
                       f"{_throws(joins)}: {exc}", **figures) from None
    assert isinstance(state, TrainState)
    digests = all_gather(step_digest([t for t in state.params.values()
                                      if isinstance(t, torch.Tensor) and t.is_floating_point()]))
    apart = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if apart:
        ends = "ends" if len(apart) == 1 else "end"
        raise ctx.fail(f"given one optimizer step fewer than the others, rank {short} runs out and the fit finishes, "
                       f"but {ranks_label(apart)} {ends} with other parameters than rank 0: the fit's state is taken "
                       "inside the join, before the last rank to leave it sends its parameters to all (take it after "
                       "the join context exits)", **figures)
    figures["summary"] = f"joins; rank {short} one step short"
    return figures


def _ddp_join(record: FitRecord) -> JoinUse | None:
    """The first enabled join of a DistributedDataParallel the fit entered, if any."""
    return next((join for join in record.joins if join.enable and "DistributedDataParallel" in join.joinables), None)


def _no_join(record: FitRecord, joins: list[JoinUse | None]) -> str:
    passes = record.training_passes()
    lengths = all_gather(passes[0].length if passes else None)
    if any(joins):
        joined = [r for r, j in enumerate(joins) if j]
        what = f"only {ranks_label(joined)} {'enters' if len(joined) == 1 else 'enter'} DDP's join"
    elif record.joins:
        what = "the fit's join shadows no DistributedDataParallel, or is disabled"
    else:
        what = "the fit uses no DDP join"
    if None in lengths:
        counts = "its loaders' lengths are unknown"
    elif len(set(lengths)) == 1:
        counts = f"its loaders give every rank {lengths[0]} batches an epoch"
    else:
        counts = (f"its loaders give the ranks {', '.join(map(str, lengths))} batches an epoch, so the ranks given "
                  "more hang at the end of the first (sampler_disjointness's verdict)")
    # the counts first: a report clips long reasons
    return (f"{what}, so its ranks must be given equal batch counts: {counts} (a rank that runs out first leaves "
            "the others waiting in DDP's all-reduce; `model.join()` or `torch.distributed.algorithms.Join` around "
            "the loop lets them finish)")


def _throws(joins: list[JoinUse | None]) -> str:
    if any(join is not None and join.throw_on_early_termination for join in joins):
        return (" (its join has throw_on_early_termination=True, which raises on every rank once one runs out: the "
                "loop must catch that error and end the epoch)")
    return ""
