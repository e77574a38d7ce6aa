"""The learning rate each optimizer step of a fit took, to tell a schedule set by the total steps from
a fit that is not reproducible.

A linear decay to `--max_train_steps` (accelerate's and transformers' examples, the Trainer's default)
gives a fit to k another learning rate from its second step on than a fit to n: the two differ after a
step although each is reproducible. resume_fidelity compares two fits from scratch before it compares a
resume; where they part, the learning rates they stepped with say whether the schedule is the cause.
Read off the first optimizer that steps (a fit's main one) through torch's global step pre-hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: the last watched fits' trails, by the id of the FitRecord its recorder left (`remember`), with the record
#: itself (an id is reused once its object is gone)
_TRAILS: dict[int, tuple[Any, list[tuple[float, ...]]]] = {}
KEPT = 8


class LrTrail:
    """The learning rates of the main optimizer's parameter groups as each of its steps begins."""

    def __init__(self) -> None:
        self.rates: list[tuple[float, ...]] = []
        self._main: Any = None

    def _on_optimizer_pre_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._main is None:
            self._main = optimizer
        if optimizer is self._main:
            self.rates.append(tuple(float(group.get("lr", 0.0)) for group in optimizer.param_groups))


@contextlib.contextmanager
def watching() -> Iterator[LrTrail]:
    from torch.optim.optimizer import register_optimizer_step_pre_hook  # deferred: torch is heavy to import

    trail = LrTrail()
    handle = register_optimizer_step_pre_hook(trail._on_optimizer_pre_step)
    try:
        yield trail
    finally:
        handle.remove()


def remember(record: Any, trail: LrTrail) -> None:
    _TRAILS.pop(id(record), None)
    _TRAILS[id(record)] = (record, trail.rates)
    while len(_TRAILS) > KEPT:
        _TRAILS.pop(next(iter(_TRAILS)))


def _rates(record: Any) -> list[tuple[float, ...]] | None:
    held = _TRAILS.get(id(record))
    return held[1] if held is not None and held[0] is record else None


def first_apart(one: Any, other: Any, through: int) -> tuple[int, tuple[float, ...], tuple[float, ...]] | None:
    """The first step (1-based, up to `through`) at which the two recorded fits stepped with other
    learning rates, and both rates; None where they agree or either was not watched."""
    a, b = _rates(one), _rates(other)
    if a is None or b is None:
        return None
    return next(((step, x, y) for step, (x, y) in enumerate(zip(a[:through], b[:through], strict=False), start=1)
                 if x != y), None)
