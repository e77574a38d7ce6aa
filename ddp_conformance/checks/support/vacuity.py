"""Vacuous training: a fit that cannot change the model agrees with everything.

A loss that is identically zero (cross_entropy over a one-column output: the softmax of a single
logit is 1 whatever the model computes) gives exactly zero gradients. Every comparison the checks
make then holds trivially: DDP's gradients equal the single-process ones (both 0), the ranks stay in
sync, a resume is bitwise. So a check that judges training first asks the real fit whether it
trained at all, from what the `FitObserver` sees on every rank:

- gradients: at each optimizer step (the recorder's hook), whether any gradient it applies is
  nonzero, after whatever the trainer did to them (clipping, unscaling);
- parameters: a digest when the model is wrapped and one of the fit's final parameters;
- losses: every micro-batch loss the fit reports.

Evidence travels through the progress files (`progress.py`), so it is plain JSON, and every rank
reads every rank's evidence and reaches the same verdict.
"""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

from ...adapter import FitObserver, StepInfo, TrainState
from .check_context import rounded
from .fit_record import FitRecord
from .model_state import digest, parameters


class TrainingEvidence(FitObserver):
    """Records, during a real fit, the parameters' digest when the model first runs and the losses
    the adapter reports; `summary` adds the gradients the recorder saw at each optimizer step."""

    def __init__(self) -> None:
        self.names: list[str] | None = None
        self.initial: str | None = None
        self.losses: list[float] = []

    def on_wrapped(self, model: Any) -> None:
        named = {n.removeprefix("module."): p.detach() for n, p in model.named_parameters()}
        self.names = list(named)
        self.initial = digest(named)

    def after_step(self, info: StepInfo) -> None:
        if info.loss is not None:
            loss = info.loss
            self.losses.append(float(loss.detach() if hasattr(loss, "detach") else loss))  # no autograd warning

    def figures(self, state: TrainState, record: FitRecord | None) -> dict[str, Any]:
        """What rank_participation reads of every rank's fit (its progress file's `extra`): the optimizer
        steps, a digest of the final parameters, the digests of the tensors stepped outside the model, the
        losses, the training evidence (`summary`), and whether the forward bypassed DDP."""
        return {"global_step": state.global_step, "digest": digest(parameters(state.params, self.names)),
                "outside": record.outside_digests() if record is not None else {},
                "losses": self.losses, "evidence": self.summary(state, record),
                "bypassed_ddp": record.bypassed_ddp if record is not None else False}

    def summary(self, state: TrainState | None, record: FitRecord | None) -> dict[str, Any]:
        """What this rank saw, as JSON-able values; `params_changed` is None when unknown."""
        changed = None
        if state is not None and self.initial is not None and self.names:
            final = parameters(state.params, self.names)
            if set(final) == set(self.names):
                changed = digest(final) != self.initial
        return {"grad_steps": record.grad_steps if record else 0,
                "nonzero_grad_steps": record.nonzero_grad_steps if record else 0,
                "local_grad_nonzero": record.local_grad_nonzero if record else None,
                "losses": list(self.losses), "params_changed": changed}


def silent_ranks(evidence: list[dict[str, Any] | None]) -> list[int]:
    """Ranks whose own backward gave the model only zero gradients while another rank's did not: they
    run every step and stay in sync, but DDP averages zeros in for their samples."""
    local = [e.get("local_grad_nonzero") if e else None for e in evidence]
    if True not in local:
        return []
    return [rank for rank, nonzero in enumerate(local) if nonzero is False]


def vacuity_verdict(evidence: list[dict[str, Any] | None], fit: str) -> str:
    """Why the fit `fit` (e.g. "fit(4)") trained nothing, from every rank's `summary`, or "" if it did."""
    seen = [e for e in evidence if e]
    if not seen:
        return ""
    ranks = f"{len(seen)} rank{'s' if len(seen) > 1 else ''}"
    grad_steps = sum(e["grad_steps"] for e in seen)
    losses = [loss for e in seen for loss in e["losses"]]
    constant = losses and all(len(e["losses"]) > 1 and len(set(e["losses"])) == 1 for e in seen)
    said = f"; every loss was exactly {rounded(losses[0])}" if constant and len(set(losses)) == 1 else ""
    if grad_steps and not sum(e["nonzero_grad_steps"] for e in seen):
        return (f"training does not change the model: every gradient is exactly zero at each of the {grad_steps} "
                f"optimizer steps of {fit} on {ranks}{said} (a loss that does not depend on the parameters, e.g. "
                "cross_entropy over a one-column output, is identically 0)")
    if all(e["params_changed"] is False for e in seen):
        return (f"training does not change the model: the parameters after {fit} are bitwise the initial ones on "
                f"{ranks}{said} (no optimizer step, a zero learning rate, or an optimizer holding other tensors?)")
    if constant:
        values = ", ".join(sorted({rounded(e["losses"][0]) for e in seen}))
        return (f"the loss never changes: on each of {ranks}, every micro-batch loss of {fit} is one constant "
                f"({values}) although the batches and parameters change: the loss does not depend on the model, or "
                "the trainer reports a constant")
    return ""


def skip_as_vacuous(verdict: str) -> NoReturn:
    """A fit that cannot change the model agrees with every comparison, and proves none: that it does
    not train is rank_participation's verdict, so a check that compares skips, naming it."""

    pytest.skip(f"{verdict}: there is nothing to compare (rank_participation fails the trainer for it)")
