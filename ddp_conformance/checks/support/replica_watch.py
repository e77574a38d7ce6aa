"""State of the replicas that is not in their gradients: each module's training flag, and parameters
that change with no gradient, as the real fit leaves them on this rank.

DDP keeps the ranks' replicas equal by averaging gradients. Two things escape it, silently:
- a module's training flag. A rank that alone runs an evaluation with `model.eval()` and never calls
  `model.train()` trains on in eval mode: its Dropout is off and its BatchNorm normalises by frozen
  running statistics, while the parameters stay identical on every rank (the gradients are still
  averaged). So at every training micro-batch the flags of the model's modules are read (a tuple of
  bools, kept only where it changes), with the modules in eval mode by name and the place of the last
  `.eval()` / `.train(False)` call in the user's code (`Module.train` is wrapped for the fit).
- parameters that get no gradient (`requires_grad=False`: an EMA or teacher copy inside the model DDP
  wraps): DDP neither all-reduces nor broadcasts them after it is built, so one updated on one rank only
  (under `if rank == 0`) parts the ranks' models while every gradient is all-reduced. Their digests are
  read at each training micro-batch of the first WATCHED_STEPS optimizer steps (up to FROZEN_BYTES of
  them), and where one changes the step is kept; one unfrozen later gets gradients, and is no longer one.

A model in eval mode is still trained when its forward's output is backpropagated: the recorder counts
a micro-batch only for a module in training mode, so an eval-mode, grad-enabled top-level forward of
the model (or of a trainable module before any model is known) is held here, and counted as a micro-batch
once its backward reaches the output (a hook on the output tensors); an evaluation that forgets
`torch.no_grad()` never backpropagates and is never counted.
"""

from __future__ import annotations

import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from ...runner.frames import is_users
from .tensor_bytes import readable_bytes

#: no-gradient parameters are digested at the micro-batches of the first optimizer steps, no more
WATCHED_STEPS = 64
#: ... up to this many bytes of them (what reading them costs: benchmarks/RESULTS.md); an EMA or teacher copy changes
#: in every tensor, so the first ones tell
FROZEN_BYTES = 16 * 2**20
#: names kept per change (of the modules in eval mode, of the parameters that changed)
NAMED = 8
#: modules whose forward depends on the training flag, named first
MODE_SENSITIVE = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
                  nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
                  nn.InstanceNorm2d, nn.InstanceNorm3d, nn.RReLU)


@dataclass(frozen=True)
class ModeChange:
    """The model's modules' training flags from the micro-batch `micro` (which adds to optimizer step `step`,
    counted from 1) on, until the next change."""

    step: int
    micro: int
    eval_modules: tuple[str, ...]  # "name (Type)" of the modules in eval mode, the first NAMED, Dropout and norms first
    eval_count: int  # how many are
    modules: int  # of how many the model has
    eval_call: str | None  # where the last .eval() / .train(False) before it was called (user code), if seen


@dataclass(frozen=True)
class FrozenChange:
    """Parameters without gradient that changed between two training micro-batches: after optimizer step `step`."""

    step: int
    names: tuple[str, ...]  # the first NAMED
    count: int


@dataclass
class ReplicaTrail:
    """What one fit's recorder saw of the replica state outside the gradients (plain values, to gather)."""

    modes: list[ModeChange] = field(default_factory=list)
    frozen: list[FrozenChange] = field(default_factory=list)
    frozen_names: list[str] = field(default_factory=list)  # the model's parameters with requires_grad=False
    # micro-batches of a model in eval mode counted because their backward reached the output
    eval_micro_batches: int = 0

    def mode_at(self, step: int) -> ModeChange | None:
        """The flags in force at optimizer step `step` (the last change at or before it)."""
        found = None
        for change in self.modes:
            if change.step <= step:
                found = change
        return found


def module_label(name: str, module: Any) -> str:
    return f"{name or 'the model'} ({type(module).__name__})"


