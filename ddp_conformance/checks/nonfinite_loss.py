"""nonfinite_loss: a non-finite loss on one rank is acted on by every rank at the same step, not stepped
on silently, and not skipped by that rank alone.

A NaN or inf loss shows up on one rank (one bad batch, an overflow). DDP averages that rank's NaN
gradients into every rank's, so an unguarded loop steps every rank onto NaN parameters at once, and the
run is lost with no rank having said so (the guides' own "print a warning and go on" does exactly that).
A guard must decide on every rank together. One that reads the rank's own loss (`if not
torch.isfinite(loss): continue`, a LightningModule returning None) skips on that rank alone: the others
wait in the all-reduce it never joins (a hang), or pair it with the skipping rank's next batch (the ranks
one batch apart from then on), or step where it does not (different models on the ranks).

Opt-in (`--ddp-checks nonfinite_loss`): DDP promises nothing here, and most trainers, stock Lightning's
loop included, have no guard, so the default set would fail nearly all of them.

Evidence: one fit of `STEPS` optimizer steps in which the last rank's model turns non-finite at the first
micro-batch of step `POISONED_STEP`: the output of the first module that holds parameters of its own (the
embedding, the first layer) gets NaN added, as a NaN in the batch would make it, so the trainer's own loss,
and whatever guard reads it inside `training_step` or the loop, sees a NaN. Judged after the fit, from every
rank's micro-batch count and final parameters (finite, and a digest to compare):
- that rank's fit raised or exited while the others wait in DDP's collectives: it stopped alone (a
  launcher that watches its processes ends the job; the raising rank reads the others' progress files, not
  a collective, to tell this from every rank stopping together);
- the fit hangs: the trainer acted on it on that rank alone (the stall names who stopped where);
- the ranks ran different numbers of micro-batches: that rank dropped its batch alone;
- the ranks end with different parameters: some stepped on it and some did not;
- every rank ends with non-finite parameters: every rank stepped on it, silently;
- every rank ends finite and alike (every rank skipped the step, or zeroed its averaged gradients), or
  every rank stopped at once with the same error: passes. A GradScaler passes so (minGPT's AMP loop): DDP
  averages the NaN into every rank's gradients, so every rank's scaler skips that step. Its steps are counted
  as the trainer counts them, the skipped one included, by the recorder and by a script's step count alike:
  counted by `optimizer.step()` alone, a script's fit(3) "took 2 optimizer steps, not 3" and was refused.
Skipped where the NaN could not be placed (no module with parameters ran after step 1 on that rank) or did
not reach the model's own output in that micro-batch (read where it is a floating-point tensor): the step
judged would be a finite one.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..adapter import TrainerBuildError
from ..runner.ranks import ranks_label
from .support.adapter_errors import AdapterError
from .support.check_context import CheckContext, CheckFailed, all_gather, hide_on_verdict
from .support.digests import step_digest
from .support.loader_watch import children, rebuilt
from .support.observe import unwrapped
from .support.progress import POLL_SECONDS, PeerFitFailed, all_ended, guarded_fit, read_all

STEPS = 3
POISONED_STEP = 2  # not the first: DDP's first iteration is special (bucket rebuild, static graph's first pass)
LABEL = "nonfinite"
TRACED_MICRO_BATCHES = 64  # the parameters are digested as each of the fit's micro-batches begins, up to this many
REMEDY = ("a guard must decide on every rank together (skip the step when the gradients DDP averaged are not "
          "finite, or all-reduce the loss's finite flag before backward)")


class Poison:
    """Adds NaN to the output of the first module with parameters of its own that runs in the first training
    micro-batch after optimizer step `POISONED_STEP - 1`, once, on this rank (`armed`): read from the guarded
    fit's recorder (`ctx.recordings[LABEL]`), whose forward pre-hook has counted that step's micro-batch."""

    def __init__(self, ctx: CheckContext, armed: bool) -> None:
        self.ctx, self.armed = ctx, armed
        self.at_micro_batch: int | None = None  # where it struck (1-based), None: not (yet)
        self.module = ""  # the class of the module whose output it made non-finite
        # whether the model's own output in that micro-batch held a non-finite value (None: no floating-point
        # output to read, as a training_step that returned None): False means the NaN never reached the loss
        self.reached: bool | None = None
        # from the second micro-batch on: the model's parameters as that micro-batch began (finite, digest)
        self.states: list[tuple[bool, str]] = []

    def __enter__(self) -> Poison:
        self._handles = [register_module_forward_pre_hook(self._on_input),
                         register_module_forward_hook(self._on_output)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_input(self, module: Any, _args: Any) -> None:
        """Runs before the recorder's hook of the same forward, which counts it (the recorder is entered later)."""
        record = self.ctx.recordings.get(LABEL)
        if record is not None and module is record.model and len(self.states) < TRACED_MICRO_BATCHES \
                and module.training and torch.is_grad_enabled():
            self.states.append(parameter_state(module))

    def _on_output(self, module: Any, _args: Any, output: Any) -> Any:
        record = self.ctx.recordings.get(LABEL)
        if not self.armed or record is None or record.model is None:
            return None
        if self.at_micro_batch is not None:
            if module is record.model and record.micro_batches == self.at_micro_batch:
                self.reached = _non_finite(output)
            return None
        if record.optimizer_steps != POISONED_STEP - 1 or not (module.training and torch.is_grad_enabled()):
            return None
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            return None
        poisoned, changed = _plus_nan(output)
        if not changed:
            return None
        self.at_micro_batch, self.module = record.micro_batches, type(module).__name__
        return poisoned


