"""The precision a fit really ran at, and how it used a GradScaler, seen from torch's own entry points.

A `script:` trainer runs its own command line, and a class trainer may enter autocast whatever the
harness's config says: the config's `trainer.precision` is a claim, not an observation. So while a fit
runs, `AmpWatch` records:

- at each training micro-batch (the recorder's `_micro_batch`, or its own forward hook when used
  alone): whether autocast was on for the model's device where the model computes (inside its forward,
  where accelerate enters it) and its dtype, and the parameters' dtype;
- every `GradScaler.scale` of an enabled scaler, with the scale it multiplied by; every `unscale_`, and
  every `GradScaler.step`, whether the optimizer stepped (a skipped step: its scaled gradients held
  inf or NaN);
- every gradient clipping through `torch.nn.utils` (`clip_grad_norm_`, `clip_grad_value_`,
  `clip_grads_with_norm_` where this torch has it), and whether it ran on gradients a scaler had scaled
  and not yet unscaled for the optimizer that then stepped them: a norm clipped at `max_norm` in
  scaled units is `max_norm / scale` once unscaled: the applied gradients' norm is at most 1/scale of it;
- every optimizer step taken directly (not through `scaler.step`) on gradients of a scaled loss never
  unscaled: the loss scale stays in the applied update.

Which optimizer a clipping concerns is known only when an optimizer steps the clipped parameters, so
each clipping is kept (with what was scaled and unscaled at that moment) and judged at the next step
of each optimizer that holds its parameters. The record (`AmpRecord`) holds plain values, to gather
across ranks. torch 2.4 is the floor: the per-device autocast queries are read where they exist.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.amp import GradScaler
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

#: clippings kept until an optimizer steps their parameters (a loop clips once an iteration)
KEPT_CLIPS = 64
_UNREAD = object()  # no autocast state was read inside the micro-batch's forward
#: the precision names of a run under autocast, by autocast dtype
MIXED = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
#: the precision names of a run without autocast, by the parameters' dtype
TRUE = {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float64: "64-true", torch.float32: "32-true"}
#: the `torch.nn.utils` clipping functions watched, where this torch has them
CLIPPERS = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "clip_grad_norm")


class ScaledClip(NamedTuple):
    """A clipping that ran on gradients still multiplied by a GradScaler's scale."""

    function: str  # "clip_grad_norm_"
    scale: float
    step: int  # the optimizer step (1-based, of the optimizer that stepped them) it went into; 0: none followed

    def words(self) -> str:
        at = f"at optimizer step {self.step}" if self.step else "with no optimizer step after it"
        return f"{self.function} ran on gradients still scaled by {self.scale:g} (the GradScaler's loss scale) {at}"


class ScaledStep(NamedTuple):
    """An optimizer step taken directly on the gradients of a scaled loss never unscaled."""

    scale: float
    step: int


@dataclass
class AmpRecord:
    """What one fit did about precision on this rank, as plain values."""

    micro_batches: int = 0
    # per micro-batch state, counted: ("bfloat16" | "float16" | "off", the parameters' dtype name)
    states: dict[tuple[str, str], int] = field(default_factory=dict)
    device_type: str = ""
    scaled: int = 0  # GradScaler.scale calls of an enabled scaler
    scales: list[float] = field(default_factory=list)  # the distinct scales those multiplied by, in order
    unscaled: int = 0  # explicit `unscale_` calls before the step (scaler.step's own not counted)
    scaler_steps: int = 0  # GradScaler.step calls of an enabled scaler
    skipped: int = 0  # ... whose optimizer did not step (scaled gradients held inf or NaN)
    clips: int = 0  # clipping calls through torch.nn.utils
    clipped_scaled: list[ScaledClip] = field(default_factory=list)
    scaled_steps: list[ScaledStep] = field(default_factory=list)

    @property
    def autocast_batches(self) -> int:
        return sum(n for (dtype, _), n in self.states.items() if dtype != "off")

    @property
    def precision(self) -> str | None:
        """The precision the fit ran at, in Lightning's names ('bf16-mixed', '16-mixed', '32-true'...): the
        autocast dtype most of its micro-batches ran under, else its parameters' dtype; None without any."""
        if not self.micro_batches:
            return None
        under = Counter({dtype: n for (dtype, _), n in self.states.items() if dtype != "off"})
        if under:
            return MIXED.get(getattr(torch, under.most_common(1)[0][0]), "mixed")
        params = Counter({dtype: n for (_, dtype), n in self.states.items()}).most_common(1)[0][0]
        return TRUE.get(getattr(torch, params, None), f"{params}-true")

    def described(self) -> str:
        """The observation in words, for a note or a skip."""
        on = self.autocast_batches
        if not on:
            return f"no autocast at any of its {self.micro_batches} training micro-batches"
        dtypes = sorted({dtype for (dtype, _), n in self.states.items() if dtype != "off"})
        share = "every one" if on == self.micro_batches else f"{on}"
        return f"{self.device_type} autocast to {'/'.join(dtypes)} at {share} of its {self.micro_batches} training " \
               "micro-batches"

    def scaler_words(self) -> str:
        if not self.scaled:
            return "no GradScaler"
        skipped = f", {self.skipped} step(s) skipped" if self.skipped else ""
        return f"a GradScaler (scale {self.scales[0]:g}{skipped})"


