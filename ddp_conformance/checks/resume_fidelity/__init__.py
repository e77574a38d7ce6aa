"""resume_fidelity: a run checkpointed at step k and resumed in a fresh trainer, with its RNG
deliberately disturbed, ends at step n exactly where an uninterrupted run ends: parameters,
optimizer state, scheduler state and counters (bitwise on CPU with up to 2 ranks, within 1e-4
relative beyond: see `tolerance`); and only rank 0 wrote checkpoint files.

Steps. E = optimizer steps in one epoch of the real training loader (a one-step probe fit); n = 3E + 1 and k
lies past the first epoch (one batch before the third epoch's end, 3E - 1, or where the adapter's declared
`checkpoint_every` allows: "epoch" or every N steps, with n at least k + E), so a resume that restores the
position but not the epoch shows and the resumed part crosses an epoch boundary (`plan.plan_steps`).
Runs, each a guarded fit
(`progress.py`, so a hang is named, not waited out): F = fit(n) writing its checkpoint at k on the
way, the fit sampler_disjointness judges too (`support/shared_fit.py`: run once for both); R =
resume(F's checkpoint, n) on a fresh adapter after reseeding every RNG to a rank-specific value (a
restart never inherits the RNG). The model gets dropout 0.1 if the config has none, otherwise a
missing RNG state could not show. F's recorder keeps its state and RNG right after step k
(`step_marks.StepSnapshot`), which the diagnosis of a resume that differs reads. A trainer whose `k` is
an interval it may save at again (`checkpoints_once` False, the default; every `script:` SPEC) checkpoints in
a fit of its own, P = fit(k), whose state and RNG the diagnosis reads.

Who wrote the checkpoint: every rank passes its *own* directory as `checkpoint_dir`
(`ckpt/rank<r>`). A file can only appear under `ckpt/rank1` if rank 1's process wrote it, so after
the fit each rank lists its own directory and anything outside rank 0's is a write by another
rank. The resume then reads rank 0's file on every rank. (A trainer that ignores checkpoint_dir
and writes elsewhere is reported as such; one that broadcasts rank 0's path and writes it on all
ranks would land in rank 0's directory and is not told apart: a limit of watching directories.)

The uninterrupted fit runs far past rank_participation's few steps, across epoch boundaries: the
ranks' parameters must stay identical after each of its steps (a `no_sync` that also wraps an
epoch's last short accumulation window, parameters unfrozen after DDP was built, part them later).

Before anything is compared, the uninterrupted fit must have trained (`vacuity.py`): a fit whose
gradients are all exactly zero resumes "bitwise" whatever its checkpoint holds, so the check skips,
naming rank_participation, whose verdict a fit that never trains is; and two fits from scratch
(the probe and F; P and F up to k) must agree (the recorder digests the parameters after every
step), or the fit is not reproducible and no resume can be judged. A resumed fit whose first batch draws from the
RNG a fresh fit starts with has re-seeded on start, which is named as such.

Diagnosis: every cause the evidence tells apart, each on the ranks that have it (each rank compares
its own resumed state with its own uninterrupted one: a resume where only rank 0 loads the optimizer is
named on the other ranks). From the states: counters (a lost global step alone, as everything follows
from it); the weights the resumed trainer starts its first step with (captured by the observer)
differ from the checkpointed ones (`module.` keys in the file named when present); optimizer;
scheduler (by its own counters, so a lost one is told from a lost optimizer). Alone: only buffers
differ (every parameter matches: BatchNorm statistics not checkpointed), or a rank's buffers lost
with DDP's buffer sync off. Then the RNG (CPU, and CUDA where it is in use), where the trainer draws from
it while it trains (not counting a DataLoader's own seed draws as it begins a pass): the state the resumed run's first
micro-batch began with, against the uninterrupted run's after step k: a fresh fit's (seeded on
start); one that follows the state the process had before the resume, or one the trainer sets on
start whatever that was (told apart by one more resume with the RNG as it was at the checkpoint);
every rank's the same although fresh fits give each its own (rank 0's restored everywhere). That
second resume (which ends early once it has parted from the uninterrupted run for good,
`parting.py`, where the trainer's fit can end early) also tells the rest: if it matches, the RNG
state is what is lost; if it is fed the same inputs as the uninterrupted run and nothing else is
named, state the checkpoint does not hold (an EMA or teacher model, optimizer state outside its
state_dict); where the trainer sets its own RNG, inputs that differ may follow from it (batches
drawn with torch.randint, as nanoGPT's: said as such, never a data position); same indices but other
inputs: a transform's state; otherwise the data position/order is not restored. When the checkpoint
is Lightning's, the RNG and data verdicts name the remedy this package ships
(`ddp_conformance.lightning`): stock Lightning loses both.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from ... import plan
from ...adapter import FitObserver, StepInfo, TrainState
from ...resumable import capture_rng_state, restore_rng_state, seed_all
from ...runner.ranks import ranks_label
from ..rank_participation import STEPS as PARTICIPATION_STEPS
from ..support import lr_trail, shared_fit
from ..support.check_context import CheckContext, all_gather, hide_on_verdict
from ..support.fit_watch import FitPlan
from ..support.model_state import BUFFER_SUFFIXES, Difference, buffers, differences, digest, drifted, parameters
from ..support.observe import buffer_names
from ..support.parting import StopOnceParted
from ..support.per_rank_files import shared_writes
from ..support.progress import guarded_fit
from ..support.replica_watch import modes_apart, modes_resumed
from ..support.shared_fit import ObservedFit
from ..support.vacuity import skip_as_vacuous, vacuity_verdict
from .step_marks import StepDigests, kept_params, long_fit_watchers, snapshot_of, step_digests

if TYPE_CHECKING:
    from ...config import RunConfig

#: what this check reads of the shared probe fit (`checks.PROBE_READERS`): whether two probes step alike
PROBE_WATCHER = StepDigests
#: what this check reads of the shared fit to n (`checks.LONG_FIT_READERS`)
LONG_FIT_WATCHERS = long_fit_watchers
BUFFERS_LOST = "the model's buffers are not restored"
SCHEDULE_BY_TOTAL = "the learning-rate schedule is set by the total steps"


class _FirstStepWeights(FitObserver):
    """Copies the model's parameters at the first micro-batch: what the resumed trainer really trains."""

    def __init__(self) -> None:
        self.model: Any = None
        self.weights: dict[str, Any] | None = None

    def on_wrapped(self, model: Any) -> None:
        self.model = model

    def before_step(self, info: StepInfo) -> None:
        if self.weights is None and self.model is not None:
            self.weights = {n.removeprefix("module."): p.detach().cpu().clone()
                            for n, p in self.model.named_parameters()}