def _non_finite(output: Any) -> bool | None:
    """Whether a floating-point tensor in `output` holds a NaN or inf; None when it holds none."""
    if isinstance(output, torch.Tensor):
        return bool((~torch.isfinite(output.detach())).any()) if output.is_floating_point() else None
    found = [_non_finite(item) for item in children(output) or []]
    return None if all(f is None for f in found) else any(bool(f) for f in found)


def _plus_nan(output: Any) -> tuple[Any, bool]:
    """`output` with NaN added to every floating-point tensor in it (kept in the autograd graph, so the
    gradients turn NaN as a NaN input makes them), and whether there was one."""
    if isinstance(output, torch.Tensor):
        return (output + float("nan"), True) if output.is_floating_point() else (output, False)
    items = children(output)
    if items is None:
        return output, False
    pairs = [_plus_nan(item) for item in items]
    return rebuilt(output, [item for item, _ in pairs]), any(changed for _, changed in pairs)


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    poisoned = ctx.world_size - 1
    figures: dict[str, Any] = {"steps": STEPS, "poisoned_rank": poisoned, "poisoned_step": POISONED_STEP}
    adapter = ctx.adapter(ctx.config)
    with Poison(ctx, armed=ctx.rank == poisoned) as poison:
        try:
            guarded_fit(ctx, LABEL, STEPS, lambda observer: adapter.fit(STEPS, observer=observer))
        except CheckFailed as exc:
            raise ctx.fail(f"{_made(poisoned)}, and {_hang(str(exc), poisoned)}: {REMEDY}. {exc}", **figures) from None
        except PeerFitFailed as exc:  # this rank's fit ended, that rank's raised after its last collective
            raise ctx.fail(f"{_made(poisoned)}, and {_stopped_alone(exc.rank)}: {REMEDY}. {exc}", **figures) from None
        except TrainerBuildError:
            # a script's run that its guard left a step short ends as asked but is refused for its count:
            # what it did is in the recorder
            if ctx.recordings[LABEL].optimizer_steps >= STEPS:
                raise
        except AdapterError as exc:
            # this rank's fit raised, and guarded_fit said so at once: no collective until every rank is known
            # to have stopped, since the others may still wait in DDP's (they then give the stall verdict)
            if not _every_rank_raised(ctx):
                raise ctx.fail(f"{_made(poisoned)}, and {_stopped_alone(ctx.rank)}: {REMEDY}. Rank {ctx.rank}'s "
                               f"fit raised: {exc}", **figures) from None
            if all_gather(poison.at_micro_batch)[poisoned] is None:
                raise
            figures["summary"] = f"every rank stops at step {POISONED_STEP}"
            ctx.note(f"every rank's fit raised after rank {poisoned}'s loss turned non-finite: {exc}")
            return figures
    record = ctx.recordings[LABEL]
    end = parameter_state(record.model) if record.model is not None else (True, "")  # what the ranks go on with
    mine = {"struck": poison.at_micro_batch, "module": poison.module, "reached": poison.reached,
            "micro_batches": record.micro_batches,
            "optimizer_steps": record.optimizer_steps, "states": [*poison.states, end]}
    every = all_gather(mine)
    figures.update(micro_batches=[rank["micro_batches"] for rank in every],
                   optimizer_steps=[rank["optimizer_steps"] for rank in every])
    verdict = judge(every, poisoned)
    if verdict:
        raise ctx.fail(verdict, **figures)
    figures["summary"] = f"every rank alike at step {POISONED_STEP}"
    return figures


