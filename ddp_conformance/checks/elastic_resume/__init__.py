"""elastic_resume: a checkpoint written at world size W resumes at W/2 and at 2W, continuing the uninterrupted run's
sequence of global batches and ending where it ends.

The guides promise nothing here: a resume "must use the same number of GPUs". So the check applies to a trainer
whose adapter declares `elastic = True` (it keeps the global batch fixed and resumes on any world size); any other
skips, saying what the guides say.

Runs. At the check's world size W, the dropout-free fit from scratch to n steps, writing its checkpoint at k
(`ddp_conformance.plan.plan_steps`: n = 3E + 1, k one batch before the third epoch's end or where the trainer's
checkpoint cadence allows); a trainer that
may write again at 2k (`checkpoints_once` False) writes it in a fit of its own to k. Then rank 0 starts, one after the
other, a group of W/2 ranks (where W > 1) and one of 2W on this host (`resized_groups.py`, through
torch.distributed.elastic), each rank of which resumes a fresh adapter from that checkpoint to n under a recorder
(`resized_rank.py`). Every fit records the dataset indices each micro-batch trained (the adapter's `batch_indices`
on what the loader yielded) and the optimizer step it added to.

Judged per resized group: it finishes (an error names the rank that raised first, and where); it trains n - k steps;
each step's global batch (the union over ranks) is the uninterrupted fit's at that step (`global_batches.py`): a
batch of another size is a per-rank batch that stayed as it was, the batch of another step a data position counted
in units of the world size, anything else another order; and its final parameters and buffers match the
uninterrupted fit's within `TOLERANCE` (the world size changes the summation order of the gradient average), unless
the model has BatchNorm layers that normalise by each rank's batch (no SyncBatchNorm, as on CPU), whose statistics
change with the per-rank batch by design: then only the global batches are judged, with a note.

Skips, with the reason: no declaration; no `resume`; a backend or device other than gloo on CPU (the resized groups
run there, beside the check's own ranks: 2W GPUs would be needed); ranks on several nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ...adapter import TrainerAdapter, TrainState
from ...config import reconcile
from ..support import shared_fit
from ..support.check_context import CheckContext, all_gather, from_rank_zero, hide_on_verdict, rounded
from ..support.first_steps import final_floats
from ..support.fit_record import FitRecord
from ..support.fit_watch import FitPlan
from ..support.gradients import max_delta
from ..support.progress import guarded_fit
from .global_batches import Parting, first_parting, per_step, unread
from .resized_groups import GroupResult, resume_resized
from .resized_rank import DropoutOff, ResizedJob, unsynced_batchnorm

#: the largest relative difference per tensor between the uninterrupted fit and a resume at another world size that
#: counts as the summation order of the gradient average: measured 1.0e-7 (world size 2 resumed at 1 and 4, the class,
#: Lightning and script controls, CPU, torch 2.13; docs/checks/elastic_resume.md); resume_fidelity's bound on CUDA, as
#: room for a larger model, where AdamW turns the rounding of a gradient near zero into a whole step of another sign.
#: The learning-rate mutant parts by 0.42
TOLERANCE = 1e-4
#: the least and the most time a resized group gets to start its ranks (each imports torch and the trainer) and
#: resume (4x the stall time between): the check's other ranks wait for rank 0 in a collective meanwhile, within the
#: process group's timeout (120 s, `DDP_CONFORMANCE_PG_TIMEOUT`), so both groups together stay below it, with room
#: for a loaded machine (what a group takes: benchmarks/RESULTS.md)
GROUP_SECONDS = (30.0, 45.0)


def resized(world_size: int) -> list[int]:
    """The world sizes a checkpoint written at `world_size` is resumed at: half of it (where there is a half) and
    twice it."""
    return [size for size in (world_size // 2, 2 * world_size) if size >= 1 and size != world_size]


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    adapter = ctx.factory()
    _applies(ctx, adapter)
    probe = shared_fit.probe(ctx)
    epoch = shared_fit.epoch_length(ctx, probe)
    k, n = shared_fit.planned_horizon(ctx, epoch, getattr(adapter, "checkpoint_every", None))
    state, record, checkpoint = _fit_here(ctx, k, n, bool(getattr(adapter, "checkpoints_once", False)))
    gathered = _every_rank_draws(record)
    compare_final = _final_states_tell(ctx, record)
    figures: dict[str, Any] = {"checkpoint_step": k, "steps": n, "world_sizes": resized(ctx.world_size)}
    verdict = None
    if ctx.rank == 0:
        final = final_floats(state) if compare_final else None
        verdict = _judge(ctx, final, per_step(gathered), checkpoint, (k, n, epoch), figures)
    verdict, figures = from_rank_zero((verdict, figures))
    if verdict is not None:
        raise ctx.fail(verdict, **figures)
    figures["summary"] = f"same batches at {' and '.join(map(str, figures['world_sizes']))}"
    return figures


def _every_rank_draws(record: FitRecord) -> list[Any]:
    """Every rank's (step, indices) of the uninterrupted fit (collective); a skip where they cannot be known."""
    gathered = all_gather(record.step_draws())
    if not all(all_gather(bool(record.training_passes()))):
        pytest.skip("the fit trains from no DataLoader (batches drawn some other way, as nanoGPT's torch.randint over "
                    "a token file), so there are no sample indices to follow its global batches by")
    if unread(gathered):
        pytest.skip("the samples each step trains cannot be read: the loader's batch sampler draws no lists of "
                    "indices in the loop's own process (an IterableDataset, or num_workers > 0), and the adapter's "
                    "batch_indices cannot read the batches it yields")
    return gathered