def _newest_file(directory: Path) -> str | None:
    """The checkpoint a fit wrote without naming it (its adapter returned no TrainState)."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    return str(max(files, key=lambda p: p.stat().st_mtime_ns)) if files else None


def _disturb_rng(rank: int) -> None:
    seed_all(9_000 + 101 * rank)


CPU_MANY_RANKS_RTOL = 5e-5  # ~10x the largest measured difference: 4.9e-6 (ws 3, basic.yaml, BatchNorm), 1.2e-7 (ws 4)
CUDA_RTOL = 1e-4  # measured bitwise on an H200 (docs/checks/resume_fidelity.md); room for nondeterministic kernels


def tolerance(ctx: CheckContext) -> float:
    """0 (bitwise) on CPU up to 2 ranks; 5e-5 relative per tensor on CPU above; 1e-4 on CUDA.

    A resumed run's fresh DDP reduces its first step in the *initial* bucket layout; the
    uninterrupted run has long since rebuilt its buckets (in gradient-ready order, after iteration
    1). With 3+ ranks, gloo's ring all-reduce sums each element in an order set by its position in
    the bucket, so that one step differs in the last bits: measured max |delta| 6e-8 on the
    parameters at world size 4, and bitwise again with find_unused_parameters=True, which skips
    the rebuild. Two ranks sum one pair, the same in any order. GPUs add non-deterministic kernels.
    What the check exists for is far above 1e-4: a lost RNG state moved parameters by 0.2."""
    if ctx.rank_ctx.device_type == "cpu":
        return 0.0 if ctx.world_size <= 2 else CPU_MANY_RANKS_RTOL
    return CUDA_RTOL


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    ctx.require_shared_workdir()
    probe = shared_fit.probe(ctx)
    epoch = shared_fit.epoch_length(ctx, probe)
    observed = shared_fit.observed_fit(ctx, epoch)
    config, k, n = observed.config, observed.checkpoint_step, observed.horizon
    rtol = tolerance(ctx)
    exact = rtol == 0.0
    figures: dict[str, Any] = {
        "checkpoint_step": k, "final_step": n, "epoch_steps": epoch,
        "checkpoint_cadence": observed.cadence or "any step",
        "comparison": "bitwise" if exact else f"max |delta| <= {rtol:g} x max |value| per tensor"}
    ctx.figures.update(figures)
    if not plan.whole_epochs(epoch):
        ctx.note(f"an epoch of the training loader is {epoch} optimizer steps, longer than the "
                 f"{plan.LONG_EPOCH_STEPS} the suite trains whole: the resume is judged from a checkpoint at "
                 f"step {k} to step {n}" + (", within the first epoch: an epoch counter or a sampler's epoch lost on "
                 "resume is not judged" if n <= epoch else ""))
    full = _uninterrupted(ctx, observed, figures)
    _ranks_stay_in_step(ctx, n, epoch, figures)
    _ranks_train_alike(ctx, n, figures)
    part: TrainState | None = None
    at_checkpoint: dict[str, Any] = {}
    if observed.refused is not None:
        raise observed.refused  # a skip, with the trainer's reason
    if observed.checkpoint_dir is not None:
        checkpoint, written = _checkpoint_on_the_way(ctx, observed, figures)
    else:
        part, checkpoint, written, at_checkpoint = _until_checkpoint(ctx, config, k, figures)
    unreproducible = _not_reproducible(ctx, "probe", 1)
    if unreproducible:
        raise ctx.fail(unreproducible, **figures)
    taken = ctx.recordings["until-checkpoint"].optimizer_steps if part is not None else k
    if taken != k:  # its final state is not what it checkpointed at k: no weights can be compared with it
        ctx.note(f"fit({k}) took {taken} optimizer steps, so the checkpointed weights are not its final ones")
    _disturb_rng(ctx.rank)
    first = _FirstStepWeights()
    resumed, _ = guarded_fit(ctx, "resumed", n - k, lambda obs: ctx.adapter(config).resume(
        checkpoint, n, observer=obs), FitPlan(all_inputs=True), first)
    found = differences(full, resumed, rtol)
    figures["differences"] = len(found)
    figures["max_abs_delta"] = max((d.delta or 0.0 for d in (found if exact else differences(full, resumed, 0.0))
                                    if d.part == "params"), default=0.0)
    # every decision below is taken from gathered values, so all ranks run the same collectives
    if any(all_gather(bool(found))):
        if part is None:  # the state the shared fit checkpointed, and the RNG as it was there
            part, written, at_checkpoint = _at_checkpoint(ctx, observed, full, written)
        modes = all_gather(modes_resumed(observed.record.replicas, ctx.recordings["resumed"].replicas, k, n))
        if any(modes):
            ranks = [rank for rank, mode in enumerate(modes) if mode]
            raise ctx.fail(f"state the checkpoint does not hold is lost on {ranks_label(ranks)}: "
                           f"{next(mode for mode in modes if mode)}", **figures)
        weights = first.weights if all(all_gather(taken == k)) else None
        runs = ResumeRuns(config, full, part, resumed, checkpoint, at_checkpoint, n, k)
        statics = all_gather(_diagnose(found, runs, weights) if found else [])
        verdict = _rank_buffers(statics) or _unsynced_buffers(ctx, written, found, k, n) or _follows_all(statics)
        if not verdict:
            rng, data = _rng_or_data(ctx, runs, found,
                                     positioned=any(c.lead == POSITION_LOST for causes in statics for c in causes),
                                     other_causes=any(statics))
            verdict = _verdict(statics, rng, [data] * ctx.world_size)
        raise ctx.fail(verdict, **figures)
    own_dir = observed.checkpoint_dir or ctx.workdir / "ckpt" / f"rank{ctx.rank}"
    _only_rank_zero_writes(ctx, written, checkpoint, own_dir.parent / "rank0", figures)
    figures["summary"] = (f"bitwise @{n} (ckpt @{k})" if exact
                          else f"max |d| {figures['max_abs_delta']:.0e} @{n} (ckpt @{k})")
    return figures


def _uninterrupted(ctx: CheckContext, observed: ObservedFit, figures: dict[str, Any]) -> TrainState:
    """The shared fit from scratch to n: the run a resume must reproduce; one that trains nothing
    skips here, since it would resume "bitwise" whatever its checkpoint holds."""
    vacuous = vacuity_verdict([p.extra.get("evidence") for p in observed.progress],
                              f"the uninterrupted fit({observed.horizon})")
    if vacuous:
        ctx.figures.update(figures)
        skip_as_vacuous(vacuous)
    return observed.state


def _ranks_stay_in_step(ctx: CheckContext, n: int, epoch: int, figures: dict[str, Any]) -> None:
    """The uninterrupted fit crosses epoch boundaries, far past rank_participation's fit(STEPS): the
    ranks' parameters must stay identical after each of its steps (the recorder digests them).
    Divergence that begins later than rank_participation can see is named here (collective);
    earlier divergence is rank_participation's verdict, and the checkpoint comparison skips."""
    __tracebackhide__ = hide_on_verdict
    steps = all_gather(step_digests(ctx.recordings["uninterrupted"]))
    first = next((s for s, digests in enumerate(zip(*steps, strict=False), start=1) if len(set(digests)) > 1), 0)
    if first > PARTICIPATION_STEPS:
        where = f"step {first} of fit({n}), step {(first - 1) % epoch + 1} of epoch {(first - 1) // epoch}"
        raise ctx.fail(f"the ranks' parameters part after optimizer {where} ({epoch} steps an epoch), identical "
                       f"through step {first - 1}: some later step's gradients are not all-reduced (no_sync() also "
                       "around the step that ends an epoch's short accumulation window? parameters unfrozen after "
                       f"DDP was built, which DDP never registered?); rank_participation's fit({PARTICIPATION_STEPS}) "
                       "ends before that", **figures)


