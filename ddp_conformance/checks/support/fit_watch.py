"""What a check asks of the fit the recorder watches: one frozen `FitPlan`, with the `FitWatcher`s it brings.

The recorder (`observe.FitRecorder`) records what every check reads of a fit (micro-batches, steps, loader
passes, RNG). What one check alone reads (a BatchNorm layer's first micro-batch, the model's state at its
first forward, the parameters after step j) a watcher of that check records: the recorder calls the
watchers it is given at the fit's moments and knows none of them by name, so a new check adds a watcher,
not a switch. A watcher holds what it saw; the check finds it in the record (`FitRecord.watched`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import inspect

    from .fit_record import FitRecord


class FitWatcher(Protocol):
    """Hears one fit. Every method is optional (a watcher subclasses this and overrides what it needs);
    each gets the record as it stands, and none may change it."""

    def on_model(self, model: Any, record: FitRecord) -> None:
        """The first micro-batch named the model (`record.model`), before anything of it is recorded."""

    def on_forward(self, module: Any, depth: int, record: FitRecord) -> None:
        """A module's forward starts (`depth` forwards enclose it), outside an activation recomputation."""

    def on_forward_end(self, module: Any, args: Any, output: Any, record: FitRecord) -> None:
        """A module's forward ended, outside an activation recomputation."""

    def on_wrap(self, ddp: Any, module: Any, arguments: inspect.BoundArguments | None) -> None:
        """A DistributedDataParallel was built around `module` during the fit, with these constructor
        arguments (defaults applied; None where they do not bind to its signature)."""

    def on_step(self, record: FitRecord) -> None:
        """An optimizer step was counted (`record.optimizer_steps`, `record.iterations` updated), a step a
        GradScaler skipped too."""

    def on_end(self, record: FitRecord) -> None:
        """The fit ended, whichever way (the recorder's exit)."""


#: the hooks a watcher may override, for the recorder to call only those it did
HOOKS = ("on_model", "on_forward", "on_forward_end", "on_wrap", "on_step", "on_end")


def overridden(watcher: FitWatcher, hook: str) -> bool:
    return getattr(type(watcher), hook, None) is not getattr(FitWatcher, hook)


@dataclass(frozen=True)
class FitPlan:
    """What the recorder keeps of a fit beyond what it always records.

    `first_step`: keep the first optimizer step (`fit_record.FirstStep`); `keep_batches` (with it): the batches
    the loader yielded for it too. `all_inputs`: digest every training micro-batch's inputs (up to
    `fit_record.DIGESTED_INPUTS` a pass), indices or not, to compare what two fits fed their models.
    `model_hooks_only`: once the first micro-batch names the model, the forward hooks move from every module
    to that model alone, so that a forward compiled from then on traces none of them (dynamo would break its
    graph at every module they run on, and hide what the one compiled graph does). `draws(batch)`: the dataset
    indices of a batch the loader yielded (the adapter's `batch_indices`), for batches the batch sampler's
    record cannot tell (`FitRecord.step_draws`). `on_first_micro_batch(model)` runs at the first micro-batch
    before anything of it is recorded (a rerun that must start from another fit's parameters sets them there).
    `watchers`: what makes each watcher, one for each fit the plan serves.
    """

    first_step: bool = False
    keep_batches: bool = False
    all_inputs: bool = False
    model_hooks_only: bool = False
    draws: Callable[[Any], list[int]] | None = None
    on_first_micro_batch: Callable[[Any], None] | None = None
    watchers: tuple[Callable[[], FitWatcher], ...] = ()

    def watching(self, *more: Callable[[], FitWatcher]) -> FitPlan:
        """This plan with more watchers."""
        return replace(self, watchers=(*self.watchers, *more))


#: the plan of a fit that keeps nothing beyond the record
RECORD_ONLY = FitPlan()
