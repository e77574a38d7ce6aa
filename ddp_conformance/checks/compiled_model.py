"""compiled_model (opt-in): the trainer's fit with the model DDP wraps under `torch.compile` ends where its
eager fit ends.

The guides compile the model for speed and promise the same training. What breaks that silently
(measured, docs/checks/compiled_model.md): the graph dynamo traces at the first compiled forward holds the module hooks
present then, and dynamo does not guard on module hooks (`torch._dynamo.config.skip_nnmodule_hook_guards`,
on by default), so a hook a trainer registers later (a regulariser switched on after a warm-up, a clamp
added for stability) runs in the eager model and never in the compiled one.

Runs: the dropout-free fit other checks share (`shared_fit.steady`, eager, `STEPS` optimizer steps) and the
same fit with the model compiled where the harness first sees its DDP module, in its first forward's
pre-hook, before DDP calls the model it wraps (`compile_in_place`: `DDP(torch.compile(model))`, or a
LightningModule as Lightning compiles it). A trainer that compiles its model itself is compared the other
way, against its fit under `torch.compiler.set_stance("force_eager")` (torch >= 2.6). A model with dropout
layers runs both fits with them at 0, since a compiled graph draws its masks in another order. The final
states (parameters and buffers) are compared per tensor, relative to each tensor's largest value, within
`TOLERANCE`, by precision.

Precondition (`support/reproducible.py`): before final states apart are blamed on torch.compile, the eager side
run twice from scratch must end in the same place (the shared fit and its kept repeat, or this check's own eager
fit, with dropout at 0 or under force_eager, again). A script that never seeds its model or data
(the DDP tutorial's, minGPT's) trains another model every fit, 1.88 and 1.98 apart; it skips, naming
resume_fidelity's "the fit is not reproducible". Fits that agree need no such proof, and pay no repeat.

Verdicts: final states apart beyond the tolerance fail, naming the worst tensor and, where the fit
registered module hooks after its first forward, those hooks; a compiled fit that raises where the eager
one trains fails with its error's first line. Skips, with the reason: a fit that is not reproducible, a Python
torch.compile does not support, a machine without a C++ compiler inductor can run, a fit through no DDP, a
precision without a measured tolerance, a trainer that compiles itself on a torch without `set_stance`, a
bucket cap dynamo's DDPOptimizer refuses to split the graph at.

Opt-in (`--ddp-checks compiled_model`): compiling costs seconds a trainer on a CPU.
"""

from __future__ import annotations

import traceback
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from ..adapter import FitObserver, TrainState
from .support import shared_fit
from .support.adapter_errors import AdapterError
from .support.check_context import CheckContext, all_gather, hide_on_verdict, rounded
from .support.first_steps import dropout_layers, final_floats, zero_dropout
from .support.fit_watch import FitPlan
from .support.gradients import max_delta
from .support.observe import unwrapped
from .support.progress import PeerFitFailed, guarded_fit
from .support.reproducible import require_agreement, require_reproducible

STEPS = shared_fit.STEADY_STEPS
#: the largest relative difference per tensor between the compiled and the eager fit that counts as rounding, by
#: precision: measured on CPU (gloo, world size 2, torch 2.13) up to 2.7e-6 in fp32 on both references with
#: basic.yaml, 4.7e-5 on Lightning's demo transformer, and 5.9e-4 in bf16-mixed with advanced.yaml
#: (docs/checks/compiled_model.md);
#: the mutants part by 0.0036 (a penalty on one step of three) to 0.42
TOLERANCE = {"32": 1e-3, "32-true": 1e-3, "bf16-mixed": 5e-3}
#: the DDP graph splitter a compiled DDP model runs through (torch/_dynamo/backends/distributed.py)
DDP_OPTIMIZER = "_dynamo/backends/distributed.py"
#: where torch.compile's wrapper (OptimizedModule) keeps the module it compiled
COMPILED_PREFIX = "_orig_mod"
#: what torch.compile's function keeps the function it compiled in (torch._dynamo.eval_frame; guarded by a test)
DYNAMO_WRAPPED = "_torchdynamo_orig_callable"
#: what inductor raises where the machine has no C++ compiler it can run (torch._inductor.exc)
NO_COMPILER = "InvalidCxxCompiler"
#: the module attributes holding its hooks, by the words a verdict names them with (torch keeps them in these
#: private dicts on every nn.Module; tests/checks/test_compiled_model.py fails loudly if one goes)
HOOK_DICTS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
              "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}