def _ranks_train_alike(ctx: CheckContext, n: int, figures: dict[str, Any]) -> None:
    """The ranks train their modules in the same mode at every step of the uninterrupted fit (the recorder reads each
    module's training flag at every micro-batch): a rank that alone evaluates with model.eval() and never calls
    model.train() trains in eval mode from then on, past rank_participation's few steps (collective)."""
    __tracebackhide__ = hide_on_verdict
    apart = modes_apart(all_gather(ctx.recordings["uninterrupted"].replicas))
    if apart is None:
        return
    step, verdict = apart
    if step <= PARTICIPATION_STEPS:
        pytest.skip(f"{verdict} (rank_participation fails the trainer for it): the ranks train apart from the start, "
                    "so no resume can be compared with the uninterrupted fit")
    raise ctx.fail(f"in the uninterrupted fit({n}), {verdict}; rank_participation's fit({PARTICIPATION_STEPS}) ends "
                   "before that", **figures)


def _checkpoint_on_the_way(ctx: CheckContext, observed: ObservedFit,
                           figures: dict[str, Any]) -> tuple[Path, list[Any]]:
    """Rank 0's checkpoint the shared fit wrote at k, and what every rank wrote (files, checkpoint,
    parameter digest after step k, the tensors stepped outside the model)."""
    own_dir, k = observed.checkpoint_dir, observed.checkpoint_step
    assert own_dir is not None
    steps = step_digests(observed.record)
    written = all_gather((*_files_and_checkpoint(own_dir, observed.state), steps[k - 1] if len(steps) >= k else None,
                          observed.record.outside_digests()))
    return _judged_checkpoint(ctx, written, f"fit({observed.horizon}, checkpoint_at={k})", figures), written


def _files_and_checkpoint(own_dir: Path, state: TrainState) -> tuple[list[str], str | None]:
    """The files this rank's fit wrote into its own checkpoint directory, and the checkpoint it names
    (else the newest file there)."""
    files = sorted(str(p.relative_to(own_dir)) for p in own_dir.rglob("*") if p.is_file())
    return files, str(state.checkpoint) if state.checkpoint else _newest_file(own_dir)


def _at_checkpoint(ctx: CheckContext, observed: ObservedFit, full: TrainState,
                   written: list[Any]) -> tuple[TrainState, list[Any], dict[str, Any]]:
    """The shared fit's state right after step k (its recorder's snapshot), as a fit that ended at k
    would return it; what every rank wrote, with the buffer digest and names at k; the RNG state there."""
    snapshot = snapshot_of(observed.record)
    if not all(all_gather(snapshot is not None)):  # the fit never took step k: nothing was checkpointed there
        raise ctx.fail(f"the uninterrupted fit({observed.horizon}) never reached its checkpoint step "
                       f"{observed.checkpoint_step}")
    assert snapshot is not None
    part = TrainState(params=snapshot.state, optimizer={}, scheduler=None, epoch=0, global_step=snapshot.step,
                      position=0, losses=full.losses[:snapshot.micro_batches], observed=True)
    mine = (digest(buffers(snapshot.state, snapshot.buffer_names)), snapshot.buffer_names)
    return part, [(*w[:4], *theirs) for w, theirs in zip(written, all_gather(mine), strict=True)], snapshot.rng


def _until_checkpoint(ctx: CheckContext, config: RunConfig, k: int,
                      figures: dict[str, Any]) -> tuple[TrainState, Path, list[Any], dict[str, Any]]:
    """fit(k) checkpointing at k into this rank's own directory: its state, rank 0's checkpoint file,
    what every rank wrote (files, checkpoint, parameter digest, the tensors stepped outside the model,
    buffer digest, buffer names), and the RNG state it left."""
    own_dir = ctx.workdir / "ckpt" / f"rank{ctx.rank}"
    own_dir.mkdir(parents=True, exist_ok=True)
    with lr_trail.watching() as rates:
        part, _ = guarded_fit(ctx, "until-checkpoint", k, lambda obs: ctx.adapter(config).fit(
            k, checkpoint_dir=own_dir, checkpoint_at=k, observer=obs), FitPlan(watchers=(StepDigests,)))
    lr_trail.remember(ctx.recordings["until-checkpoint"], rates)
    at_checkpoint = capture_rng_state()
    record = ctx.recordings["until-checkpoint"]
    names = buffer_names(record.model)
    written = all_gather((*_files_and_checkpoint(own_dir, part), digest(parameters(part.params)),
                          record.outside_digests(), digest(buffers(part.params, names)), names))
    checkpoint = _judged_checkpoint(ctx, written, f"fit({k}, checkpoint_at={k})", figures)
    unreproducible = _not_reproducible(ctx, "until-checkpoint", k)
    if unreproducible:
        raise ctx.fail(unreproducible, **figures)
    return part, checkpoint, written, at_checkpoint


