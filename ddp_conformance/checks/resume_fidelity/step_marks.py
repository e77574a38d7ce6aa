"""What a fit held at given optimizer steps: the watchers resume_fidelity's fits carry.

resume_fidelity compares a resumed run with the uninterrupted one step by step (`StepDigests`), reads
the state a checkpoint at step k holds without stopping the fit there (`SnapshotAt`), and ends a
resume early once it has parted from the parameters the uninterrupted run had a few steps after k
(`ParamsAt`). The probe and the uninterrupted fit are shared (`support/shared_fit.py`): they carry these
through `checks.PROBE_READERS` and `checks.LONG_FIT_READERS` (`long_fit_watchers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...resumable import capture_rng_state
from ..support.digests import step_digest
from ..support.fit_record import FitRecord
from ..support.fit_watch import FitWatcher
from ..support.observe import buffer_names, trainer_name, unwrapped
from ..support.parting import STEPS as PARTING_STEPS

#: the parameters are digested after each of the first optimizer steps, no more
DIGESTED_STEPS = 64


class StepDigests(FitWatcher):
    """A digest of the parameters after each of the fit's first DIGESTED_STEPS optimizer steps (every
    optimizer's step: two optimizers an iteration give two)."""

    def __init__(self) -> None:
        self.digests: list[str] = []

    def on_step(self, record: FitRecord) -> None:
        if record.model is not None and len(self.digests) < DIGESTED_STEPS:
            self.digests.append(step_digest([p.detach() for p in record.model.parameters()]))


@dataclass
class StepSnapshot:
    """Where a fit stood right after training step `step`: what a checkpoint written there holds, read
    without stopping the fit there. Steps are counted by the first optimizer that stepped, and the
    snapshot is taken again after every other optimizer's step in the same iteration (a Muon beside an
    AdamW), so it holds the iteration's end."""

    step: int
    micro_batches: int  # the fit's micro-batches up to and including that step's
    state: dict[str, Any] = field(repr=False)  # the model's state_dict, CPU copies, as the trainer names it
    buffer_names: list[str] = field(default_factory=list)
    rng: dict[str, Any] = field(default_factory=dict, repr=False)  # the process's RNGs (`capture_rng_state`)


class SnapshotAt(FitWatcher):
    """The fit's state right after training step `step` (`StepSnapshot`)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.snapshot: StepSnapshot | None = None

    def on_step(self, record: FitRecord) -> None:
        if record.iterations == self.step and record.model is not None:
            model = unwrapped(record.model)
            state = {trainer_name(name): value.detach().cpu().clone() for name, value in model.state_dict().items()}
            self.snapshot = StepSnapshot(self.step, record.micro_batches, state, buffer_names(record.model),
                                         capture_rng_state())


class ParamsAt(FitWatcher):
    """The model's parameters right after optimizer step `step` (CPU copies, as the trainer names them): what
    another fit's parameters at the same step are compared with, within a tolerance."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.params: dict[str, Any] | None = None

    def on_step(self, record: FitRecord) -> None:
        if record.iterations == self.step and record.model is not None:
            self.params = {trainer_name(name): p.detach().cpu().clone()
                           for name, p in unwrapped(record.model).named_parameters()}


def long_fit_watchers(k: int, n: int, checkpoint_at: int | None) -> tuple[Callable[[], FitWatcher], ...]:
    """What the uninterrupted fit to n carries for resume_fidelity: the parameters after each step, the state at
    the checkpoint step where the fit writes it (read without stopping there), and the parameters
    `parting.STEPS` after k (where a resume that parted for good stops early)."""
    watchers: list[Callable[[], FitWatcher]] = [StepDigests]
    if checkpoint_at is not None:
        watchers.append(functools.partial(SnapshotAt, checkpoint_at))
    if k + PARTING_STEPS <= n:
        watchers.append(functools.partial(ParamsAt, k + PARTING_STEPS))
    return tuple(watchers)


def step_digests(record: FitRecord) -> list[str]:
    """The record's `StepDigests` ([] where the fit had none)."""
    watcher = record.watched(StepDigests)
    return watcher.digests if watcher is not None else []


def snapshot_of(record: FitRecord) -> StepSnapshot | None:
    watcher = record.watched(SnapshotAt)
    return watcher.snapshot if watcher is not None else None


def kept_params(record: FitRecord) -> dict[str, Any] | None:
    watcher = record.watched(ParamsAt)
    return watcher.params if watcher is not None else None