class ReplicaWatch:
    """Fills a `ReplicaTrail` from the recorder's hooks (`FitRecorder`): `micro_batch` at every training micro-batch,
    `holds`/`ended` around a top-level forward that the recorder does not count (eval mode)."""

    def __init__(self, trail: ReplicaTrail) -> None:
        self.trail = trail
        self._modules: list[tuple[str, Any]] = []
        self._model: Any = None
        self._flags: tuple[bool, ...] | None = None
        self._all_frozen: list[tuple[str, Any]] = []  # the model's parameters without gradient at its first micro-batch
        self._frozen: list[tuple[str, Any]] = []  # ... those digested (FROZEN_BYTES)
        self._frozen_digests: dict[str, int] = {}
        self._pending: tuple[Any, Any] | None = None  # (module, its forward's arguments)
        self._eval_call: str | None = None
        self._in_train = False
        self.counting = False  # a held forward is being counted, from its backward

    # --- Module.train, wrapped for the fit -------------------------------------------------------

    def wrap_train(self, original: Any) -> Any:
        """`Module.train` that notes where the outermost `.train(False)` (`.eval()`) was called from, in user code."""
        watch = self

        def train(module: Any, mode: bool = True) -> Any:
            if watch._in_train:
                return original(module, mode)
            watch._in_train = True
            try:
                if not mode:
                    watch._eval_call = _user_site()
                return original(module, mode)
            finally:
                watch._in_train = False

        return train

    # --- forwards the recorder does not count ----------------------------------------------------

    def holds(self, module: Any, args: Any, model: Any) -> bool:
        """Whether a grad-enabled top-level forward of a module in eval mode may train it (the fit's model, or any
        trainable module before the first micro-batch named one): held until its output's backward says so."""
        if module.training or not torch.is_grad_enabled():
            return False
        if model is not None and module is not model:
            return False
        if model is None and not any(p.requires_grad for p in module.parameters()):
            return False
        self._pending = (module, args)
        return True

    def ended(self, module: Any, output: Any, count: Callable[[Any, Any], None]) -> None:
        """At the end of a held forward: `count(module, args)` once its output is backpropagated (a micro-batch)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not module:
            return
        outputs = [t for t in _tensors(output) if t.requires_grad]
        done: list[bool] = []

        def backward_reached(grad: Any) -> None:
            if not done:
                done.append(True)
                self.trail.eval_micro_batches += 1
                self.counting = True
                try:
                    count(*pending)
                finally:
                    self.counting = False

        for tensor in outputs:
            tensor.register_hook(backward_reached)

    # --- every training micro-batch --------------------------------------------------------------

    def micro_batch(self, model: Any, inner: Any, steps: int, micro: int, name_of: Callable[[str], str]) -> None:
        """At training micro-batch `micro` (0-based) after `steps` optimizer steps: the flags of `inner` (the model
        the wrapper holds), and the no-gradient parameters' digests for the first WATCHED_STEPS steps."""
        if model is not self._model:
            self._model = model
            self._modules = [(name_of(name), m) for name, m in inner.named_modules()]
            self._all_frozen = [(name_of(name), p) for name, p in inner.named_parameters() if not p.requires_grad]
            self._frozen = _within(self._all_frozen, FROZEN_BYTES)
            self._flags, self._frozen_digests = None, {}
        flags = tuple(m.training for _, m in self._modules)
        if flags != self._flags:
            self._flags = flags
            off = sorted(((name, m) for name, m in self._modules if not m.training),
                         key=lambda named: not isinstance(named[1], MODE_SENSITIVE))
            self.trail.modes.append(ModeChange(steps + 1, micro, tuple(module_label(*o) for o in off[:NAMED]),
                                               len(off), len(self._modules), self._eval_call if off else None))
        if self._all_frozen:  # a parameter unfrozen since (after DDP was built) gets gradients: no longer one of them
            self.trail.frozen_names = [name for name, p in self._all_frozen if not p.requires_grad]
        if self._frozen and steps <= WATCHED_STEPS:
            self._watch_frozen(steps)

    def _watch_frozen(self, steps: int) -> None:
        now = {name: _crc(p) for name, p in self._frozen if not p.requires_grad}
        if self._frozen_digests:
            changed = [name for name, value in now.items() if self._frozen_digests.get(name) != value]
            if changed:
                self.trail.frozen.append(FrozenChange(steps, tuple(changed[:NAMED]), len(changed)))
        self._frozen_digests = now


def _within(named: list[tuple[str, Any]], budget: int) -> list[tuple[str, Any]]:
    """The first tensors of `named` whose bytes fit in `budget` together."""
    kept = []
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        if size <= budget:
            kept.append((name, tensor))
            budget -= size
    return kept


def _crc(tensor: Any) -> int:
    return zlib.crc32(readable_bytes(tensor))


