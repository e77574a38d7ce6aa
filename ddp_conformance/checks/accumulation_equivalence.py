"""accumulation_equivalence: k accumulated micro-batches apply the gradient of one batch k times
larger, and the fit takes the k the config claims.

The guides' promise: with `accumulate_grad_batches: k` the effective batch is batch x GPUs x k. A
loop breaks it silently in three ways: it steps after every micro-batch (the config's k never reaches
the loop), its loss is not divided by k (the step applies k times the gradient) or is divided twice,
or it zeroes the gradients inside the window (only the last micro-batch counts). An all-reduce on
every micro-batch (no `no_sync` on the earlier ones) gives the right gradient at k times the
communication: noted, not failed (under `static_graph` it is required: pytorch#143580).

Observes, on every rank, the first optimizer step of the dropout-free fit other checks share
(`shared_fit.steady`): how many micro-batches (training forwards) it took (k observed), which of them DDP
synchronised, the gradients it applied and the samples each rank drew. The config's `accumulate_grad_batches`
(after the trainer's own `setup`) is a claim: above 1, k observed must be it (the verdict names both);
at 1, a trainer may accumulate by a setting of its own (Lightning's manual optimization must, a script by its
own flag), which is noted. Where k observed is above 1, the applied gradients are compared with the
single-process gradient of all the samples the ranks drew for that step, computed by the trainer's own loss
at k = 1 (`accumulation_watch.at_one_micro_batch`: a loss that reads the accumulation from the trainer, as
`self.trainer.accumulate_grad_batches`, must not divide the reference too), as gradient_equivalence compares
the fit's first step (`fit_step.first_step_compared`, its tolerance): a ratio of k or 1/k, or the last
micro-batch's gradient alone, is this check's verdict; any other difference is gradient_equivalence's.
A script (`script:` SPEC) is run at k = 1 by the SPEC's `{accumulate_grad_batches}`, fed the whole window as
one batch (`gradient_equivalence/script_window.py`).

Assumes equal micro-batches (their mean of means is the mean) and that a window's micro-batches are the
training forwards before its optimizer step. A ratio of k is also what a loop that sums gradients over the
ranks gives where k equals the world size: the two are told apart only where they differ, and the world
size is named first.

Skips, with the reason: a fit whose first optimizer step follows one micro-batch where the config
asks for no accumulation; a script that accumulates by a setting its SPEC does not carry (no reference at
k = 1 can be run); a first step that cannot be recomputed in one process (dropout drawn in it, BatchNorm in
training mode, no dataset indices, micro-batches of unequal sizes).
"""

from __future__ import annotations

from typing import Any

import pytest

from .gradient_equivalence import RTOL
from .gradient_equivalence.fit_step import first_step_compared
from .gradient_equivalence.script_window import judge_script_window
from .support import shared_fit
from .support.accumulation_watch import (
    at_one_micro_batch,
    claim_disagrees,
    over_ranks_note,
    own_setting,
    window_per_step,
)
from .support.check_context import CheckContext, all_gather, hide_on_verdict
from .support.first_steps import overflow_reason, own_config
from .support.fit_record import FitRecord
from .support.gradients import is_accumulation_cause


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    config = shared_fit.steady_config(ctx)
    own = own_config(ctx, config)
    script = not ctx.takes_config
    asked = own.trainer.accumulate_grad_batches
    record = shared_fit.steady(ctx).record
    first = record.first_step
    if first is None or first.grads is None:
        pytest.skip("the fit applied no optimizer step with gradients, so there is no accumulation window to judge "
                    "(rank_participation judges a fit that never steps)")
    overflowed = max(all_gather(first.overflowed))
    per_step = all_gather(window_per_step(first.micro_batches, first.overflowed))
    if None in per_step:
        pytest.skip(f"{overflow_reason(overflowed)}: its window is not one accumulation window, so there is none to "
                    "judge")
    windows = [int(window) for window in per_step]
    figures: dict[str, Any] = {"configured": asked, "micro_batches_per_step": windows}
    carried = script and bool(getattr(ctx.adapter(), "carries_accumulation", False))
    disagreement = claim_disagrees(asked, windows, script, carried)
    if disagreement:
        raise ctx.fail(disagreement, **figures)
    if carried and over_ranks_note(asked, windows):
        ctx.note(over_ranks_note(asked, windows))
    if max(windows) == 1:
        pytest.skip("the config asks for no gradient accumulation (accumulate_grad_batches 1) and the fit's first "
                    "optimizer step follows one micro-batch")
    if overflowed:
        pytest.skip(f"{overflow_reason(overflowed)}: the window's gradient is not the gradient of its micro-batches, "
                    f"so there is none to compare (the window's structure was: {windows[0]} micro-batches a step)")
    own_window = own_setting(asked, windows, script)
    if own_window:  # Lightning's manual optimization must leave the Trainer's at 1 and accumulate on its own
        ctx.note(own_window)
    _note_syncs(ctx, record, windows[ctx.rank])
    if script:
        return _script(ctx, carried, figures)
    rtol = RTOL.get(ctx.rank_ctx.device_type, {}).get(ctx.config.trainer.precision)
    if rtol is None:
        pytest.skip(f"no measured gradient tolerance for precision {ctx.config.trainer.precision!r} on this device")
    compared = first_step_compared(ctx, at_one_micro_batch(ctx, ctx.config), rtol, reference=at_one_micro_batch)
    if isinstance(compared, str):
        pytest.skip(f"{compared}, so the accumulated gradient is not compared (the window's structure was: "
                    f"{windows[0]} micro-batches, as configured)")
    figures.update(compared.figures)
    verdicts = [v for v in all_gather(compared.verdict) if v]
    if verdicts and is_accumulation_cause(verdicts[0]):
        raise ctx.fail(verdicts[0], **figures)
    if verdicts:  # the window may be right, but this gradient cannot show it: the difference is not the window's
        pytest.skip(f"the fit's first step differs from the single-process gradient by a cause outside the "
                    f"accumulation window, gradient_equivalence's to name ({verdicts[0][:120]}...), so the "
                    f"accumulated gradient cannot be judged by it (the window's structure was: {windows[0]} "
                    "micro-batches, as configured)")
    figures["summary"] = f"{windows[0]} micro-batches a step"
    return figures


def _script(ctx: CheckContext, carried: bool, figures: dict[str, Any]) -> dict[str, Any]:
    """A script's window: its gradients held across the window, seen in its fit, and where its SPEC can set k
    (`carried`), its gradient against the script at k = 1 (`script_window.py`)."""
    return judge_script_window(ctx, ctx.adapter(), carried, figures)


def _note_syncs(ctx: CheckContext, record: FitRecord, window: int) -> None:
    """An all-reduce on every micro-batch of the window: the right gradient at `window` times the communication."""
    synced = record.synced[:window]
    if record.ddp is None or len(synced) < window or not all(synced):
        return
    static = bool(record.ddp.get("static_graph"))
    ctx.note(f"every micro-batch of the {window}-batch window is all-reduced, not only the last: the gradient is the "
             f"same, at {window} times the communication"
             + (" (required with static_graph on: a fresh static-graph DDP cannot start a window under no_sync, "
                "pytorch#143580)" if static else "; no_sync() around the others would save it"))