def _judged_checkpoint(ctx: CheckContext, written: list[Any], fit: str, figures: dict[str, Any]) -> Path:
    """Rank 0's checkpoint, once the ranks agree at it and it exists."""
    __tracebackhide__ = hide_on_verdict
    checkpoint = written[0][1]
    if len({w[2] for w in written}) > 1 or drifted([w[3] for w in written])[0]:
        pytest.skip("the ranks' parameters already differ at the checkpoint, before any resume (gradients are not "
                    "synchronised, or parameters that get no gradient are updated per rank: rank_participation and "
                    "gradient_equivalence name which); a rank-0 checkpoint cannot resume the other ranks, so resume "
                    "fidelity cannot be judged")
    # every rank's own view of rank 0's file (gathered, so that all take one branch): a path outside the shared
    # directory, or a network filesystem's cache, can hide it from some ranks only
    seen = all_gather(bool(checkpoint) and Path(checkpoint).exists())
    if not all(seen):
        where = "" if not any(seen) else f" on rank {seen.index(False)}"
        raise ctx.fail(f"no checkpoint file after {fit}{where}: rank 0 reported {checkpoint!r}", **figures)
    figures["checkpoint"] = Path(checkpoint).name
    return Path(checkpoint)


def _only_rank_zero_writes(ctx: CheckContext, written: list[Any], checkpoint: Path, given: Path,
                           figures: dict[str, Any]) -> None:
    """Only rank 0 wrote files, each rank into `checkpoint_dir`s of its own (`given` is rank 0's), apart
    from files each rank writes under a name of its own beside rank 0's (`per_rank_files`)."""
    others, per_rank = shared_writes([files for files, *_ in written])
    if others:
        r, files = others[0]
        raise ctx.fail(f"rank {r} wrote checkpoint files ({', '.join(files[:3])}): only rank 0 may write checkpoints "
                       "(every rank writing the same path races and can leave a corrupt file; a file of each "
                       "rank's own carries its rank in its name beside rank 0's, as random_states_<rank>.pkl)",
                       **figures)
    if per_rank:
        figures["per_rank_files"] = ", ".join(per_rank[:3])
        ctx.note(f"every rank wrote files of its own beside rank 0's checkpoint ({', '.join(per_rank[:3])} on rank 1): "
                 "per-rank state by design, not a shared path; the resume was given every rank's")
    if not checkpoint.is_relative_to(given):
        ctx.note(f"rank 0 wrote its checkpoint outside the checkpoint_dir it was given ({checkpoint}), so writes "
                 "could not be attributed to ranks")


def _not_reproducible(ctx: CheckContext, label: str, k: int) -> str:
    """Two fits from scratch (the uninterrupted fit and the fit `label`) must agree over their first k
    steps, or no resume can be compared with either: "" when they do or cannot be compared."""
    full, other = step_digests(ctx.recordings["uninterrupted"]), step_digests(ctx.recordings[label])
    mine = next((step for step, (a, b) in enumerate(zip(full[:k], other[:k], strict=False), start=1) if a != b), 0)
    differing = [(rank, step) for rank, step in enumerate(all_gather(mine)) if step]
    if not differing:
        return ""
    rank, step = min(differing, key=lambda d: d[1])
    schedule = all_gather(lr_trail.first_apart(ctx.recordings["uninterrupted"], ctx.recordings[label], step))
    if label == "until-checkpoint" and schedule[rank] is not None:
        at, longer, shorter = schedule[rank]
        n = len(step_digests(ctx.recordings["uninterrupted"]))
        return (f"{SCHEDULE_BY_TOTAL}: the fit to {k} that writes the checkpoint steps with learning rate "
                f"{shorter[0]:.6g} at step {at}, the fit to {n} with {longer[0]:.6g} (each fit is its own run: "
                f"they part after step {step} on rank {rank}), so no checkpoint of the fit to {k} can resume the "
                f"fit to {n}: the schedule decays to the steps asked (a linear decay to --max_steps); have the fit "
                "to n write the checkpoint on its way (a script: SPEC whose resume line names it by "
                "{checkpoint_at} or {checkpoint_latest}; an adapter with checkpoints_once = True)")
    return (f"the fit is not reproducible: two fits from scratch already differ after step {step} on rank {rank} "
            "(its parameters), so a resume cannot be compared with either: an unseeded model, data order or "
            "dropout? (every rank starts with its own fresh seeds, as under torchrun)")


@dataclass(frozen=True)
class Cause:
    """One thing a resume loses: `lead` names it (the ranks it holds on are added after it), `detail`
    gives the evidence and the remedy."""

    lead: str
    detail: str


def _cause(text: str) -> Cause:
    lead, _, detail = text.partition(": ")
    return Cause(lead, detail)


def _verdict(*groups: list[list[Cause]]) -> str:
    """Every cause any rank found, once, group by group (each group: one list of causes per rank), each
    naming its ranks when not every rank has it; the detail is the lowest such rank's."""
    found: dict[str, tuple[Cause, list[int]]] = {}
    for per_rank in groups:
        for rank, causes in enumerate(per_rank):
            for cause in causes:
                found.setdefault(cause.lead, (cause, []))[1].append(rank)
    world = len(groups[0])
    texts = []
    for cause, ranks in found.values():
        others = [r for r in range(world) if r not in ranks]
        where = f" on {ranks_label(ranks)} (on {ranks_label(others)} it is)" if others else ""
        texts.append(f"{cause.lead}{where}: {cause.detail}")
    return "; also: ".join(texts)


def _follows_all(statics: list[list[Cause]]) -> str:
    """A lost global step changes how many steps the resumed run takes: everything else follows from it."""
    lost = [[c for c in causes if c.lead == STEP_LOST] for causes in statics]
    return _verdict(lost) if any(lost) else ""


RNG_LOST = "the RNG state is not restored"
LOADER_DRAW = "the resumed run draws from the RNG one draw off"
RNG_REMEDY = "save and restore the torch/numpy/python RNG states of every rank"
# what this rank's torch RNG was as the resumed run's first micro-batch began, against the uninterrupted
# run's as the micro-batch after step k began
RNG_SAME, RNG_FRESH, RNG_OTHER, RNG_SHIFTED = "same", "fresh", "other", "shifted"


def _rng_evidence(ctx: CheckContext, k: int, label: str = "resumed") -> str:
    """RNG_SAME where the states match or the trainer draws nothing from torch's RNG (so none can
    matter); RNG_FRESH where the resumed run starts from a fresh fit's first state (seeded on start);
    RNG_SHIFTED where it differs while a DataLoader drew its own seeds just before it and not before the
    uninterrupted run's (the loader's draw may be the difference); else RNG_OTHER."""
    full, resumed = ctx.recordings["uninterrupted"], ctx.recordings[label]
    at = next((m for m in full.rng_trail if m.steps == k), None)
    if not full.rng_consumed or at is None or not resumed.rng_trail or resumed.rng_trail[0].rng == at.rng:
        return RNG_SAME
    first = resumed.rng_trail[0]
    if first.rng == full.first_rng:
        return RNG_FRESH
    return RNG_SHIFTED if first.loader_drew and not at.loader_drew else RNG_OTHER


