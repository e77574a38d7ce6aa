"""The fits several checks judge, each run once per trainer, configuration and group, and kept in the
rank's process for the session.

Both checks watch one long fit from scratch: sampler_disjointness the indices its training loader drew
over three whole epochs, resume_fidelity its final state (the run a resume must reproduce), the ranks'
parameters after each step, and whether it trained at all. Each also needs the one-step probe fit that
measures an epoch. Run apart, those were two probes and two long fits (3E + 1 and 2.5E + 1 steps) and
a third fit that stopped at resume_fidelity's checkpoint step k. Now the first of the two checks to run
fits once to the horizon both need, `max(n, 3E + 1)`, writing the checkpoint at k on the way wherever
the trainer writes it there and nowhere else (`TrainerAdapter.checkpoints_once`), and the other check
reads what the recorder saw.

The probe also serves the checks that read the fit's start (initial_sync, sync_batchnorm,
bucket_view_memory's fit flag). A third fit, `steady`, runs `STEADY_STEPS` with dropout 0: the side
that stays as configured where a check runs the fit again with one setting changed
(bucket_cap_mb_invariance, static_graph), the fit whose first optimizer step gradient_equivalence
recomputes, and, where the config has no dropout (the steady fit is then the configured fit),
rank_participation's.

Evidence is reused only where it is the same fit (`session_evidence.py` keeps it):
- its key is the SPEC as given (with its base), the config the fit ran with, the epoch length and
  checkpoint cadence it was planned from, and the group's size, backend and device: another trainer
  or configuration never matches;
- it lives in this rank's process, so a rebuilt pool (fresh rank processes) starts with none;
- `session_evidence.forget()` drops all of it after a fit that raised or hung on this rank (`guarded_fit`) and after a
  check's own error (`run_check`), since those may leave the process (RNG, files, a half-built trainer)
  unlike a fresh one; a failed verdict from fits that ended normally does not;
- it is reused only when every rank holds it (gathered): ranks that disagreed would run different
  collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from ...adapter import NotProvided, TrainerAdapter, TrainState
from ...config import RunConfig
from ...plan import STEADY_STEPS, plan_steps
from . import lr_trail
from .check_context import CheckContext, all_gather
from .first_steps import without_dropout
from .fit_record import FitRecord
from .fit_watch import FitPlan
from .progress import Progress, epoch_steps, guarded_fit
from .session_evidence import kept_or_run
from .vacuity import TrainingEvidence

#: the dropout the shared fit's config gets when it has none, so that a lost RNG state shows in a resume
FORCED_DROPOUT = 0.1
#: what each check that asked for evidence says it did, under its figures' "shared_fits"
FIGURE = "shared_fits"
#: optimizer steps an epoch is taken to have where neither the fit's loader nor `make_loader` has a length
FALLBACK_EPOCH_STEPS = 8

_Evidence = TypeVar("_Evidence")


@dataclass(frozen=True)
class Probe:
    """The one-step fit that measures the training loader (its passes' lengths, micro-batches a step)."""

    record: FitRecord
    ran_in: str


@dataclass(frozen=True)
class Steady:
    """A few steps of the config's own fit with dropout 0, from scratch: the side that stays as
    configured when a check changes one setting, and the fit whose first step gradient_equivalence
    recomputes."""

    record: FitRecord  # with its first optimizer step's gradients (`fit_record.FirstStep`)
    state: TrainState
    progress: list[Progress]  # every rank's, with `TrainingEvidence.figures` as its extra
    names: list[str] | None  # the trained model's parameter names (`TrainingEvidence.names`)
    ran_in: str


@dataclass(frozen=True)
class ObservedFit:
    """One uninterrupted fit from scratch to `horizon` steps, as every rank's recorder saw it."""

    config: RunConfig  # what it ran with (dropout forced on)
    cadence: int | str | None  # the trainer's `checkpoint_every`, which k was planned from
    epoch_steps: int
    checkpoint_step: int  # k: resume_fidelity's checkpoint
    horizon: int  # its steps: resume_fidelity's n, and one step past sampler_disjointness's whole epochs
    record: FitRecord
    state: TrainState
    progress: list[Progress]  # every rank's, with its TrainingEvidence under extra["evidence"]
    checkpoint_dir: Path | None  # this rank's own directory, holding the checkpoint at k; None: it wrote none
    ran_in: str
    refused: NotProvided | None = None  # why the trainer could not checkpoint at k in this fit


def fit_config(ctx: CheckContext) -> RunConfig:
    """The config the shared fits run with: dropout forced on when the config has none, so that a lost
    RNG state shows in resume_fidelity's weights."""
    config = ctx.config
    if config.model.dropout != 0:
        return config
    ctx.config_note(f"config model.dropout 0 raised to {FORCED_DROPOUT} for the fit sampler_disjointness and "
                    "resume_fidelity share, so that a lost RNG state shows (a trainer that ignores the config's "
                    "model section keeps its own model)")
    return replace(config, model=replace(config.model, dropout=FORCED_DROPOUT))


def epoch_length(ctx: CheckContext, probe: FitRecord) -> int:
    """Optimizer steps per epoch of the real training loader (the one-step probe fit's), else of
    `make_loader`, else an assumption the notes state."""

    observed = epoch_steps(ctx, probe, lengths_are_mine=False)
    if observed is not None:
        return observed
    adapter = ctx.adapter()
    try:
        loader = adapter.make_loader(adapter.make_dataset(), rank=ctx.rank, world_size=ctx.world_size, epoch=0)
        batches: int | None = len(loader)
    except (NotProvided, TypeError):
        batches = None
    lengths = all_gather(batches)  # one plan on every rank: ranks that planned other k and n would fit apart
    if None in lengths:
        ctx.note(f"epoch length unknown (the fit's loader and make_loader have no length): assumed "
                 f"{FALLBACK_EPOCH_STEPS} steps")
        return FALLBACK_EPOCH_STEPS
    return max(1, math.ceil(max(lengths) / ctx.config.trainer.accumulate_grad_batches))


def probe(ctx: CheckContext) -> FitRecord:
    """The one-step probe fit's record (as `ctx.recordings["probe"]`), run here unless held."""
    config = fit_config(ctx)

    def run() -> Probe:
        guarded_fit(ctx, "probe", 1, lambda obs: _adapter(ctx, config).fit(1, observer=obs),
                    FitPlan(watchers=ctx.probe_watchers))
        return Probe(ctx.recordings["probe"], ctx.check_id)

    held = held_or_run(ctx, "probe", evidence_key(ctx, config, "probe"), run)
    ctx.recordings["probe"] = held.record
    return held.record


def steady_config(ctx: CheckContext) -> RunConfig:
    """The run's config with dropout 0, so that two fits differ by the setting a check changes alone."""
    return ctx.config if ctx.config.model.dropout == 0 else without_dropout(ctx.config)


def steady(ctx: CheckContext) -> Steady:
    """`STEADY_STEPS` of the dropout-free fit (as `ctx.recordings["steady"]`), run here unless held."""
    config = steady_config(ctx)

    def run() -> Steady:
        evidence = TrainingEvidence()
        state, progress = guarded_fit(
            ctx, "steady", STEADY_STEPS, lambda obs: _adapter(ctx, config).fit(STEADY_STEPS, observer=obs),
            FitPlan(first_step=True, keep_batches=True), evidence)  # keep_batches: is make_dataset() what it read?
        assert isinstance(state, TrainState)
        return Steady(ctx.recordings["steady"], state, progress, evidence.names, ctx.check_id)

    held = held_or_run(ctx, "steady", evidence_key(ctx, config, "steady", STEADY_STEPS), run)
    ctx.recordings["steady"] = held.record
    return held


def observed_fit(ctx: CheckContext, epoch: int) -> ObservedFit:
    """The uninterrupted fit to `plan_steps`' n for an epoch of `epoch` steps (as
    `ctx.recordings["uninterrupted"]`), run here unless held."""
    config = fit_config(ctx)
    adapter = ctx.factory()
    cadence = getattr(adapter, "checkpoint_every", None)
    k, n = planned_horizon(ctx, epoch, cadence)
    own_dir = ctx.workdir / "ckpt" / f"rank{ctx.rank}" if _checkpoints_on_the_way(adapter) else None

    def run() -> ObservedFit:
        try:
            return fit(own_dir)
        except NotProvided as refused:  # a trainer that cannot checkpoint at k: its fit still serves the others
            if own_dir is None:
                raise
            return replace(fit(None), refused=refused)

    def fit(checkpoint_dir: Path | None) -> ObservedFit:
        evidence = TrainingEvidence()

        at = k if checkpoint_dir is not None else None
        if checkpoint_dir is not None:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        with lr_trail.watching() as rates:  # a schedule set by the total steps, told from an unreproducible fit
            state, progress = guarded_fit(
                ctx, "uninterrupted", n, lambda obs: _adapter(ctx, config).fit(
                    n, checkpoint_dir=checkpoint_dir, checkpoint_at=at, observer=obs),
                _long_fit_plan(ctx, k, n, at), evidence)
        lr_trail.remember(ctx.recordings["uninterrupted"], rates)
        return ObservedFit(config, cadence, epoch, k, n, ctx.recordings["uninterrupted"], state, progress,
                           checkpoint_dir, ctx.check_id)

    held = held_or_run(ctx, "uninterrupted", evidence_key(ctx, config, "uninterrupted", epoch, cadence), run)
    ctx.recordings["uninterrupted"] = held.record
    return held


def _long_fit_plan(ctx: CheckContext, k: int, n: int, checkpoint_at: int | None) -> FitPlan:
    """What the uninterrupted fit keeps: every micro-batch's inputs (what a resume is compared with), and what its
    readers' watchers record, planned from k, n and where it checkpoints (`checks.LONG_FIT_READERS`)."""
    watchers = tuple(make for plan in ctx.long_fit_watchers for make in plan(k, n, checkpoint_at))
    return FitPlan(all_inputs=True, watchers=watchers)


def planned_horizon(ctx: CheckContext, epoch: int, cadence: int | str | None) -> tuple[int, int]:
    """`plan_steps`' (k, n), under the check's figures' "plan" with the epoch they were planned from: what its
    fits of k, n and n - k steps are held to (`ddp_conformance.plan`)."""
    k, n = plan_steps(epoch, cadence)
    ctx.figures["plan"] = {"epoch_steps": epoch, "k": k, "n": n}
    return k, n


def _adapter(ctx: CheckContext, config: RunConfig) -> TrainerAdapter:
    # the run's own config goes through `ctx.adapter()`, whose setup failure fails every check alike
    return ctx.adapter() if config is ctx.config else ctx.adapter(config)


def _checkpoints_on_the_way(adapter: Any) -> bool:
    """Whether the long fit can write resume_fidelity's checkpoint: the trainer resumes, and says it
    writes the checkpoint at k only (a loop that saves every `checkpoint_at` steps, or a script's
    `--save-every {checkpoint_at}`, would write it again at 2k)."""
    resumes = type(adapter).resume is not TrainerAdapter.resume
    return resumes and bool(getattr(adapter, "checkpoints_once", False))


def evidence_key(ctx: CheckContext, config: RunConfig, what: str, *plan: Any) -> tuple[Any, ...]:
    rank_ctx = ctx.rank_ctx
    return (what, ctx.spec.text, str(ctx.spec.base), repr(config), rank_ctx.world_size, rank_ctx.backend,
            rank_ctx.device_type, *plan)


def held_or_run(ctx: CheckContext, label: str, key: tuple[Any, ...], run: Callable[[], _Evidence]) -> _Evidence:
    """The evidence kept under `key` if every rank holds it, else `run()`'s, kept (collective); the
    check's figures say which (`FIGURE`)."""
    evidence, reused = kept_or_run(key, run)
    ctx.figures.setdefault(FIGURE, {})[label] = f"reused from {evidence.ran_in}" if reused else "ran here"
    return evidence
