"""rank_participation: every rank runs the same number (> 0) of forward/backward steps and takes part
in the gradient all-reduce.

Evidence, all from one short fit of the trainer (`fit(STEPS)`): where the config has no dropout, the
dropout-free fit other checks share (`shared_fit.steady`), which is then the configured fit:
- steps: counted per rank from the fit's own forwards (`observe.FitRecorder`), written to progress
  files outside the process group (`progress.py`), so a rank that stops training is named with the
  step where it stopped even though the others hang in the all-reduce;
- all-reduce participation: after the fit the ranks' *parameters* (not buffers: BatchNorm running
  stats are per rank by design) are bit-identical although each rank trained on its own shard. That
  is every tensor the fit's optimizers stepped, not only the model's: a learnable loss temperature
  handed to the optimizer beside the DDP model is never all-reduced, and drifts per rank while the
  model itself stays in sync.
  Parameters can only stay identical on different data if every rank's gradients were averaged
  with every other's on every step. This is behavioural, so it holds for Lightning too (which
  ignores comm hooks on CPU) and for trainers that all-reduce by hand instead of using DDP.
- that there was training to take part in (`vacuity.py`): ranks that never change the model (every
  gradient exactly zero, parameters as initialised, a constant loss) are trivially "in sync";
- that every rank adds to it: the gradients each rank's own backward computes, seen by a hook on
  every parameter before DDP averages them. A rank whose loss is multiplied by 0 runs every step and
  keeps its parameters identical, yet the model learns from the other ranks' data alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from .. import plan
from ..adapter import TrainState
from ..runner.ranks import ranks_label
from .support import shared_fit
from .support.adapter_errors import AdapterError
from .support.check_context import CheckContext, all_gather, hide_on_verdict, rounded
from .support.fit_record import FitRecord
from .support.model_state import OUTSIDE, drifted, trained
from .support.progress import PeerFitFailed, Progress, guarded_fit
from .support.replica_watch import ReplicaTrail, frozen_changers, modes_apart
from .support.vacuity import TrainingEvidence, silent_ranks, vacuity_verdict

STEPS = shared_fit.STEADY_STEPS


def _fit(ctx: CheckContext) -> tuple[TrainState, list[Progress], FitRecord | None, list[str] | None]:
    """The configured fit of STEPS: its final state on this rank, every rank's progress (with
    `TrainingEvidence.figures`), its record, and the parameter names of the model it trains."""
    if shared_fit.steady_config(ctx) is ctx.config:
        steady = shared_fit.steady(ctx)
        return steady.state, steady.progress, steady.record, steady.names
    adapter, capture = ctx.adapter(), TrainingEvidence()
    state, progress = guarded_fit(ctx, "fit", STEPS, lambda obs: adapter.fit(STEPS, observer=obs), inner=capture)
    return state, progress, ctx.recordings.get("fit"), capture.names


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    ctx.require_shared_workdir()
    state, progress, record, names = _fit(ctx)
    micro = [p.finished for p in progress]
    steps = [p.extra.get("global_step") for p in progress]
    wrapped, is_ddp = progress[0].wrapped_type or "unknown", progress[0].is_ddp
    figures: dict[str, Any] = {"micro_batches_per_rank": micro, "optimizer_steps_per_rank": steps,
                               "wrapped_type": wrapped}
    if not any(micro):
        if any(steps):
            pytest.skip(f"trainer {ctx.spec.text}: its fit took {steps[0]} optimizer steps but no training forward "
                        "of a module was seen (is the model called as model.forward(x) instead of model(x)?), so "
                        "per-rank steps cannot be observed")
        raise ctx.fail(f"no rank ran a forward/backward step: fit({STEPS}) returned without training", **figures)
    idle = [r for r, m in enumerate(micro) if m == 0]
    if idle:
        raise ctx.fail(f"{ranks_label(idle)} ran no forward/backward step while the others ran {max(micro)}: "
                       "those ranks skip training", **figures)
    if len(set(micro)) > 1:
        low = [r for r, m in enumerate(micro) if m == min(micro)]
        raise ctx.fail(f"{ranks_label(low)} ran {min(micro)} forward/backward micro-batches where others ran "
                       f"{max(micro)} (per rank: {micro}): the ranks do not train the same steps", **figures)
    trails = all_gather(record.replicas if record is not None else ReplicaTrail())
    apart = modes_apart(trails)
    if apart:
        raise ctx.fail(apart[1], **figures)
    losses = [p.extra.get("losses", []) for p in progress]
    # None where a rank reported no losses (a script: SPEC, an adapter that passes none): not the same losses
    figures["losses_differ_between_ranks"] = len({tuple(x) for x in losses}) > 1 if all(losses) else None
    digests = {p.extra.get("digest") for p in progress}
    drift, local = drifted([p.extra.get("outside") or {} for p in progress])
    if local:
        ctx.note(f"{len(local)} tensor(s) the optimizer steps outside the model start different on each rank "
                 f"(rank-local by design, a model-parallel shard?), so they are not compared ({local[0]})")
    figures["params_identical"] = len(digests) == 1 and not drift
    if not figures["params_identical"]:
        mine = trained(state.params, record, names, drift)
        bypassed = any(p.extra.get("bypassed_ddp") for p in progress)
        raise ctx.fail(_divergence(mine, wrapped, is_ddp, micro[0], bypassed, trails), **figures)
    evidence = [p.extra.get("evidence") for p in progress]
    figures["nonzero_gradient_steps_per_rank"] = [e["nonzero_grad_steps"] if e else None for e in evidence]
    vacuous = vacuity_verdict(evidence, f"fit({STEPS})")
    if vacuous:
        raise ctx.fail(vacuous, **figures)
    silent = silent_ranks(evidence)
    if silent:
        raise ctx.fail(_silent_verdict(silent, micro[0]), **figures)
    if not figures["losses_differ_between_ranks"] and ctx.world_size > 1:
        if is_ddp is False:
            raise ctx.fail(f"the model is not wrapped in DistributedDataParallel (the trainer trains a {wrapped}): "
                           "the ranks' parameters agree only because every rank saw the same data", **figures)
        if is_ddp is None:
            pytest.skip("every rank saw the same data and no training forward of the model was seen: "
                        "identical parameters cannot prove the all-reduce here; see sampler_disjointness")
        if figures["losses_differ_between_ranks"] is False:
            ctx.note("every rank saw the same losses (the same data?): identical parameters do not prove the "
                     "all-reduce here; see sampler_disjointness")
    _through_an_epoch_end(ctx, figures)
    figures["summary"] = f"{micro[0]} fwd/bwd/rank, in sync"
    return figures


def _through_an_epoch_end(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """Watch the long fit sampler_disjointness and resume_fidelity share (`shared_fit.observed_fit`: past an epoch
    end and resume_fidelity's checkpoint, where the epoch is one the suite trains whole), run here first, so that a
    rank that parts from the others there (an evaluation, a log or a save on one rank alone, an early stop) hangs in
    this check, the one that owns hangs, and every later check of the trainer skips naming it (`suite/unbuilt.py`). Its
    other failures are the checks' that read the fit: they run it again and say so."""
    __tracebackhide__ = hide_on_verdict
    probe = shared_fit.probe(ctx)
    passes = probe.training_passes()
    lengths = all_gather(passes[0].length if passes else None)
    if None in lengths or len(set(lengths)) > 1:
        ctx.note("the fit was watched for hangs over its first steps only: "
                 + ("its training loader has no length, so it has no epoch end to reach" if None in lengths else
                    f"the ranks' training loaders differ in length ({lengths} batches: sampler_disjointness judges "
                    "it)"))
        return
    epoch = shared_fit.epoch_length(ctx, probe)
    try:
        observed = shared_fit.observed_fit(ctx, epoch)
    except pytest.skip.Exception as exc:  # --ddp-max-steps: the judgement above stands, without the watch
        ctx.note(f"the fit was watched for hangs over its first steps only: {exc.msg}")
        return
    except (AdapterError, PeerFitFailed) as exc:
        ctx.note(f"the long fit raised ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): the checks "
                 "that read it judge it")
        return
    figures["watched_steps"] = observed.horizon
    if not plan.whole_epochs(epoch):
        ctx.note(f"an epoch is {epoch} optimizer steps, longer than the {plan.LONG_EPOCH_STEPS} the suite trains "
                 f"whole: the fit watched for hangs ends at step {observed.horizon}, inside the first epoch, so a hang "
                 "at an epoch end is not watched for")


def _silent_verdict(silent: list[int], micro: int) -> str:
    one = len(silent) == 1
    its, that = ("its", "that rank") if one else ("their", "those ranks")
    return (f"{ranks_label(silent)} {'trains' if one else 'train'} but {'adds' if one else 'add'} nothing: every "
            f"gradient {its} own backward computed in {micro} micro-batches is exactly zero, while the other ranks' "
            f"are not, so DDP averages in zeros for {its} samples and the model learns from the other ranks' data "
            f"alone (a loss multiplied by 0, masked or replaced on {that}?)")


def _divergence(mine: dict[str, Any], wrapped: str, is_ddp: bool | None, micro: int, bypassed: bool = False,
                trails: list[ReplicaTrail] | None = None) -> str:
    """Which trained tensor differs most between ranks, and why (collective: every rank is done)."""
    everyone = all_gather({k: v.detach().cpu() for k, v in mine.items()})
    deltas = {name: max((_delta(tensor, other.get(name)) for other in everyone[1:]), default=0.0)
              for name, tensor in everyone[0].items()}
    worst = max(deltas, key=lambda name: deltas[name])
    where = f"{worst.removeprefix(OUTSIDE)} max |delta| {rounded(deltas[worst])}"
    inside = [name for name, d in deltas.items() if d and not name.startswith(OUTSIDE)]
    differing = {name for name, d in deltas.items() if d}
    if inside and differing <= {name for trail in trails or [] for name in trail.frozen_names}:
        frozen = frozen_changers(trails or [], differing)
        return (f"the ranks' models part after {micro} micro-batches ({where}) while every parameter that gets a "
                f"gradient agrees: {frozen}. DDP all-reduces gradients and never touches parameters that get none "
                "after it is built: an EMA or teacher copy updated on one rank only (under `if rank == 0`?) trains "
                "the ranks against different targets; update it on every rank alike")
    if worst.startswith(OUTSIDE) and not inside:
        return (f"a parameter the optimizer steps outside the DistributedDataParallel model differs between ranks "
                f"after {micro} micro-batches ({where}), while the model's own parameters agree: not every gradient "
                "is all-reduced, since DDP averages only the gradients of the modules it wraps (make it part of the "
                "wrapped model, e.g. a learnable loss temperature, wrap its module in DDP too, or all-reduce its "
                "gradient yourself)")
    if is_ddp is False and bypassed:
        return (f"the fit wraps the model in DistributedDataParallel but runs its forward through the wrapped "
                f"{wrapped} (model.module(x) instead of model(x)): DDP's forward never readies its reducer, so "
                f"gradients are never all-reduced, and after {micro} micro-batches the ranks' parameters differ "
                f"({where})")
    if is_ddp is False:
        return (f"the model is not wrapped in DistributedDataParallel (the trainer trains a {wrapped}): gradients are "
                f"never all-reduced, and after {micro} micro-batches the ranks' parameters differ ({where})")
    return (f"the ranks' parameters differ after {micro} micro-batches ({where}): not every gradient is all-reduced "
            "(no_sync left on, or gradients changed after the all-reduce)"
            + ("" if is_ddp else "; the fit never reported its wrapped model, so DDP wrapping is unknown"))


def _delta(tensor: Any, other: Any) -> float:
    """max |a - b| of one tensor on two ranks; inf where one rank lacks it or its shape differs."""
    if other is None or other.shape != tensor.shape:
        return float("inf")
    return float((tensor.double() - other.double()).abs().max()) if tensor.numel() else 0.0