class CompileOnWrap(FitObserver):
    """At the fit's first forward, where the harness first sees its DDP module: lists the module hooks present
    (those registered later are named), sets the model's dropout to 0 where asked, and compiles the model DDP
    wraps where asked."""

    def __init__(self, compile_it: bool, without_dropout: bool) -> None:
        self.compile_it, self.without_dropout = compile_it, without_dropout
        self.hooks_at_wrap: dict[tuple[str, str, int], str] | None = None
        self.model: nn.Module | None = None

    def on_wrapped(self, model: nn.Module) -> None:
        self.model = model
        self.hooks_at_wrap = module_hooks(model)
        if self.without_dropout:
            zero_dropout(model)
        if self.compile_it:
            compile_in_place(unwrapped(model))

    def hooks_registered(self) -> list[str]:
        """The module hooks registered after the first forward, as "forward hook f on '0'" (a hook removed then is
        seen by the compiled graph: measured, docs/checks/compiled_model.md)."""
        if self.model is None or self.hooks_at_wrap is None:
            return []
        now = module_hooks(self.model)
        return [f"{key[1]} {now[key]} on '{key[0] or 'the model'}'" for key in now if key not in self.hooks_at_wrap]


def compile_in_place(inner: nn.Module) -> None:
    """Compile the model DDP wraps as its trainer would: a LightningModule's forward and training_step, as
    Lightning does with `Trainer.fit(torch.compile(module))` (`lightning.pytorch.utilities.compile.from_compiled`),
    any other model's forward, as `DDP(torch.compile(model))` runs it. In place, so that the fit's DDP, optimizer
    and state_dict keep the same module."""
    lightning = next((m for m in inner.modules() if callable(getattr(type(m), "training_step", None))), None)
    if lightning is None:
        inner.forward = torch.compile(inner.forward)  # type: ignore[method-assign]
        return
    lightning.forward = torch.compile(lightning.forward)  # type: ignore[method-assign]
    lightning.training_step = torch.compile(lightning.training_step)  # type: ignore[method-assign]


def module_hooks(model: nn.Module) -> dict[tuple[str, str, int], str]:
    """Every hook on `model`'s unwrapped modules: (module name, kind, handle id) -> the hook's name. Names as the
    trainer's model has them (a compiled module's `_orig_mod.` left out)."""
    found: dict[tuple[str, str, int], str] = {}
    for qualified, module in unwrapped(model).named_modules():
        name = qualified.replace(f"{COMPILED_PREFIX}.", "").removeprefix(COMPILED_PREFIX)
        for attribute, kind in HOOK_DICTS.items():
            for handle, hook in getattr(module, attribute, {}).items():
                found[(name, kind, handle)] = getattr(hook, "__qualname__", type(hook).__name__)
    return found


