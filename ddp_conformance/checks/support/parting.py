"""Ending a diagnostic fit once its answer is known: `StopOnceParted` asks the trainer's fit to end
(`FitObserver.stop_requested`) as soon as it has parted from a reference run for good.

resume_fidelity's second resume (the RNG as it was at the checkpoint) runs to the horizon to show
whether it then matches the uninterrupted run, and what it was fed. Once some rank has been fed other
inputs than the uninterrupted run was fed at the same micro-batches *and* its parameters after its
`STEPS`-th optimizer step differ from that run's at the same step beyond the check's tolerance, the
rest of the run cannot change either answer: it does not match, and it was not fed alike. Inputs
alone are not enough (a digest also covers fields the model never reads); parameters alone are not
enough (alike inputs with other weights is a cause of its own, told only over the whole run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...adapter import FitObserver
from .model_state import tensors_differ
from .observe import trainer_name, unwrapped

#: optimizer steps the run takes before it may end: the parameters are compared after this one, and where
#: its data starts (resume_fidelity's `_fed_shift`) is read from its first two micro-batches
STEPS = 2


class StopOnceParted(FitObserver):
    """Decides once, at the first end of a micro-batch after the watched run (`record()`) ended its
    `STEPS`-th iteration (the same call on every rank: the adapter asks after each optimizer step),
    whether it has parted from the reference: `inputs` are the reference's fed-input digests from
    where the run starts (None: unknown on this rank), `params` its parameters at the same step (as
    the trainer names them), compared within `rtol` with the model's own, read there. `gather` is the
    check's all_gather: any rank that parted ends the run on every rank."""

    def __init__(self, record: Callable[[], Any], inputs: list[str] | None, params: dict[str, Any], rtol: float,
                 fed: Callable[[Any], list[str] | None], gather: Callable[[Any], list[Any]]) -> None:
        self._record, self._inputs, self._params, self._rtol = record, inputs, params, rtol
        self._fed, self._gather = fed, gather
        self.decided: bool | None = None
        self.at_micro_batch = 0

    def stop_requested(self) -> bool:
        if self.decided is None:
            record = self._record()
            if record is None or record.model is None or record.iterations < STEPS:
                return False
            self.at_micro_batch = record.micro_batches
            self.decided = any(self._gather(self._parted(record)))
        return self.decided

    def _parted(self, record: Any) -> bool:
        fed = self._fed(record)
        if self._inputs is None or fed is None or len(fed) > len(self._inputs):
            return False
        own = {trainer_name(name): p for name, p in unwrapped(record.model).named_parameters()}
        return fed != self._inputs[:len(fed)] and tensors_differ(self._params, own, self._rtol)
