"""accumulation_equivalence: k accumulated micro-batches apply the gradient of one batch k times
larger, and the fit takes the k the config gives it.

The guides' promise: with `accumulate_grad_batches: k` the effective batch is batch x GPUs x k. A
loop breaks it silently in three ways: it steps after every micro-batch (the config's k never reaches
the loop), its loss is not divided by k (the step applies k times the gradient) or is divided twice,
or it zeroes the gradients inside the window (only the last micro-batch counts). An all-reduce on
every micro-batch (no `no_sync` on the earlier ones) gives the right gradient at k times the
communication: noted, not failed (under `static_graph` it is required: pytorch#143580).

Reads the dropout-free fit other checks share (`shared_fit.steady`), which keeps its first optimizer
step: how many micro-batches it took on each rank (k observed), which of them DDP synchronised, the
gradients it applied and the samples each rank drew. Where the config's `accumulate_grad_batches`
(after the trainer's own `setup`) is above 1, k observed must be it; where it is 1, a trainer may
accumulate by a setting of its own (Lightning's manual optimization must), which is noted. Where k
observed is above 1, the applied gradients are compared with the single-process gradient of all the
samples the ranks drew for that step, as gradient_equivalence compares the fit's first step
(`fit_step.first_step_compared`, its tolerance): a ratio of k or 1/k, or the last micro-batch's
gradient alone, is this check's verdict; any other difference is gradient_equivalence's.

A ratio of k is also what a loop that sums gradients over the ranks gives where k equals the world
size: the two are told apart only where they differ, and the world size is named first.

Skips, with the reason: a fit whose first optimizer step follows one micro-batch where the config
asks for no accumulation; a trainer that runs its own command line (a script: no config to hold it
to, and gradient_equivalence reruns its first step, accumulated or not, and names these causes
there); a first step that cannot be recomputed in one process (dropout drawn in it, BatchNorm in
training mode, no dataset indices, micro-batches of unequal sizes).
"""

from __future__ import annotations

from typing import Any

import pytest

from .gradient_equivalence import RTOL
from .gradient_equivalence.fit_step import first_step_compared
from .support import shared_fit
from .support.check_context import CheckContext, all_gather, hide_on_verdict
from .support.first_steps import overflow_reason, own_config
from .support.gradients import is_accumulation_cause, single_process_adapter
from .support.observe import FitRecord


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    config = shared_fit.steady_config(ctx)
    own = own_config(ctx, config)
    if not ctx.takes_config:
        pytest.skip(f"trainer {ctx.spec.label} runs its own command line, not the harness's config: there is no "
                    "configured accumulation to hold it to, and its first optimizer step's gradient, accumulated or "
                    "not, is gradient_equivalence's (a rerun of the script's step)")
    asked = own.trainer.accumulate_grad_batches
    record = shared_fit.steady(ctx).record
    first = record.first_step
    if first is None or first.grads is None:
        pytest.skip("the fit applied no optimizer step with gradients, so there is no accumulation window to judge "
                    "(rank_participation judges a fit that never steps)")
    overflowed = max(all_gather(first.overflowed))
    if overflowed:
        pytest.skip(f"{overflow_reason(overflowed)}: its window is not one accumulation window, so there is none to "
                    "judge")
    windows = all_gather(first.micro_batches)
    figures: dict[str, Any] = {"configured": asked, "micro_batches_per_step": windows}
    if asked > 1 and any(window != asked for window in windows):
        raise ctx.fail(_not_the_configured(asked, windows), **figures)
    if max(windows) == 1:
        pytest.skip("the config asks for no gradient accumulation (accumulate_grad_batches 1) and the fit's first "
                    "optimizer step follows one micro-batch")
    if asked == 1:  # Lightning's manual optimization must leave the Trainer's at 1 and accumulate on its own
        ctx.note(f"the fit accumulates {windows[0]} micro-batches a step by a setting of its own: the config's "
                 "accumulate_grad_batches is 1")
    _note_syncs(ctx, record, windows[ctx.rank])
    rtol = RTOL.get(ctx.rank_ctx.device_type, {}).get(ctx.config.trainer.precision)
    if rtol is None:
        pytest.skip(f"no measured gradient tolerance for precision {ctx.config.trainer.precision!r} on this device")
    compared = first_step_compared(ctx, single_process_adapter(ctx) or ctx.adapter(), rtol)
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


def _not_the_configured(asked: int, windows: list[int]) -> str:
    taken = ", ".join(sorted({str(w) for w in windows}))
    if asked > 1 and max(windows) == 1:
        return (f"the fit steps after every micro-batch although accumulate_grad_batches is {asked}: the config's "
                f"accumulation never reaches the loop (its first optimizer step took {taken} micro-batch per rank), "
                f"so each step applies the gradient of 1/{asked} of the configured batch")
    return (f"the fit's first optimizer step takes {taken} micro-batch(es) per rank, but accumulate_grad_batches is "
            f"{asked}: the loop accumulates over another window than the config's")


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