def compiled(model: nn.Module) -> bool:
    """Whether the trainer compiled the model its DDP wraps itself: `torch.compile(model)` (an OptimizedModule),
    `model.compile()`, or a method compiled in place (Lightning's `Trainer.fit(torch.compile(module))`)."""
    for module in (model, *unwrapped(model).modules()):
        if getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, COMPILED_PREFIX):
            return True
        if any(hasattr(vars(module).get(method), DYNAMO_WRAPPED) for method in ("forward", "training_step")):
            return True
    return False


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    _compile_supported()
    tolerance = TOLERANCE.get(str(shared_fit.steady_config(ctx).trainer.precision))
    if tolerance is None:
        pytest.skip(f"no measured tolerance for precision {ctx.config.trainer.precision!r} under torch.compile "
                    f"(measured: {', '.join(TOLERANCE)})")
    steady = shared_fit.steady(ctx)
    if None in all_gather(steady.record.ddp is not None or None):
        pytest.skip("the fit's micro-batches run through no DistributedDataParallel, so there is no DDP module to "
                    "compile (rank_participation judges the wrapping)")
    model = steady.record.model
    own = any(all_gather(model is not None and compiled(model)))
    if own and not hasattr(torch.compiler, "set_stance"):
        pytest.skip(f"the trainer compiles its model itself, and torch {torch.__version__} cannot run that fit "
                    "eagerly to compare (torch.compiler.set_stance arrived in 2.6)")
    dropout = any(all_gather(model is not None and bool(dropout_layers(unwrapped(model)))))
    if dropout:
        ctx.note("the model's dropout layers are set to p=0 in both fits compared: a compiled graph draws its masks "
                 "in another order than eager, even with inductor's fallback_random")
    figures: dict[str, Any] = {"steps": STEPS, "compiled_by": "the trainer" if own else "the check",
                               "tolerance": tolerance}
    eager, watches = steady.state, [CompileOnWrap(False, dropout), CompileOnWrap(not own, dropout)]
    if own or dropout:
        eager, error = _fit(ctx, "eager", watches[0], eager=own)
        if error is not None:  # the fit raises without compile too: the trainer's own error
            raise error
    # a trainer that compiles itself too: its shared fit may have compiled earlier in this process (below, `_fit`)
    compiled_state, error = _fit(ctx, "compiled", watches[1])
    if error is not None:
        return _raised(ctx, error, figures)
    assert eager is not None and compiled_state is not None
    name, delta, scale = max_delta(final_floats(compiled_state), final_floats(eager))
    name = name.replace(f"{COMPILED_PREFIX}.", "")  # as the trainer's model names it
    relative = max(all_gather(delta / scale if scale else 0.0))
    figures.update(max_rel_delta=relative, worst_tensor=name)
    seen = [hook for watch in watches for hook in watch.hooks_registered()]  # by the fits that ran here
    hooks = sorted({hook for hooks in all_gather(seen) for hook in hooks})
    if relative > tolerance:
        ctx.figures.update(figures)
        _eager_repeats(ctx, eager, watches[0] if own or dropout else None, own, tolerance)
        raise ctx.fail(_apart(name, relative, tolerance, hooks), **figures)
    figures["summary"] = f"compiled: same {STEPS} steps"
    return figures


def _eager_repeats(ctx: CheckContext, eager: TrainState, watch: CompileOnWrap | None, own: bool,
                   tolerance: float) -> None:
    """Skip, naming resume_fidelity's "not reproducible", where the eager side run again ends elsewhere (fits
    that agree show the fit repeats; two that part may only show that it does not): the shared fit and its
    kept repeat, or this check's own eager fit (`watch`: with dropout at 0, or under force_eager) run again.
    Not the shared fit for a trainer that compiles itself: a compiled fit with a late hook repeats only as
    far as dynamo's cache does, which is the bug this check names."""
    if watch is None:
        require_reproducible(ctx, "torch.compile", tolerance)
        return
    again, error = _fit(ctx, "eager-repeat", CompileOnWrap(False, watch.without_dropout), eager=own)
    if error is None:
        require_agreement(ctx, eager, again, "torch.compile", tolerance)


def _compile_supported() -> None:
    """Skip where torch.compile cannot run at all (a Python newer than the installed torch's dynamo)."""
    try:
        torch.compile(nn.Identity())
    except RuntimeError as exc:
        pytest.skip(f"torch.compile is not supported here: {str(exc).splitlines()[0]}")


