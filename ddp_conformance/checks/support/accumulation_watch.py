"""What accumulation_equivalence observes of a fit's accumulation window, and the reference it compares the
window with, which must not inherit the setting under test.

A window is the micro-batches (training forwards) of one optimizer step on one rank (`FirstStep.micro_batches`,
and `FitRecord.synced`, which of them DDP synchronised). The config's `accumulate_grad_batches` is a claim about
that window, held to the k observed on every rank. The reference for a k-micro-batch window is the trainer's own
loss on all the window's samples at k = 1: a loss that reads the accumulation from the trainer (a LightningModule
dividing by `self.trainer.accumulate_grad_batches` on top of Lightning's own division, a class trainer's `loss`
reading its config's) divides the reference too where it runs at k, and a step applying 1/k of the gradient would
match it.

`HeldWatch` observes, in the fit itself, whether each backward pass of the first window found the gradients
of the window's earlier micro-batches still on the parameters: a `zero_grad` inside the window throws them
away, which a rerun of a script at its own k repeats and so cannot show.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...adapter import FitObserver
from .gradients import single_process_adapter
from .observe import unwrapped


def at_k(config: Any, k: int) -> Any:
    """`config` with `accumulate_grad_batches` k."""
    return replace(config, trainer=replace(config.trainer, accumulate_grad_batches=k))


def at_one_micro_batch(ctx: Any, config: Any) -> Any:
    """The single-process reference (`gradients.single_process_adapter`, else the trainer as set up for the real
    world) set up with `config` at k = 1, and held at 1 after its own `setup`, which may set the trainer's own
    k again (`replace(config, ... accumulate_grad_batches=3)`): its loss is then the loss of one batch."""
    one = at_k(config, 1)
    reference = single_process_adapter(ctx, one) or ctx.adapter(one)
    own = getattr(reference, "config", None)
    if own is not None and own.trainer.accumulate_grad_batches != 1:
        reference.config = at_k(own, 1)
    return reference


def window_per_step(micro_batches: int, skipped: int) -> int | None:
    """The micro-batches of one optimizer step, from the first applied step's count (`FirstStep.micro_batches`),
    which holds those of the steps a GradScaler skipped before it (`skipped`) too: taken alike for each, None
    where they do not divide evenly."""
    steps = skipped + 1
    return micro_batches // steps if micro_batches % steps == 0 else None


def window_text(windows: list[int]) -> str:
    """The micro-batches each rank's first optimizer step took, in words."""
    taken = sorted(set(windows))
    if len(taken) == 1:
        return f"{taken[0]} micro-batch{'es' if taken[0] != 1 else ''} per rank"
    return "per rank " + ", ".join(str(w) for w in windows)


def claim_disagrees(claimed: int, windows: list[int], script: bool, carried: bool = False) -> str:
    """Why the k observed on the ranks (`windows`) is not the config's claim `claimed`, or "" where they agree
    (a claim of 1 is the config's default, which a trainer accumulating by a setting of its own does not
    contradict: `own_setting`). `script`: the trainer runs its own command line, which the config reached only
    where the SPEC carries `{accumulate_grad_batches}` (`carried`)."""
    if claimed <= 1 or all(window == claimed for window in windows):
        return ""
    if carried and counted_over_ranks(claimed, windows):  # nanoGPT's count: `over_ranks_note` says so
        return ""
    taken = window_text(windows)
    if script and carried:
        return (f"the script's command line got accumulate_grad_batches {claimed} from the config through "
                f"{{accumulate_grad_batches}}, but its first optimizer step took {taken}: the argument does not set "
                "the micro-batches per rank (an accumulation counted over all ranks, divided by the world size as "
                "nanoGPT's is?)")
    if script:
        return (f"the config claims accumulate_grad_batches {claimed}, but the script's first optimizer step took "
                f"{taken}: the script accumulates by its own setting, not the config's (pass "
                "{accumulate_grad_batches} where its command line takes the accumulation, or make the claim match)")
    if max(windows) == 1:
        return (f"the fit steps after every micro-batch although accumulate_grad_batches is {claimed}: the config's "
                f"accumulation never reaches the loop (its first optimizer step took {taken}), so each step "
                f"applies the gradient of 1/{claimed} of the configured batch")
    return (f"the fit's first optimizer step takes {taken}, but accumulate_grad_batches is {claimed}: the loop "
            "accumulates over another window than the config's")