def _tensors(value: Any) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _user_site() -> str | None:
    """The innermost frame of the user's code on the stack, as "file:line in function"."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if is_users(frame.filename):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"
    return None


# --- judging, on every rank's trail ----------------------------------------------------------------


class _Modes(NamedTuple):
    """The modules in eval mode at one step of one rank's fit."""

    named: tuple[str, ...]
    count: int
    call: str | None
    modules: int

    def listed(self) -> str:
        shown = ", ".join(self.named[:3])
        if self.count == self.modules:
            return f"every module ({shown}{' among them' if self.count > 3 else ''})"
        return shown + (f" and {self.count - 3} more module(s)" if self.count > 3 else "")

    def words(self) -> str:
        return "training mode" if not self.count else f"training mode but for {self.listed()}"

    def after_call(self) -> str:
        return f" (after model.eval() at {self.call}, and no model.train() after it)" if self.call else ""


def _modes_at(trail: ReplicaTrail, step: int) -> _Modes:
    change = trail.mode_at(step)
    if change is None:
        return _Modes((), 0, None, 0)
    return _Modes(change.eval_modules, change.eval_count, change.eval_call, change.modules)


def modes_apart(trails: list[ReplicaTrail]) -> tuple[int, str] | None:
    """Where the ranks train their modules in different modes: None when they never do; else the first step at which
    they do and a verdict naming the rank, the modules and the call that set them (input: every rank's trail)."""
    steps = sorted({change.step for trail in trails for change in trail.modes})
    for step in steps:
        sets = [_modes_at(trail, step) for trail in trails]
        if len({m.named for m in sets}) == 1:
            continue
        most = max(range(len(sets)), key=lambda r: (sets[r].count, -r))
        odd = sets[most]
        others = ", ".join(f"rank {r} in {m.words()}" for r, m in enumerate(sets) if m.named != odd.named)
        return step, (f"rank {most} trains with {odd.listed()} in eval mode from step {step}{odd.after_call()}, "
                      f"{others}: Dropout is off and BatchNorm normalises by frozen running statistics on one rank "
                      "only, while DDP averages the gradients, so the ranks train different models in lockstep "
                      "(call model.train() after an evaluation, on the rank that ran it)")
    return None


def modes_resumed(full: ReplicaTrail, resumed: ReplicaTrail, k: int, n: int) -> str:
    """Where the fit resumed at step k trains its modules in another mode than the uninterrupted fit at the same step
    (a fresh process starts in training mode; an evaluation's model.eval() without model.train() is not in any
    checkpoint): "" where they agree at every step up to n."""
    for step in range(k + 1, n + 1):
        before, after = _modes_at(full, step), _modes_at(resumed, step - k)
        if before.named == after.named:
            continue
        if not before.count:
            return (f"the resumed fit trains with {after.listed()} in eval mode at step {step}{after.after_call()}, "
                    "where the uninterrupted fit trains in training mode: a module's training flag is state no "
                    "checkpoint holds")
        change = full.mode_at(step)
        since = change.step if change is not None else step
        return (f"the uninterrupted fit trains with {before.listed()} in eval mode from step {since}"
                f"{before.after_call()}, the resumed fit at step {step} in {after.words()}: a module's training "
                "flag is state no checkpoint holds, so the run cannot be resumed as it ran (call model.train() after "
                "an evaluation)")
    return ""


def frozen_changers(trails: list[ReplicaTrail], names: set[str]) -> str:
    """Which ranks changed the no-gradient parameters among `names` (that differ between ranks), and from which step:
    "" when none of `names` is a parameter without gradient."""
    frozen = [n for n in names if any(n in trail.frozen_names for trail in trails)]
    if not frozen:
        return ""
    changed: dict[int, FrozenChange] = {}
    for rank, trail in enumerate(trails):
        if trail.frozen:
            changed[rank] = trail.frozen[0]
    shown = ", ".join(sorted(frozen)[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
    if not changed:
        return f"{shown} (requires_grad=False) differ between ranks with no change seen in the fit's first steps"
    lead = min(changed, key=lambda r: changed[r].step)
    ranks = sorted(changed)
    still = [r for r in range(len(trails)) if r not in changed]
    who = ", ".join(f"rank {r}" for r in ranks)
    rest = (f", while {', '.join(f'rank {r}' for r in still)} leave{'s' if len(still) == 1 else ''} them as built"
            if still else ", differently on each")
    return f"{shown} (requires_grad=False) change with no gradient on {who} from step {changed[lead].step}{rest}"