def _rng_causes(ctx: CheckContext, evidence: str, again: str | None, k: int, n: int,
                lightning: bool) -> tuple[list[Cause], bool]:
    """This rank's RNG cause, from its evidence and, where a second resume ran from the RNG state as it
    was at the checkpoint, whether the first micro-batch's RNG state followed the state the process had
    (`again`: that resume's first state); and whether the trainer sets an RNG state of its own on start
    (so that resume's RNG is not the checkpoint's either). Collective (`_one_rng`)."""
    first = ctx.recordings["resumed"].first_rng
    followed = again is not None and again != first  # the state before the resume decides: none is restored
    head = _apart_after(k, n)
    if evidence == RNG_FRESH:
        cause = _cause(f"{RNG_LOST}: {head}, and its first batch after the resume draws from the RNG state a fresh "
                       "fit starts with: the trainer seeds its RNG when it starts and restores no checkpointed RNG "
                       "state after that (restore every rank's RNG state from the checkpoint after any seeding)")
    elif evidence in (RNG_OTHER, RNG_SHIFTED) and followed:
        remedy = LIGHTNING_RNG_REMEDY if lightning else RNG_REMEDY
        cause = _cause(f"{RNG_LOST}: {head}, and the RNG state its first batch after the resume draws from follows "
                       "the state the process had before the resume (disturbed here, as a restarted process's is), "
                       f"not the one the uninterrupted run had at step {k}: {remedy}")
    elif evidence == RNG_OTHER and again is not None:
        cause = _cause(f"{RNG_LOST}: {head}, and its first batch after the resume draws from an RNG state the trainer "
                       "sets when it starts (the same whatever state the process had before), not the one the "
                       f"uninterrupted run had at step {k}: it seeds its RNG on start (torch.manual_seed) and "
                       "restores no checkpointed RNG state after that (save every rank's RNG state in the checkpoint "
                       "and restore it after any seeding)")
    else:
        cause = None
    one = _one_rng(ctx, k, n)  # collective
    if cause is not None and one:
        cause = _cause(one)
    return ([cause] if cause is not None else []), cause is not None and not followed


def _rank_buffers(statics: list[list[Cause]]) -> str:
    """Only ranks other than 0 lost their buffers: each rank keeps its own (broadcast_buffers=False),
    and a resume loads rank 0's checkpoint, rank 0's buffers, on every rank."""
    lost = [rank for rank, causes in enumerate(statics) if any(c.lead == BUFFERS_LOST for c in causes)]
    if statics[0] or not lost:
        return ""
    return (f"{BUFFERS_LOST} on rank {lost[0]}, while rank 0's are: the ranks keep buffers of their own "
            "(forward_sync_buffers=False, or broadcast_buffers=False) and every rank restores rank 0's, from its "
            "checkpoint (save every rank's buffers, or keep them in step with DDP's buffer sync)")


def _unsynced_buffers(ctx: CheckContext, written: list[Any], found: list[Difference], k: int, n: int) -> str:
    """The ranks' buffers differ at the checkpoint, DDP does not sync them in its forward, and a
    resumed rank's buffers differ from the uninterrupted run's: each rank trains with buffers of its
    own (a running normaliser read in training then normalises each rank's inputs differently, while
    the averaged gradients keep the parameters identical), and a resume hands every rank rank 0's.
    With the sync on, buffers that differ after the last forward's local update (BatchNorm's) are
    synced again by the next forward: no fault. Collective."""
    settings = ctx.recordings["uninterrupted"].ddp or {}
    synced = next((settings[key] for key in ("forward_sync_buffers", "broadcast_buffers")
                   if settings.get(key) is not None), None)
    names = set(written[ctx.rank][5])
    differs = any(d.part == "params" and (d.key.removeprefix("module.") in names or d.key.endswith(BUFFER_SUFFIXES))
                  for d in found)
    gathered = all_gather((synced is False, differs))
    unsynced = all(off for off, _ in gathered) and len({w[4] for w in written}) > 1
    if not unsynced or not any(lost for _, lost in gathered):
        return ""
    return (f"the ranks' buffers differ at the checkpoint, and DDP does not sync them in its forward "
            f"(forward_sync_buffers=False; broadcast_buffers=False before torch 2.13): {_apart_after(k, n)}, since "
            "every rank trains with buffers of its own (running statistics of its own shard) and a resume gives every "
            "rank rank 0's, from its checkpoint: keep DDP's buffer sync on (a model that reads its buffers in "
            "training then trains one function on every rank), or save and restore every rank's buffers")


def _one_rng(ctx: CheckContext, k: int, n: int) -> str:
    """Every rank's resumed fit starts from one RNG state although fresh fits start each rank from its
    own: one rank's state (rank 0's, which wrote the checkpoint) restored on every rank."""
    full = ctx.recordings["uninterrupted"]
    fresh, consumed = zip(*all_gather((full.first_rng, bool(full.rng_consumed))), strict=True)
    resumed = all_gather(ctx.recordings["resumed"].first_rng)
    # only where the loop draws from the RNG while it trains can the RNG explain a difference
    if ctx.world_size < 2 or not all(consumed) or None in resumed or len(set(resumed)) > 1 or len(set(fresh)) == 1:
        return ""
    return (f"the RNG state is not restored per rank: {_apart_after(k, n)}, and every rank's first batch after the "
            "resume draws from one and the same RNG state, while fresh fits start each rank from its own: the "
            "checkpoint holds one rank's RNG state (e.g. rank 0's, which wrote it) and every rank restores that one, "
            "or every rank reseeds alike on resume (save every rank's RNG state, e.g. gathered into rank 0's "
            "checkpoint, and restore each rank's own)")


def _apart_after(k: int, n: int) -> str:
    return f"after resuming at step {k}, the run to step {n} differs from the uninterrupted one"


STEP_LOST = "the global step is not restored"
POSITION_LOST = "the epoch/position in the epoch is not restored"
SCHEDULER_COUNTERS = ("last_epoch", "_step_count")  # a fresh scheduler's differ whatever the optimizer's state