def _final_states_tell(ctx: CheckContext, record: FitRecord) -> bool:
    """Whether a resume at another world size must end where the uninterrupted fit ends (collective); where not, a
    note says why, and the global batches alone are judged."""
    model = getattr(record.model, "module", record.model)
    batchnorm = sorted({name for names in all_gather(unsynced_batchnorm(model) if model is not None else [])
                        for name in names})
    if batchnorm:
        ctx.note(f"the final states are not compared, only the global batches: BatchNorm layers "
                 f"({', '.join(batchnorm[:3])}) normalise by each rank's own batch, which a fixed global batch splits "
                 "differently at each world size")
        return False
    if not any(all_gather(record.nonzero_grad_steps > 0)):
        ctx.note("the final states are not compared, only the global batches: the fit never changes the model (every "
                 "gradient is exactly zero; rank_participation fails it), so any resume would end where it ends")
        return False
    return True


def _applies(ctx: CheckContext, adapter: TrainerAdapter) -> None:
    if not getattr(adapter, "elastic", False):
        pytest.skip("the trainer does not declare that it resumes at another world size (`elastic = True` on its "
                    "adapter): as the guides say, a resume needs the number of GPUs the checkpoint was written with")
    if type(adapter).resume is TrainerAdapter.resume:
        pytest.skip("the trainer declares an elastic resume, but its adapter has no `resume`")
    rank_ctx = ctx.rank_ctx
    if rank_ctx.backend != "gloo" or rank_ctx.device_type != "cpu":
        pytest.skip(f"the resized groups run with gloo on CPU, beside the check's own ranks, and this run is "
                    f"{rank_ctx.backend} on {rank_ctx.device_type} (a group of {2 * rank_ctx.world_size} would need as "
                    "many GPUs again)")
    if rank_ctx.num_nodes > 1:
        pytest.skip("the resized groups run on rank 0's host, and this group spans several nodes")
    ctx.require_shared_workdir()


def _fit_here(ctx: CheckContext, k: int, n: int, once: bool) -> tuple[TrainState, FitRecord, str]:
    """The uninterrupted fit to n at this world size: its state, what this rank's recorder saw, and rank 0's
    checkpoint at k."""
    config = shared_fit.steady_config(ctx)
    own_dir = ctx.workdir / "ckpt" / f"rank{ctx.rank}"
    own_dir.mkdir(parents=True, exist_ok=True)
    writer = ctx.adapter(config)
    if not once:  # a trainer that may save again at 2k writes the checkpoint at k in a fit that ends there
        guarded_fit(ctx, "elastic-checkpoint", k, lambda obs: writer.fit(k, checkpoint_dir=own_dir, checkpoint_at=k,
                                                                         observer=obs), inner=DropoutOff())
        writer = ctx.adapter(config)
    at = k if once else None
    fitter = writer
    state, _ = guarded_fit(ctx, "elastic-uninterrupted", n, lambda obs: fitter.fit(
        n, checkpoint_dir=own_dir if once else None, checkpoint_at=at, observer=obs),
        FitPlan(draws=fitter.batch_indices), DropoutOff())
    record = ctx.recordings["elastic-uninterrupted"]
    files = sorted(own_dir.iterdir(), key=lambda path: path.stat().st_mtime) if ctx.rank == 0 else []
    written = str(state.checkpoint) if state.checkpoint is not None else (str(files[-1]) if files else "")
    checkpoint = from_rank_zero(written)
    if not checkpoint:  # resume_fidelity's verdict
        pytest.skip(f"the fit was asked for a checkpoint at step {k} and wrote none in its checkpoint_dir, so there is "
                    "nothing to resume at another world size (resume_fidelity judges the checkpoint)")
    return state, record, checkpoint


@dataclass(frozen=True)
class Shifted:
    """A resized group trained another step's global batch: judged once every group has been seen, since a shift
    the same at every world size is no matter of the world size."""

    size: int
    head: str
    step: int
    shift: int