@dataclass
class _Clip:
    seq: int
    function: str
    params: frozenset[int]
    scaled: tuple[int, float] | None  # (seq, scale) of the latest scale() then
    unscaled: dict[int, int]  # id(optimizer) -> seq of its latest unscale_ then
    judged: bool = False  # an optimizer that holds its parameters stepped since


def autocast_state(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for `device_type` in this thread, None when autocast is off there
    (torch 2.4 has the per-device `is_autocast_enabled(device_type)`; older spellings as a fallback)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:
        enabled = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not enabled:
        return None
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


class AmpWatch:
    """Installs the patches and hooks on entry, removes them on exit; `record` holds what they saw.
    `forwards=True` also watches outermost grad-enabled forwards itself (used alone, without a
    `FitRecorder`, which otherwise calls `micro_batch`)."""

    def __init__(self, forwards: bool = False) -> None:
        self.record = AmpRecord()
        self._forwards = forwards
        self._stack = contextlib.ExitStack()
        self._seq = 0
        self._scaled: tuple[int, float] | None = None
        self._unscale_seq: dict[int, int] = {}
        self._last_step: dict[int, int] = {}
        self._steps: Counter[int] = Counter()
        self._clips: list[_Clip] = []
        self._local = threading.local()
        self._fired = False
        self._pending: tuple[str, str, torch.dtype | None] | None = None  # a micro-batch whose state is unread
        self._hooked: set[int] = set()  # models whose computing module `_inside` watches

    def __enter__(self) -> AmpWatch:
        self._stack.callback(register_optimizer_step_pre_hook(self._on_step).remove)
        self._stack.callback(register_optimizer_step_post_hook(self._on_stepped).remove)
        self._patch(GradScaler, "scale", self._scale)
        self._patch(GradScaler, "unscale_", self._unscale)
        self._patch(GradScaler, "step", self._scaler_step)
        for module in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in CLIPPERS:
                if hasattr(module, name):
                    self._patch(module, name, self._clipper(name))
        if self._forwards:
            self._watch_forwards()
        return self

    def __exit__(self, *exc: object) -> None:
        self._count_pending()
        self._stack.close()
        for clip in self._clips:  # no optimizer stepped them (a step's restatement): scaled by any optimizer's
            if not clip.judged and clip.scaled is not None and clip.scaled[1] > 1 and all(
                    seq <= clip.scaled[0] for seq in clip.unscaled.values()):
                self.record.clipped_scaled.append(ScaledClip(clip.function, clip.scaled[1], 0))

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        own = vars(owner).get(name)
        setattr(owner, name, make(getattr(owner, name)))
        if own is not None:
            self._stack.callback(setattr, owner, name, own)
        else:
            self._stack.callback(delattr, owner, name)

    # --- micro-batches ---------------------------------------------------------------------------

    def micro_batch(self, model: Any, inside: bool = True) -> None:
        """A training micro-batch's forward begins. Its autocast state is the one in force where the model
        computes: read as the module holding its first parameter starts (`_inside`), since a wrapper can enter
        autocast inside the forward (accelerate's `prepare` wraps the model's own forward in autocast, under
        DDP's); the state now, at the outermost forward, stands in if that module never runs, or where no
        module but the model may be hooked (`inside` False: a forward torch.compile traces)."""
        self._count_pending()
        param = next(iter(model.parameters()), None)
        device_type = param.device.type if param is not None else "cpu"
        self._pending = (device_type, str(param.dtype).removeprefix("torch.") if param is not None else "float32",
                         autocast_state(device_type))
        record = self.record
        record.micro_batches += 1
        record.device_type = record.device_type or device_type
        if inside and param is not None and id(model) not in self._hooked:
            self._hooked.add(id(model))
            owner = next(m for m in model.modules() if any(p is param for p in m.parameters(recurse=False)))
            self._stack.callback(owner.register_forward_pre_hook(self._inside).remove)

    def _inside(self, _module: Any, _args: Any) -> None:
        if self._pending is not None:
            self._count_pending(autocast_state(self._pending[0]))

    def _count_pending(self, inside: Any = _UNREAD) -> None:
        """Count the pending micro-batch under the state read inside its forward, else the one at its start."""
        if self._pending is None:
            return
        _device, params, outer = self._pending
        self._pending = None
        dtype = outer if inside is _UNREAD else inside
        key = (str(dtype).removeprefix("torch.") if dtype is not None else "off", params)
        self.record.states[key] = self.record.states.get(key, 0) + 1

    def _watch_forwards(self) -> None:
        def before(module: Any, _args: Any) -> None:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            if depth == 0 and torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
                self.micro_batch(module)

        def after(_module: Any, _args: Any, _output: Any) -> None:
            self._local.depth = max(0, getattr(self._local, "depth", 1) - 1)

        self._stack.callback(register_module_forward_pre_hook(before).remove)
        self._stack.callback(register_module_forward_hook(after, always_call=True).remove)

    # --- the scaler ------------------------------------------------------------------------------

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _scale(self, original: Any) -> Any:
        watch = self

        def scale(scaler: Any, outputs: Any) -> Any:
            result = original(scaler, outputs)
            if scaler.is_enabled():
                value = float(scaler.get_scale())
                watch._scaled = (watch._next(), value)
                watch.record.scaled += 1
                if not watch.record.scales or watch.record.scales[-1] != value:
                    watch.record.scales.append(value)
            return result

        return scale

    def _unscale(self, original: Any) -> Any:
        watch = self

        def unscale_(scaler: Any, optimizer: Any) -> Any:
            result = original(scaler, optimizer)
            if scaler.is_enabled():
                watch._unscale_seq[id(optimizer)] = watch._next()
                if not getattr(watch._local, "in_scaler_step", False):
                    watch.record.unscaled += 1
            return result

        return unscale_

    def _scaler_step(self, original: Any) -> Any:
        watch = self

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not scaler.is_enabled():
                return original(scaler, optimizer, *args, **kwargs)
            watch._settle(optimizer, through_scaler=True)
            watch.record.scaler_steps += 1
            watch._local.in_scaler_step, watch._fired = True, False
            try:
                result = original(scaler, optimizer, *args, **kwargs)
            finally:
                watch._local.in_scaler_step = False
                watch._last_step[id(optimizer)] = watch._next()  # after its own unscale_, skipped or not
            if not watch._fired:  # the optimizer never stepped: its scaled gradients held inf or NaN
                watch.record.skipped += 1
            return result

        return step

    def _on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._fired = True
        if not getattr(self._local, "in_scaler_step", False):
            self._settle(optimizer, through_scaler=False)

    def _on_stepped(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._last_step[id(optimizer)] = self._next()

    def _settle(self, optimizer: Any, through_scaler: bool) -> None:
        """An optimizer is about to step: judge the clippings of its parameters since its last step, and
        (outside scaler.step) a step on gradients of a scaled loss never unscaled."""
        key = id(optimizer)
        last = self._last_step.get(key, 0)
        self._steps[key] += 1
        step = self._steps[key]
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for clip in self._clips:
            if clip.seq <= last or not clip.params & params:
                continue
            clip.judged = True
            if _still_scaled(clip.scaled, clip.unscaled.get(key, 0), last):
                assert clip.scaled is not None
                self.record.clipped_scaled.append(ScaledClip(clip.function, clip.scaled[1], step))
        scaled = self._scaled
        if not through_scaler and _still_scaled(scaled, self._unscale_seq.get(key, 0), last) and any(
                p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            assert scaled is not None
            self.record.scaled_steps.append(ScaledStep(scaled[1], step))
        self._last_step[key] = self._next()

    # --- clipping --------------------------------------------------------------------------------

    def _clipper(self, name: str) -> Callable[[Any], Any]:
        watch = self

        def make(original: Any) -> Any:
            def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
                if getattr(watch._local, "clipping", False):  # clip_grad_norm_ calling its helpers
                    return original(parameters, *args, **kwargs)
                tensors, parameters = _listed(parameters)
                watch._clipped(name, tensors)
                watch._local.clipping = True
                try:
                    return original(parameters, *args, **kwargs)
                finally:
                    watch._local.clipping = False

            clip.__wrapped__ = original  # type: ignore[attr-defined]
            return clip

        return make

    def _clipped(self, name: str, tensors: list[Any]) -> None:
        self.record.clips += 1
        self._clips.append(_Clip(self._next(), name, frozenset(id(t) for t in tensors), self._scaled,
                                 dict(self._unscale_seq)))
        del self._clips[:-KEPT_CLIPS]


def _still_scaled(scaled: tuple[int, float] | None, unscaled_at: int, last_step: int) -> bool:
    """Whether an optimizer's gradients held a loss scale > 1: a scale() since its last step, and no
    unscale_ of it since then."""
    return scaled is not None and scaled[0] > last_step and scaled[1] > 1 and unscaled_at <= last_step


def _listed(parameters: Any) -> tuple[list[Any], Any]:
    """The tensors a clipping call names, and the argument to hand on: a generator is drained here, so the
    function gets a fresh generator over the same tensors (it warns on an empty one, as it would have)."""
    if isinstance(parameters, torch.Tensor):
        return [parameters], parameters
    tensors = list(parameters)
    handed: Any = (t for t in tensors) if isinstance(parameters, Iterator) else tensors
    return tensors, handed


def scaled_clipping(amps: list[AmpRecord | None]) -> str:
    """Where some rank clipped gradients a GradScaler had not unscaled yet, in words ("" where none did): a
    step then differs from its reference by ~1/scale, which is mixed_precision's verdict, not a comparison's."""
    clips = [a.clipped_scaled[0] for a in amps if a is not None and a.clipped_scaled]
    return f"{clips[0].words()}: mixed_precision's verdict" if clips else ""