@dataclass(frozen=True)
class ResumeRuns:
    """What a resume that differs is diagnosed from: the config the runs ran with, the uninterrupted run's final
    state, its state at the checkpoint, the resumed run's final state, the checkpoint, the RNG state as it was
    there, and the steps k (the checkpoint) and n (the end)."""

    config: Any
    full: TrainState
    part: TrainState
    resumed: TrainState
    checkpoint: Path
    at_checkpoint: dict[str, Any]
    n: int
    k: int


def _diagnose(found: list[Difference], runs: ResumeRuns, first_weights: dict[str, Any] | None) -> list[Cause]:
    """What the checkpoint or the resume loses on this rank, from the states alone: every cause they can
    tell apart (none if they cannot tell). `first_weights`: the weights the resumed run's first step began
    from (None: not known)."""
    part, checkpoint, n, k = runs.part, runs.checkpoint, runs.n, runs.k
    by_part: dict[str, list[Difference]] = {}
    for d in found:
        by_part.setdefault(d.part, []).append(d)
    head = _apart_after(k, n)
    causes: list[Cause] = []
    if "counters" in by_part:
        c = {d.key: d for d in by_part["counters"]}
        if "global_step" in c:
            return [_cause(f"{STEP_LOST}: {head} (global_step {c['global_step'].right} instead of "
                           f"{c['global_step'].left})")]
        shown = ", ".join(f"{key} {d.right} instead of {d.left}" for key, d in c.items())
        if set(c) == {"epoch"}:
            causes.append(_cause(f"{POSITION_LOST}: {head} ({shown}); the position is, so the resumed run reads "
                                 "the rest of another epoch's shuffle (set_epoch gets the wrong epoch)"))
        else:
            causes.append(_cause(f"{POSITION_LOST}: {head} ({shown}); {_counted_shift(c)}"))
    if first_weights is not None:
        saved = parameters(part.params)
        changed = [name for name, t in saved.items()
                   if name in first_weights and not _equal(first_weights[name], t)]
        if changed:
            prefixed = _module_keys(checkpoint)
            why = (f"; the checkpoint stores DDP-wrapped keys ({prefixed}) that the load silently drops "
                   "(a non-strict load_state_dict?)" if prefixed else "")
            causes.append(_cause(
                f"the model weights are not restored: the resumed trainer starts step {k + 1} with weights that "
                f"differ from the checkpointed ones in {len(changed)} of {len(saved)} tensors "
                f"(e.g. {changed[0]}){why}"))
    params = by_part.get("params", [])
    if set(by_part) == {"params"} and all(d.key.endswith(BUFFER_SUFFIXES) for d in params):
        worst = max(params, key=lambda d: (not d.key.endswith("num_batches_tracked"), d.delta or 0.0))  # a statistic
        return [_cause(f"{BUFFERS_LOST}: {head} only in its buffers ({worst.describe()}), while every parameter "
                       "matches: the checkpoint or its load keeps the parameters but not the buffers (BatchNorm "
                       "running statistics): save model.state_dict() and load it strictly")]
    # optimizer *values* (moments) differ whenever the trajectory does; its step counts, missing
    # entries or hyperparameters differ only when its state was not restored, except the learning
    # rate, which a lost scheduler sets (and a lost optimizer loses for a restored scheduler: its own
    # counters tell the two apart)
    scheduler = by_part.get("scheduler", [])
    scheduler_lost = [d for d in scheduler if d.key in SCHEDULER_COUNTERS]
    lost = [d for d in by_part.get("optimizer", []) if d.key.endswith(".step") or (
        d.delta is None and not (scheduler_lost and d.key.endswith(".lr")))]
    if lost:
        causes.append(_cause(f"the optimizer state is not restored: {head} ({lost[0].describe()})"))
    if scheduler_lost or (scheduler and not lost):
        d = (scheduler_lost or scheduler)[0]
        causes.append(_cause(f"the LR scheduler state is not restored: {head} ({d.describe()})"))
    return causes