def _every_rank_raised(ctx: CheckContext) -> bool:
    """Whether every rank's guarded fit ended in an error, read from the ranks' progress files (no collective):
    waited for as long as a fit in which no rank has stopped is given, since a rank that raises later is
    stopping too (Lightning 2.5 on torch 2.4 took seconds to end a fit that raised on every rank), or until a rank
    that did not raise gives the stall verdict (it waits in DDP's collectives for this one)."""
    deadline = time.monotonic() + 4 * ctx.stall_after
    directory = ctx.workdir / "progress" / LABEL
    while True:
        progress = read_all(directory, ctx.world_size)
        if all_ended(directory, progress):
            return all(p is not None and p.state == "error" for p in progress)
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)


def judge(every: list[dict[str, Any]], poisoned: int) -> str:
    """The verdict on a fit that finished on every rank, from each rank's evidence ("" when it passes)."""
    __tracebackhide__ = hide_on_verdict
    if every[poisoned]["struck"] is None:
        pytest.skip(f"rank {poisoned}'s fit ran no training forward of a module with parameters after step "
                    f"{POISONED_STEP - 1} whose output held a floating-point tensor, so no loss could be made "
                    "non-finite")
    made = _made(poisoned, every[poisoned]["module"])
    if every[poisoned].get("reached") is False:
        pytest.skip(f"rank {poisoned}'s loss could not be made non-finite: the NaN added to the output of its model's "
                    f"first layer, {every[poisoned]['module']}, did not reach the model's output (that output is not "
                    "used, or the model replaces it), so the check would judge a finite step")
    counts = [rank["micro_batches"] for rank in every]
    others = [r for r, count in enumerate(counts) if count != counts[poisoned]]
    if others:
        theirs = (f"{ranks_label(others)} {counts[others[0]]}" if len({counts[r] for r in others}) == 1
                  else ", ".join(f"rank {r} {counts[r]}" for r in others))
        return (f"{made}, and rank {poisoned} dropped that batch alone: it ran {counts[poisoned]} micro-batches, "
                f"{theirs}, so each all-reduce after it "
                f"averages rank {poisoned}'s next batch with the others' current one and at an epoch's end the "
                f"others wait for a batch it no longer has: {REMEDY}")
    for states in zip(*(rank["states"] for rank in every), strict=False):  # micro-batch by micro-batch, then the end
        finite = [r for r, (ok, _) in enumerate(states) if ok]
        if finite and len(finite) < len(every):
            stepped = [r for r in range(len(every)) if r not in finite]
            return (f"{made}, and the ranks acted on it apart: {ranks_label(finite)} kept finite parameters while "
                    f"{ranks_label(stepped)} stepped on NaN gradients (the guard reads each rank's own loss), so "
                    f"the ranks now train different models: {REMEDY}")
        apart = [r for r, (_, digest) in enumerate(states) if digest != states[0][1]]
        if apart:
            return (f"{made}, and {ranks_label(apart)} {'goes' if len(apart) == 1 else 'go'} on with other "
                    f"parameters than rank 0: the ranks acted on it apart: {REMEDY}")
    if not every[0]["states"][-1][0] and len(every) == 1:
        return (f"{made}, and the loop stepped on it: the parameters are NaN from step {POISONED_STEP}, and it "
                "neither skipped the step nor stopped: guard the step (skip it when the gradients are not finite)")
    if not every[0]["states"][-1][0]:
        return (f"{made}, and every rank stepped on it: the parameters are NaN on every rank from step "
                f"{POISONED_STEP} (DDP averaged rank {poisoned}'s NaN gradients into every rank's) and no rank "
                f"skipped the step or stopped: {REMEDY}")
    return ""


def parameter_state(model: Any) -> tuple[bool, str]:
    """Whether every floating-point parameter of the (unwrapped) model is finite, and their digest."""
    floats = [p.detach() for p in unwrapped(model).parameters() if p.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in floats), step_digest(floats)


def _hang(stall: str, rank: int) -> str:
    """What a hung fit says of the poisoned rank: it stopped (its fit raised, or exited) or went on alone."""
    if f"rank {rank} failed with" in stall:
        return _stopped_alone(rank)
    return f"the fit hangs: the trainer acted on it on rank {rank} alone"


def _stopped_alone(rank: int) -> str:
    return (f"rank {rank} stopped alone while the others wait for it in DDP's collectives (a launcher that watches "
            "its processes, torchrun, then ends the job; without one they hang until the collective times out)")


def _made(rank: int, module: str = "") -> str:
    layer = f"first layer, {module}" if module else "first layer"
    return (f"rank {rank}'s loss turned non-finite at step {POISONED_STEP} (NaN added to the output of its model's "
            f"{layer})")