def counted_over_ranks(claimed: int, windows: list[int]) -> bool:
    """Whether a script's accumulation argument counts micro-batches over all ranks, as nanoGPT's
    `gradient_accumulation_steps` does (it divides it by the world size): `claimed` is every rank's window summed."""
    return len(windows) > 1 and all(window * len(windows) == claimed for window in windows)


def over_ranks_note(claimed: int, windows: list[int]) -> str:
    """The note for a claim the script reads as a count over all ranks (`counted_over_ranks`), or ""."""
    if not counted_over_ranks(claimed, windows):
        return ""
    return (f"the script reads accumulate_grad_batches {claimed} as micro-batches over all {len(windows)} ranks "
            f"(divided by the world size, as nanoGPT's gradient_accumulation_steps is): {windows[0]} per rank, "
            "judged as that window")


def own_setting(claimed: int, windows: list[int], script: bool) -> str:
    """A note where the config claims no accumulation and the fit accumulates anyway, or ""."""
    if claimed != 1 or max(windows) <= 1:
        return ""
    by = "the script's own setting" if script else "a setting of its own"
    return (f"the fit accumulates {window_text(windows)} a step by {by}: the config's accumulate_grad_batches "
            "is 1")


class HeldWatch(FitObserver):
    """A fit's `inner` observer (`progress.guarded_fit`): at each backward pass up to its first applied optimizer
    step, whether every parameter that an earlier pass gave a nonzero gradient still holds one. `gone`: the
    backward passes (counted from 1) that found one gone; a pass that begins a window finds them gone rightly
    (`first_thrown`). A parameter's hook sees its `.grad` before the pass adds to it, DDP's all-reduce included
    (that comes after accumulation). `close()` removes the hooks."""

    def __init__(self) -> None:
        self.gone: set[int] = set()
        self._handles: list[Any] = []
        self._passes: dict[int, int] = {}  # id(param) -> backward passes that reached it
        self._gave: set[int] = set()  # params an earlier pass gave a nonzero gradient
        self._done = False

    def on_wrapped(self, model: Any) -> None:
        for param in unwrapped(model).parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._seen(param)))
        self._handles.append(register_optimizer_step_pre_hook(self._step))

    def _seen(self, param: Any) -> Any:
        key = id(param)

        def hook(grad: Any) -> None:
            if self._done or grad is None:
                return
            passes = self._passes[key] = self._passes.get(key, 0) + 1
            if key in self._gave and not _holds(param.grad):
                self.gone.add(passes)
            if _holds(grad):
                self._gave.add(key)

        return hook

    def _step(self, *_: Any) -> None:
        self._done = True

    def first_thrown(self, window: int) -> int | None:
        """The first backward pass inside a `window`-pass window (not its first) that found gradients gone."""
        inside = [n for n in self.gone if (n - 1) % max(window, 1) != 0]
        return min(inside) if inside else None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _holds(grad: Any) -> bool:
    return grad is not None and bool(torch.count_nonzero(grad))


def thrown_away(window: int, thrown: list[int | None]) -> str:
    """The verdict where some rank's backward pass found the window's earlier gradients gone, or ""."""
    seen = [(rank, at) for rank, at in enumerate(thrown) if at is not None]
    if window < 2 or not seen:
        return ""
    rank, at = seen[0]
    return (f"only the last micro-batch of each {window}-batch accumulation window counts, the earlier ones are thrown "
            f"away (zero_grad inside the accumulation window?): seen in the fit, rank {rank}'s backward pass {at} of "
            "its first window found the gradients of the window's earlier micro-batches gone from the parameters")