def _rng_or_data(ctx: CheckContext, runs: ResumeRuns, found: list[Difference], *,
                 positioned: bool, other_causes: bool) -> tuple[list[list[Cause]], list[Cause]]:
    """What the states alone cannot tell: whether the RNG state and the data position are restored
    (every rank's RNG causes, and the data causes every rank shares). The RNG state each rank's
    resumed run started from is compared with the uninterrupted run's at step k; where that cannot
    decide, or nothing else explains the difference, resume once more with the RNG as it was at the
    checkpoint: matching then means the RNG state is what is lost, and what that resume fed its model
    tells the data position apart. `found`: how the resumed run's final state differs from the uninterrupted
    run's; `positioned`: a lost position is named already (the counters); `other_causes`: some rank's state
    names a cause. Collective."""
    config, full, part, resumed, checkpoint, n, k = (runs.config, runs.full, runs.part, runs.resumed,
                                                     runs.checkpoint, runs.n, runs.k)
    head = _apart_after(k, n)
    lightning = lightning_checkpoint(checkpoint)
    evidence = _rng_evidence(ctx, k)
    rerun = not other_causes or any(e in (RNG_OTHER, RNG_SHIFTED) for e in all_gather(evidence))
    label, again = "resumed", resumed
    if rerun:
        restore_rng_state(runs.at_checkpoint)
        label = "resumed-same-rng"
        parting = _until_parted(ctx, label, k)
        again, _ = guarded_fit(ctx, label, n - k, lambda obs: ctx.adapter(config).resume(
            checkpoint, n, observer=obs), FitPlan(all_inputs=True), parting)
        if parting is not None and parting.decided:
            ctx.observed_steps -= n - k - ctx.recordings[label].optimizer_steps
            ctx.figures["second_resume_ended_at_micro_batch"] = parting.at_micro_batch
    mine, overrides = _rng_causes(ctx, evidence, ctx.recordings[label].first_rng if rerun else None, k, n,
                                  lightning is not None)
    rng = all_gather(mine)
    # the second resume's RNG is the checkpoint's unless the trainer sets its own on start
    uncontrolled = any(all_gather(overrides if rerun else bool(mine)))
    shown = [d for d in found if d.part == "params"] or found
    worst = max(shown, key=lambda d: d.delta or 0.0) if shown else Difference("params", "?", "", "")
    if rerun and all(all_gather(not differences(full, again, tolerance(ctx)))):
        if any(rng):
            return rng, []
        remedy = LIGHTNING_RNG_REMEDY if lightning is not None else RNG_REMEDY
        return all_gather([_cause(
            f"{RNG_LOST}: {head} ({worst.describe()}) when the RNG is disturbed before the "
            f"resume, and matches when it is left as it was at step {k}: {remedy}")]), []
    tail = full.losses[len(part.losses):]
    diverge = next((i for i, (a, b) in enumerate(zip(tail, again.losses, strict=False)) if a != b), None)
    at = f" from micro-batch {diverge} after the resume" if diverge is not None else ""
    if _fed_alike(ctx, label, k):
        if other_causes or any(rng):
            return rng, []
        evidence_again = all_gather(_rng_evidence(ctx, k, label) if rerun else "")
        shifted = [rank for rank, e in enumerate(evidence_again) if e == RNG_SHIFTED]
        if shifted:  # the restored RNG, then the loader's own draw: the only thing between them and the training
            return rng, [_cause(
                f"{LOADER_DRAW}: {head}{at} ({worst.describe()}), fed the inputs the uninterrupted run was fed, from "
                f"the RNG as it was at the checkpoint: the resumed run's DataLoader draws its seed from the global "
                f"RNG as it starts mid-epoch (rank {shifted[0]}), a draw the uninterrupted run made at the epoch's "
                "start, before the checkpoint, so everything drawn after it (dropout) is drawn one step on; give the "
                "loader a generator of its own (DataLoader(..., generator=torch.Generator().manual_seed(seed))), or "
                "restore the RNG state after the resumed run's loader has started")]
        return rng, [_cause(
                f"state the checkpoint does not hold is lost: {head}{at} ({worst.describe()}) although the resumed "
                "run is fed the inputs the uninterrupted run was fed, with the RNG as it was at the checkpoint and "
                "the same weights, optimizer and scheduler state: something else the training reads is not saved "
                "and restored (a second model such as an EMA or teacher copy, a second optimizer, or state an "
                "optimizer keeps outside its state_dict, a module's tensors that are not registered buffers, a "
                "generator of its own)")]
    if uncontrolled:  # the trainer sets its own RNG: inputs that differ may follow from it
        if not any(all_gather(bool(ctx.recordings[label].training_passes()))):
            return rng, [_cause(
                f"{BATCHES_FOLLOW}: no DataLoader fed the training: its batches are drawn from torch's RNG (as "
                "nanoGPT's get_batch draws torch.randint offsets), so a restored RNG state restores them")]
        if not _reads_other(ctx, label, k):
            return rng, []
    elif _read_alike(ctx, label, k):
        return rng, [_cause(
                f"what turns the drawn samples into the model's inputs is not restored: {head}{at} "
                f"({worst.describe()}) although the resumed run reads the samples the uninterrupted run read after "
                "the checkpoint (the same dataset indices, in order), with the RNG as it was at the checkpoint and "
                "the same weights: the model is fed other inputs, so a transform between the sampler and the model "
                "(mixup or cutmix in the loop, a dataset's augmentation, a collate) draws from state the checkpoint "
                "does not restore: a generator of its own (a torch.Generator or numpy Generator, not the global "
                "RNGs) or a schedule; save and restore it")]
    if positioned:
        return rng, []
    remedy = "" if lightning is None else f"; {LIGHTNING_DATA_REMEDY[lightning.stateful_loader]}"
    return rng, [_cause(
            f"the data position is not restored: {head}{at} even with the RNG as it was at the checkpoint and the "
            f"same weights, so the resumed run reads other batches ({_fed_shift(ctx, label, k)}) "
            f"({worst.describe()}){remedy}")]


BATCHES_FOLLOW = "the batches after the resume differ too, following the RNG"


def _until_parted(ctx: CheckContext, label: str, k: int) -> StopOnceParted | None:
    """What ends the resume `label` early once it has parted from the uninterrupted run for good (it
    then neither matches nor was fed alike, whatever it does after); None where the uninterrupted run
    kept no parameters `parting.STEPS` after the checkpoint on some rank (collective): it runs to the
    horizon."""
    full = ctx.recordings["uninterrupted"]
    if not all(all_gather(kept_params(full) is not None)):
        return None
    fed = _fed(full)
    return StopOnceParted(lambda: ctx.recordings.get(label), None if fed is None else fed[_resume_start(ctx, k):],
                          kept_params(full), tolerance(ctx), _fed, all_gather)


def _resume_start(ctx: CheckContext, k: int) -> int:
    """Micro-batches the uninterrupted fit ran before step k's successor: where a resume from step k
    begins (the fit that checkpointed may have begun one more, as a script ended at its next step)."""
    full = ctx.recordings["uninterrupted"]
    trail = full.rng_trail
    part = ctx.recordings.get("until-checkpoint")
    at_k = snapshot_of(full)
    fallback = part.micro_batches if part is not None else at_k.micro_batches if at_k is not None else 0
    return next((i for i, mark in enumerate(trail) if mark.steps == k), fallback)


def _counted_shift(counters: dict[str, Difference]) -> str:
    """Which way the resumed run's data position went, from where the two runs end: (epoch, micro-batch
    in it) behind the uninterrupted run's means batches trained twice, ahead means batches never trained."""
    def at(side: str) -> tuple[int, int] | None:
        try:
            return tuple(int(getattr(counters[key], side)) if key in counters else -1  # type: ignore[return-value]
                         for key in ("epoch", "position"))
        except ValueError:
            return None
    full, resumed = at("left"), at("right")
    if full is None or resumed is None or full == resumed:
        return "the resumed run reads other batches than the uninterrupted one"
    same_epoch = "epoch" not in counters and -1 not in (full[1], resumed[1])
    shift = abs(full[1] - resumed[1])
    count = f"{shift} micro-batch{'' if shift == 1 else 'es'}" if same_epoch else "micro-batches"
    if resumed < full:
        return f"the resumed run re-reads {count} it trained before the checkpoint (it ends behind the other run)"
    return f"the resumed run skips {count} that the uninterrupted run trains (it ends ahead of the uninterrupted run)"


def _fed_shift(ctx: CheckContext, label: str, k: int) -> str:
    """Which way, and how far, the resume with the checkpoint's RNG moved in the data (collective): the
    uninterrupted run's micro-batch whose inputs (digests) its first micro-batches repeat, against the
    one at the checkpoint. Later than it: the resume skips batches; earlier: it re-reads them."""
    full, again = (_fed(ctx.recordings[name]) for name in ("uninterrupted", label))
    before = _resume_start(ctx, k)
    mine = None if full is None or not again else _input_offset(full, again, before)
    shifts = all_gather(mine)
    rank, shift = next(((r, s) for r, s in enumerate(shifts) if s), (0, None))
    where = "" if len(set(shifts)) == 1 else f" on rank {rank}"
    if shift is None:
        return "the loader restarts, replays or skips part of the epoch"
    plural = "" if abs(shift) == 1 else "es"
    if shift < 0:
        return (f"it re-reads {-shift} micro-batch{plural} it trained before the checkpoint{where}: its first inputs "
                f"are those of the uninterrupted run's micro-batch {before + shift}, not {before}"
                + _whole_epochs_back(ctx, -shift))
    return (f"it skips {shift} micro-batch{plural} the uninterrupted run trains after the checkpoint{where}: its "
            f"first inputs are those of the uninterrupted run's micro-batch {before + shift}, not {before}")