def inductor_settings() -> Any:
    """Inductor's settings for the compiled fit (`torch._inductor.config`; tests/checks/test_compiled_model.py):
    - `fallback_random`: inductor draws dropout's random numbers with its own generator unless told to call eager's
      ops (the switch torch's accuracy-debugging docs give for this), so that a model with dropout the check cannot
      set to 0 (a script's functional dropout) draws the eager fit's masks;
    - `compile_threads=1`: the compile runs in the rank's own thread, not in a pool of worker processes the rank
      waits on, which the hang watchdog took for a stall (a cold compile on a loaded machine shows no progress
      for seconds) and which would outlive the check."""
    import torch._inductor.config as inductor_config  # deferred: imports the compiler

    return inductor_config.patch(fallback_random=True, compile_threads=1)


def _fit(ctx: CheckContext, label: str, watch: CompileOnWrap,
         eager: bool = False) -> tuple[TrainState | None, AdapterError | PeerFitFailed | None]:
    """The dropout-free fit again, watched by `watch`; `eager`: with every torch.compile in it ignored."""
    adapter = ctx.adapter(shared_fit.steady_config(ctx))

    def call(observer: FitObserver) -> TrainState:
        with torch.compiler.set_stance("force_eager") if eager else nullcontext(), inductor_settings():
            return adapter.fit(STEPS, observer=observer)

    # dynamo keeps compiled code per code object (nn.Sequential.forward is every Sequential's), guarded on the
    # parameters' shapes but not on module hooks: a fit compiled earlier in this rank process (another trainer of
    # the session with the same layers) was reused for the next one's model with its own hooks, and ran without
    # them (a control with a hook from its first forward failed in CI, 0.0226 apart): every fit compiles afresh
    torch.compiler.reset()
    try:
        state, _ = guarded_fit(ctx, label, STEPS, call, FitPlan(model_hooks_only=True), watch)
    except (AdapterError, PeerFitFailed) as exc:
        return None, exc
    return state, None


def _raised(ctx: CheckContext, error: BaseException, figures: dict[str, Any]) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    cause = error.__cause__ if error.__cause__ is not None else error
    text = str(cause).strip()
    raised = f"{type(cause).__name__}: {text.splitlines()[0][:200] if text else ''}"
    if NO_COMPILER in raised or any(type(e).__name__ == NO_COMPILER for e in _chain(cause)):
        pytest.skip(f"inductor finds no working C++ compiler on this machine ({raised}), so torch.compile cannot "
                    "compile for the CPU here: there is no compiled fit to compare (torch._inductor.config.cpp.cxx, or "
                    "$CXX)")
    if any(DDP_OPTIMIZER in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(cause.__traceback__)):
        pytest.skip(f"torch.compile cannot split this DDP model's graph at its buckets: dynamo's DDPOptimizer "
                    f"refuses it ({raised}; a bucket_cap_mb below DDP's 1 MB first bucket does this), so there is no "
                    "compiled fit to compare (torch._dynamo.config.optimize_ddp=False compiles without the split)")
    raise ctx.fail(f"under torch.compile the fit raises where the eager fit trains: {raised}", compiled_fit="raised",
                   **figures)


def _chain(error: BaseException) -> list[BaseException]:
    """The error and those it was raised from or while handling (inductor wraps its own in a backend error)."""
    chain: list[BaseException] = []
    while error is not None and error not in chain and len(chain) < 16:
        chain.append(error)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return chain


def _apart(name: str, relative: float, tolerance: float, hooks: list[str]) -> str:
    apart = (f"after {STEPS} steps {name} differs by {rounded(relative)} of its largest value from the eager fit's "
             f"(compiled kernels' rounding allows {rounded(tolerance)})")
    if not hooks:
        return f"under torch.compile the fit trains another model than eager: {apart}"
    return (f"the fit registers module hooks after its first forward ({'; '.join(hooks[:3])}), which the graph "
            f"torch.compile traced at that forward never runs (dynamo does not guard on module hooks: "
            f"torch._dynamo.config.skip_nnmodule_hook_guards), so the compiled model trains without them: {apart}. "
            "Register hooks before the first forward, and switch them on by a flag the hook reads")