def _judge(ctx: CheckContext, final: dict[str, Any] | None, expected: dict[int, list[int]], checkpoint: str,
           plan: tuple[int, int, int], figures: dict[str, Any]) -> str | None:
    """Rank 0: resume at each other world size; the first verdict, or None. `final`: the uninterrupted fit's
    final parameters, where they tell a resize's apart (`_final_states_tell`), else None."""
    k, n, epoch = plan
    shifted: list[Shifted] = []
    seconds = min(GROUP_SECONDS[1], max(GROUP_SECONDS[0], 4 * ctx.stall_after))
    for size in resized(ctx.world_size):
        config, _ = reconcile(shared_fit.steady_config(ctx), world_size=size, backend="gloo", device_type="cpu",
                              num_nodes=1)  # the config a run at that world size gets
        job = ResizedJob(spec=ctx.spec, config=config, checkpoint=Path(checkpoint), steps=n, world_size=size,
                         host="", port=0, workdir=ctx.workdir, seconds=seconds)  # what the fit left there too
        with ctx.training(n - k):
            group = resume_resized(job, ctx.workdir / "logs" / f"ws{size}")
        head = (f"resumed at world size {size} from the checkpoint written at world size {ctx.world_size} after "
                f"step {k}")
        found = _group_verdict(group, head, expected, final, (k, n), figures)
        if isinstance(found, str):
            return found
        if found is not None:
            shifted.append(found)
    return _shift_verdict(shifted, len(resized(ctx.world_size)), epoch) if shifted else None


def _group_verdict(group: GroupResult, head: str, expected: dict[int, list[int]], final: dict[str, Any] | None,
                   plan: tuple[int, int], figures: dict[str, Any]) -> str | Shifted | None:
    k, n = plan
    size = group.world_size
    if group.failed is not None:
        rank, message = group.failed
        verb = "raises" if group.raised else "ends"
        return f"resuming at world size {size} {verb} on rank {rank}: {message}; {head} (logs: {group.logs})"
    if group.timed_out or len(group.answers) != size:
        return (f"resuming at world size {size} never ends: the group did not finish within {group.seconds:.0f} s "
                f"(logs: {group.logs}); {head}")
    answers = [group.answers[rank] for rank in range(size)]
    steps = answers[0].steps
    figures[f"ws{size}_steps"] = steps
    if steps != n - k:
        return (f"the resumed run does not reach step {n} at world size {size}: {head}, it trains {steps} steps where "
                f"{n - k} remain")
    got = per_step([answer.draws for answer in answers], offset=k)
    parting = first_parting(expected, got, range(k + 1, n + 1)) if not unread(a.draws for a in answers) else None
    if parting is not None:
        if parting.shift and not parting.sizes_differ:
            return Shifted(size, head, parting.step, parting.shift)
        return _batch_verdict(parting, head, size, answers[0].draws)
    if final is None or answers[0].final is None:
        return None
    name, delta, scale = max_delta(answers[0].final, final)
    relative = delta / scale if scale else 0.0
    figures[f"ws{size}_max_rel_delta"] = relative
    if relative <= TOLERANCE:
        return None
    return (f"the resumed run's update depends on the world size: {head}, every step trains the uninterrupted fit's "
            f"global batch, yet after step {n} {name} differs by {rounded(relative)} of its largest value (the "
            f"summation order across world sizes allows {rounded(TOLERANCE)}): a learning rate, loss or gradient "
            "scaled by the world size?")


def _batch_verdict(parting: Parting, head: str, size: int, draws: list[Any]) -> str:
    step = parting.step
    if parting.sizes_differ:
        per_rank = len(draws[0][1] or []) if draws else 0
        return (f"the global batch changes with the world size: {head}, step {step} trains {len(parting.got)} samples "
                f"where the uninterrupted fit's trained {len(parting.expected)} ({per_rank} a rank at world size "
                f"{size}), so the resumed run follows another schedule. Keep the global batch fixed: per-rank batch = "
                "global batch / world size")
    return (f"the resumed run does not continue the epoch's order at world size {size}: {head}, step {step} trains "
            f"{parting.unlike()} of its {len(parting.got)} samples outside the uninterrupted fit's step {step}")


def _shift_verdict(shifted: list[Shifted], groups: int, epoch: int) -> str:
    """A position restored off: in units of the world size where the shift differs between world sizes, a place lost
    at any world size where it is the same at each (or, with one group to tell by, a whole number of epochs)."""
    first = shifted[0]
    steps = abs(first.shift)
    epochs = f", {steps // epoch} epoch{'s' if steps // epoch > 1 else ''}" if steps % epoch == 0 else ""
    where = (f"{first.head}, step {first.step} trains the samples of the uninterrupted fit's step "
             f"{first.step + first.shift} ({steps} steps {'ahead' if first.shift > 0 else 'behind'}{epochs})")
    alike = len(shifted) == groups and len({found.shift for found in shifted}) == 1
    if alike and (groups > 1 or first.shift % epoch == 0):
        sizes = " and ".join(str(found.size) for found in shifted)
        return (f"the resume loses its place in the data whatever the world size: {where}, the same at world size "
                f"{sizes}: a step or epoch counter restored off, not the world size's doing (resume_fidelity judges "
                "the resume at the world size the checkpoint was written at)")
    return (f"the data position is restored in units that change with the world size: {where}. Count the position "
            "in global samples or optimizer steps, not in one rank's")