def _whole_epochs_back(ctx: CheckContext, shift: int) -> str:
    """Where a resume re-reads from the same place in its epoch, whole epochs back: the position within the epoch
    was restored, and the order of an earlier epoch read from it (an epoch never given to the sampler on resume)."""
    lengths = {p.length for p in ctx.recordings["uninterrupted"].training_passes()}
    epoch = lengths.pop() if len(lengths) == 1 else None
    if not epoch or shift % epoch:
        return ""
    epochs = shift // epoch
    return (f", the same place in the epoch {epochs} epoch{'' if epochs == 1 else 's'} earlier: the position within "
            "the epoch is restored and the epoch's order is not (the resumed epoch is never given to the sampler, "
            "set_epoch, or its generator's state is not restored)")


def _input_offset(full: list[str], again: list[str], before: int) -> int | None:
    """Where in `full` the inputs `again` begin, relative to `before`: of the places where `again`'s
    first micro-batches (two, or all of `again`) follow in `full`, else its first alone, the one nearest
    `before` (an epoch that repeats its order matches once an epoch; a resume that re-reads may then cut
    the epoch short, so that its second micro-batch is already the next epoch's first)."""
    for need in dict.fromkeys((min(2, len(again)), 1)):
        found = [start for start in range(len(full) - need + 1) if full[start:start + need] == again[:need]]
        best = min(found, key=lambda start: abs(start - before), default=None)
        if best is not None:
            return None if best == before else best - before
    return None


def _fed_alike(ctx: CheckContext, label: str, k: int) -> bool:
    """Whether, on every rank, the resume `label` fed its model the inputs the uninterrupted fit fed
    after the checkpoint, as many and in order (digests); False where a rank cannot tell (an input with
    no tensor to digest, a pass longer than DIGESTED_INPUTS). A resume that restarts from the first
    epoch feeds all of them: as many as the uninterrupted fit, not alike."""
    full, again = (_fed(ctx.recordings[name]) for name in ("uninterrupted", label))
    before = _resume_start(ctx, k)
    mine = full is not None and again is not None and bool(again) and full[before:] == again
    return all(all_gather(mine))


def _read_alike(ctx: CheckContext, label: str, k: int) -> bool:
    """Whether, on every rank, the resume `label` drew the dataset indices the uninterrupted fit drew
    after the checkpoint, in order (its last micro-batches' worth: a loader that skips to its position
    may draw and drop the batches before it), while both fits' inputs were digested (asked after
    `_fed_alike` said they differ: without digests nothing says so); False where the batches are not
    lists of indices."""
    labels = ("uninterrupted", label)
    full, again = (_drawn(ctx.recordings[name]) for name in labels)
    digested = all(_fed(ctx.recordings[name]) is not None for name in labels)
    before = _resume_start(ctx, k)
    resumed = ctx.recordings[label].micro_batches
    mine = (digested and full is not None and again is not None and 0 < resumed <= len(again)
            and full[before:before + resumed] == again[-resumed:])
    return all(all_gather(mine))


def _reads_other(ctx: CheckContext, label: str, k: int) -> bool:
    """Whether every rank's batches were dataset indices and some rank's resume `label` drew others than
    the uninterrupted fit drew after the checkpoint: its position is lost whatever its RNG did (a
    DistributedSampler orders by its own seed and epoch)."""
    full, again = (_drawn(ctx.recordings[name]) for name in ("uninterrupted", label))
    before, resumed = _resume_start(ctx, k), ctx.recordings[label].micro_batches
    indexed = full is not None and again is not None and 0 < resumed <= len(again)
    same = indexed and full[before:before + resumed] == again[-resumed:]  # type: ignore[index]
    gathered = all_gather((indexed, same))
    return all(i for i, _ in gathered) and not all(s for _, s in gathered)


def _drawn(record: Any) -> list[list[int]] | None:
    passes = record.training_passes()
    return [batch for p in passes for batch in p.batches] if passes and all(p.indexed for p in passes) else None


def _fed(record: Any) -> list[str] | None:
    digests = [d for p in record.training_passes() for d in p.inputs]
    return digests if len(digests) == record.micro_batches and None not in digests else None


LIGHTNING_RNG_REMEDY = ("Lightning checkpoints hold no RNG state: add ddp_conformance.lightning.RNGStateCallback() to "
                        "your Trainer's callbacks (or return it from your LightningModule's configure_callbacks)")
LIGHTNING_DATA_REMEDY = {
    False: ("Lightning continues an epoch only with a train loader that has state_dict/load_state_dict: build it as "
            "ddp_conformance.lightning.ResumableDataLoader(...) instead of DataLoader(...)"),
    True: ("the checkpoint holds the train loader's state, so Lightning restored it: does train_dataloader() build "
           "other data or another order after a restart?"),
}


@dataclass(frozen=True)
class LightningCheckpoint:
    stateful_loader: bool  # the fit loop saved a train loader's state_dict (`combined_loader`)


def lightning_checkpoint(checkpoint: Path) -> LightningCheckpoint | None:
    """What a Lightning checkpoint holds, or None for any other file. Read from the pickle's bytes in
    the zip torch.save writes (keys are stored as plain strings there), so nothing is unpickled."""

    try:
        with zipfile.ZipFile(checkpoint) as archive:
            name = next(n for n in archive.namelist() if n.rpartition("/")[2] == "data.pkl")
            pickled = archive.read(name)
    except (OSError, zipfile.BadZipFile, StopIteration):
        return None
    if b"pytorch-lightning_version" not in pickled:
        return None
    return LightningCheckpoint(stateful_loader=b"combined_loader" in pickled)


def _equal(a: Any, b: Any) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))


def _module_keys(checkpoint: Path) -> str:
    """An example of a `module.`-prefixed key in the checkpoint file, if it holds any."""

    try:
        payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception:
        return ""
    stack = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str) and key.startswith("module."):
                    return key
                stack.append(value)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return ""
