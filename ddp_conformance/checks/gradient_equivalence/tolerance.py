"""gradient_equivalence's tolerance, by the precision the step was observed to run at and the device.

Only measured (precision, device) pairs, bounds ~5-50x the largest delta seen (docs/checks/gradient_equivalence.md):
CPU fp32 1.1e-7, bf16-mixed 3.8e-3 (a config's 16-mixed on CPU runs as bf16-mixed: Lightning and reconcile() say so);
CPU 16-mixed, a torchrun script's own fp16 autocast with a GradScaler, 4.7e-4 at world size 2 and 6.9e-4 at
3 (fixtures/mutants/script_fp16_clips_after_unscale.py; its bf16 twin, script_bf16_autocast.py, 2.9e-3 and
6.1e-3); CUDA (an H200, world size 2 on one GPU) fp32 1.8e-7, bf16-mixed 3.8e-3, 16-mixed 7.0e-4;
Lightning's demo transformer (an H200, world size 2) fp32 3.1e-6, 16-mixed 1.7e-2 (an attention bias: 5e-3
failed it), and on CPU at bf16-mixed 5.0e-3 (world size 2) and 7.9e-3 (3). A bug's ratio is whole: 1/W, W, k.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..support.amp_watch import AmpRecord
from ..support.check_context import all_gather

RTOL = {
    "cpu": {"32-true": 1e-5, "bf16-mixed": 2e-2, "16-mixed": 2e-2},
    "cuda": {"32-true": 1e-5, "bf16-mixed": 2e-2, "16-mixed": 5e-2},
}


def observed_rtol(ctx: Any, amp: AmpRecord | None, where: str) -> tuple[str, float]:
    """(the precision `where` ran at, its tolerance); skips, on every rank, where none was measured. The
    config's precision is only a claim: a note says where the run showed another (`precision_seen`)."""
    precision = precision_seen(ctx, amp, where)
    measured = RTOL.get(ctx.rank_ctx.device_type, {})
    rtol = measured.get(precision)
    if rtol is None:
        pytest.skip(f"no measured gradient tolerance for precision {precision!r} on this device "
                    f"(measured: {', '.join(measured) or 'none'}); the check would be guessing")
    return precision, rtol


def precision_seen(ctx: Any, amp: AmpRecord | None, where: str) -> str:
    """The precision a check judges at: the one the fit `where` ran at (gathered: the first rank's that saw
    a micro-batch), else the config's. Where the config says another, a note says both, and which is used."""
    claimed = ctx.config.trainer.precision
    seen = [(a.precision, a.described()) for a in all_gather(amp) if a is not None and a.precision]
    if not seen:
        return claimed
    precision, described = seen[0]
    if precision != claimed:
        owner = "the config's" if ctx.takes_config else "the harness's config (not the script's own)"
        ctx.note(f"{where} ran at {precision} ({described}), where {owner} trainer.precision is {claimed!r}: judged "
                 f"at the observed {precision}")
    return precision
