"""What the real fit did on this rank, recorded from torch's own hooks with no call in the trainer.

A check that asks the adapter to restate the trainer (`make_loader`, `train_step`) judges the
restatement: a loop that forgot `set_epoch` passes when the adapter's `make_loader` calls it. So
while a check runs `fit`/`resume`, a `FitRecorder` watches the process:

- every micro-batch: a training-mode, grad-enabled forward of a model with trainable parameters
  that no other module's forward encloses (the DDP wrapper, or the bare model of a trainer that
  forgot DDP), through the global, public `register_module_forward_pre_hook`/`_forward_hook`;
  for a DDP model also its settings and whether the micro-batch synchronised gradients
  (`require_backward_grad_sync`, which `no_sync()` clears);
- every optimizer step, through the global `register_optimizer_step_pre_hook`/`_post_hook`, and
  whether the gradients it applied were all exactly zero; on request (the plan's `first_step`) the first
  step itself: the parameters before its first micro-batch and the gradients the optimizer applied
  (read after the step's closure where it has one, as Lightning's automatic optimization passes);
- every pass of a DataLoader over its data (and its dataset) and the dataset indices each batch drew
  (`loader_watch.LoaderWatch`), and a digest of each training micro-batch's inputs: what the rank was
  fed, whatever made the batches; on request (the plan's `keep_batches`, with `first_step`) the batches
  the loader yielded for the first step's micro-batches, for a rerun fed the same batches;
- every `torch.distributed.algorithms.Join` the fit builds (DDP's `join()` builds one), by wrapping its
  `__init__`: what it joins, and whether it is enabled and throws on early termination.
- every `torch.amp.GradScaler.step` (Lightning's 16-mixed calls one too) that skips its optimizer's step
  because the scaled gradients overflowed: the optimizer's step hooks never run then, yet the trainer's
  loop counts the step, so it is counted as a step with unchanged parameters, and before the first
  applied step it is recorded (`FirstStep.overflowed`), not mistaken for a longer window.
- the precision each micro-batch ran at (autocast and its dtype), the GradScaler's scale, `unscale_` and
  skipped steps, and gradient clipping on gradients still scaled (`amp_watch.AmpWatch`, `FitRecord.amp`).
- whatever one check alone reads, by the watchers the check's plan brings (`fit_watch.FitWatcher`), each
  called at the moments it asks for; the recorder knows none of them by name.

Hooks are process-wide, so the fit may run in another thread (progress.guarded_fit does). One
recorder at a time: a rank runs one fit at a time. A `listener` (a `FitObserver`) hears the fit in
the adapter's own vocabulary (`on_wrapped`, `before_step`, `after_step`), derived from the hooks,
so no adapter has to call an observer for progress, hang diagnosis or vacuity evidence.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.amp import GradScaler
from torch.distributed.algorithms.join import Join
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ...adapter import StepInfo, TrainState
from .amp_watch import AmpWatch
from .digests import fed_digest, input_digest, nonzero
from .fit_record import DIGESTED_INPUTS, FirstStep, FitRecord, JoinUse, LoaderPass, RngMark
from .fit_watch import HOOKS, RECORD_ONLY, FitPlan, overridden
from .loader_watch import LoaderHooks, LoaderWatch
from .replica_watch import ReplicaWatch

#: with `draws`: the latest batches a micro-batch may have come from (a loop holds one, or two reading ahead)
HELD_BATCHES = 8
TRACED_RNG = 4096  # the RNG state is kept for the first micro-batches, no more (`FitRecord.rng_trail`)
# torch 2.13 keeps `forward_sync_buffers` where older releases kept `broadcast_buffers`; both are read
DDP_SETTINGS = ("gradient_as_bucket_view", "static_graph", "find_unused_parameters", "broadcast_buffers",
                "forward_sync_buffers", "bucket_bytes_cap")

#: what `comm_hook_name` says where this torch's DDP does not tell: a hook may be there
UNKNOWN_HOOK = "unknown"
#: the BatchNorm layers, by their public classes (torch's own conversion tests its private `_BatchNorm`)
BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def comm_hook_name(model: DistributedDataParallel) -> str | None:
    """The communication hook registered on `model` (`register_comm_hook`, a built-in one, or Lightning's
    `ddp_comm_hook`), by name, or None for DDP's own all-reduce. Read from DDP's logging data (private:
    tests/test_versions.py fails when it stops answering), which both ways of registering a hook set."""
    logging_data = getattr(model, "_get_ddp_logging_data", None)
    if logging_data is None:
        return UNKNOWN_HOOK
    return logging_data().get("comm_hook") or None


class FitRecorder:
    """Installs the hooks on entry and removes them on exit; `record` holds what they saw."""

    _lock = threading.Lock()

    def __init__(self, listener: Any = None, rank: int = 0, plan: FitPlan = RECORD_ONLY) -> None:
        """`listener`: the `FitObserver` that hears the fit; `plan`: what to keep beyond the record, and the
        watchers to call (`fit_watch`)."""
        self.record = FitRecord(watchers=[make() for make in plan.watchers])
        # per hook, the watchers that override it: a fit without watchers pays nothing per module forward
        self._hooks = {hook: [getattr(w, hook) for w in self.record.watchers if overridden(w, hook)]
                       for hook in HOOKS}
        self._skipped = 0  # optimizer steps a GradScaler skipped, counted in `optimizer_steps` as the trainer counts
        self._capture_first_step = plan.first_step
        self._all_inputs = plan.all_inputs
        self._on_first_micro_batch = plan.on_first_micro_batch
        self._model_hooks_only = plan.model_hooks_only
        self._forward_hooks: list[Any] = []  # the global forward hooks' handles
        # (model, pass, index) of a micro-batch whose positional inputs hold no tensor: its keyword inputs
        # (`model(input_ids=x)`, as Hugging Face calls a model) reach only a hook of the model's own
        self._keyword_fed: tuple[Any, LoaderPass, int] | None = None
        self.listener = listener
        self.rank = rank
        self._stack = contextlib.ExitStack()
        self._depth = threading.local()
        self._open: Any = None  # the StepInfo of the micro-batch in progress
        self._rng_mark: str | None = None  # the RNG state after the last draw accounted for (`rng_consumed`)
        self._loader_drew = False  # a DataLoader drew from the RNG since the last RngMark
        self._replicas = ReplicaWatch(self.record.replicas)
        self._loaders = LoaderWatch(self.record, plan,
                                    LoaderHooks(self._patch, self._loaders_own_draws, self._heartbeat))

    def __enter__(self) -> FitRecorder:
        if not FitRecorder._lock.acquire(blocking=False):
            raise RuntimeError("a FitRecorder is already recording in this process")
        self._stack.callback(FitRecorder._lock.release)
        self._torch = torch
        self._forward_hooks = [register_module_forward_pre_hook(self._on_forward),
                               register_module_forward_hook(self._on_forward_end, always_call=True)]
        for handle in self._forward_hooks:
            self._stack.callback(handle.remove)
        self._stack.callback(register_optimizer_step_pre_hook(self._on_optimizer_pre_step).remove)
        self._stack.callback(register_optimizer_step_post_hook(self._on_optimizer_step).remove)
        self._loaders.install()
        self._patch(DistributedDataParallel, "__init__", self._ddp_init)
        self._patch(Join, "__init__", self._join_init)
        self._amp = self._stack.enter_context(AmpWatch())
        self.record.amp = self._amp.record
        self._patch(GradScaler, "step", self._scaler_step)
        self._patch(torch.nn.Module, "train", self._replicas.wrap_train)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._close_micro_batch()
            self._settle_rng()
            for on_end in self._hooks["on_end"]:
                on_end(self.record)
        finally:
            self._stack.close()

    def _patch(self, owner: type, name: str, make: Any) -> None:
        """Wrap `owner.name` (its own or inherited) until the fit ends, then put back what it had."""
        own = owner.__dict__.get(name)
        setattr(owner, name, make(getattr(owner, name)))
        if own is not None:
            self._stack.callback(setattr, owner, name, own)
        else:
            self._stack.callback(delattr, owner, name)

    # --- hooks ------------------------------------------------------------------------------------

    def _on_forward(self, module: Any, _args: Any) -> None:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        if recomputing():
            return
        if depth == 0 and module.training and self._torch.is_grad_enabled() and _trainable(module):
            self._micro_batch(module, _args)
        elif depth == 0:
            self._replicas.holds(module, _args, self.record.model)  # an eval-mode forward that may train
        for on_forward in self._hooks["on_forward"]:
            on_forward(module, depth, self.record)

    def _on_keyword_inputs(self, module: Any, _args: Any, kwargs: dict[str, Any], _output: Any) -> None:
        """A micro-batch fed by keyword is digested by its keyword inputs (`_keyword_fed`)."""
        pending, self._keyword_fed = self._keyword_fed, None
        if pending is not None and pending[0] is module and kwargs:
            pending[1].inputs[pending[2]] = fed_digest(kwargs)

    def _on_forward_end(self, module: Any, args: Any, output: Any) -> None:
        self._depth.value = max(0, getattr(self._depth, "value", 1) - 1)
        if self._depth.value == 0:
            self._replicas.ended(module, output, self._micro_batch)
        if self._hooks["on_forward_end"] and not recomputing():
            for on_forward_end in self._hooks["on_forward_end"]:
                on_forward_end(module, args, output, self.record)

    def _micro_batch(self, model: Any, inputs: Any) -> None:
        record = self.record
        first = record.micro_batches == 0
        if first and self._on_first_micro_batch is not None:
            self._on_first_micro_batch(model)
        if first and self._model_hooks_only:
            self._hook_the_model_alone(model)
        if first:
            record.model_type, record.model = type(model).__name__, model
            # a forward hook: torch gathers a forward's pre-hooks before the global one that calls this runs, its
            # forward hooks after the forward, so this one digests this forward's keyword inputs too
            self._stack.callback(model.register_forward_hook(self._on_keyword_inputs, with_kwargs=True).remove)
            record.bypassed_ddp = any(wrapped is model for wrapped in record.ddp_modules)
            self._watch_local_grads(model)
            record.first_from_backward = self._replicas.counting
            for on_model in self._hooks["on_model"]:
                on_model(model, record)
            if self._capture_first_step:
                record.first_step = FirstStep([p.detach().cpu().clone() for p in unwrapped(model).parameters()])
        if isinstance(model, DistributedDataParallel):
            if record.ddp is None:
                record.ddp = {name: getattr(model, name, None) for name in DDP_SETTINGS}
            if record.micro_batches < 2:  # a hook comes before the first backward, so the second forward sees it
                record.ddp["comm_hook"] = comm_hook_name(model)
            record.synced.append(bool(model.require_backward_grad_sync))
        self._loaders.micro_batch(inputs)
        self._amp.micro_batch(model, inside=not self._model_hooks_only)
        self._mark_rng(first)
        self._replicas.micro_batch(model, unwrapped(model), record.optimizer_steps, record.micro_batches, trainer_name)
        record.micro_batches += 1
        training = record.training_passes()
        if record.passes and not record.passes[-1].trained:
            record.passes[-1].trained = True
            training = record.training_passes()
        fed = record.passes[-1] if record.passes else None  # trained: marked just above
        if fed is not None and len(fed.inputs) < DIGESTED_INPUTS and (
                not fed.inputs or not fed.indexed or self._all_inputs):
            fed.inputs.append(fed_digest(inputs))  # the first always (iterable datasets); all without indices
            self._keyword_fed = (model, fed, len(fed.inputs) - 1) if fed.inputs[-1] is None else None
        self._close_micro_batch()
        if self.listener is None:
            return
        if first:
            self.listener.on_wrapped(model)
        self._open = self._step_info(model, training)
        self.listener.before_step(self._open)

    def _hook_the_model_alone(self, model: Any) -> None:
        """Forward hooks on `model` only, in place of the global ones (called from its first forward's pre-hook:
        its forward hook, registered now, still ends this forward)."""
        for handle in self._forward_hooks:
            handle.remove()
        self._stack.callback(model.register_forward_pre_hook(self._on_forward).remove)
        self._stack.callback(model.register_forward_hook(self._on_forward_end, always_call=True).remove)

    def _rng_digest(self) -> str:
        """torch's CPU RNG state and, once CUDA is in use, the current device's CUDA RNG state: dropout on a GPU
        draws from that one, so a trainer's draws on either are seen."""
        cpu, cuda = input_digest(self._torch.get_rng_state()), _cuda_rng()
        return cpu if cuda is None else f"{cpu}+{cuda}"

    def _mark_rng(self, first: bool) -> None:
        record = self.record
        now = self._rng_digest()
        if first:
            record.first_rng, record.rng_consumed = now, False
        else:
            self._settle_rng(now)
        self._rng_mark = now
        if len(record.rng_trail) < TRACED_RNG:
            record.rng_trail.append(RngMark(record.optimizer_steps, now, self._loader_drew))
        self._loader_drew = False

    def _settle_rng(self, now: str | None = None) -> None:
        """A change of the RNG state since the last mark is a draw of the trainer's (from the first micro-batch on)."""
        if self._rng_mark is None:
            return
        now = now or self._rng_digest()
        if now != self._rng_mark:
            self.record.rng_consumed, self._rng_mark = True, now

    def _heartbeat(self) -> None:
        if self.listener is not None and hasattr(self.listener, "heartbeat"):
            self.listener.heartbeat()

    @contextlib.contextmanager
    def _loaders_own_draws(self) -> Iterator[None]:
        """What the RNG gives inside this block is the DataLoader's own (a pass's seeds), not the trainer's."""
        self._settle_rng()
        before = self._rng_digest()
        try:
            yield
        finally:
            after = self._rng_digest()
            self._loader_drew = self._loader_drew or after != before
            if self._rng_mark is not None:
                self._rng_mark = after

    def _watch_local_grads(self, model: Any) -> None:
        """A hook on each trainable parameter sees the gradient this rank's backward computes, before
        DDP's reducer averages it with the other ranks' (DDP acts after accumulation): a rank whose
        loss is zeroed or masked still steps in sync, and only here shows that it adds nothing.
        Checks until the first nonzero gradient, then costs an attribute test per parameter."""
        record = self.record

        def seen(grad: Any) -> None:
            # a compiled graph's backward hands a parameter it did not use a None gradient (eager: no call)
            if not record.local_grad_nonzero and grad is not None:
                record.local_grad_nonzero = nonzero(grad)

        for param in unwrapped(model).parameters():
            if param.requires_grad:
                self._stack.callback(param.register_hook(seen).remove)

    def _step_info(self, model: Any, training: list[LoaderPass]) -> Any:
        record = self.record
        current = training[-1] if training else None
        position = len(current.batches) - 1 if current is not None and current.batches else record.micro_batches - 1
        return StepInfo(rank=self.rank, epoch=max(0, len(training) - 1), global_step=record.optimizer_steps,
                        position=max(0, position), batch_size=0,
                        optimizer_step=bool(record.synced[-1]) if record.synced else True)

    def _close_micro_batch(self) -> None:
        if self._open is not None and self.listener is not None:
            opened, self._open = self._open, None
            self.listener.after_step(opened)

    def _register(self, optimizer: Any) -> None:
        if not any(seen is optimizer for seen in self.record.optimizers):  # its first step: nothing applied yet
            self.record.optimizers.append(optimizer)
            outside = self.record.stepped_outside_model() if self.record.model is not None else {}
            for name, tensor in outside.items():
                self.record.outside_start.setdefault(name, input_digest(tensor))

    def _on_optimizer_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        self._register(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            self.record.grad_steps += 1
            # the smallest first: a bias's gradient answers at once, where an embedding's (mostly zero rows)
            # was read whole at every step
            self.record.nonzero_grad_steps += any(nonzero(g) for g in sorted(grads, key=lambda g: g.numel()))
        first = self.record.first_step
        applied = self.record.optimizer_steps - self._skipped
        if not self._capture_first_step or applied or (first is not None and first.grads):
            return None  # (Lightning's first step runs its first micro-batch inside the closure: no `first` yet)
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            self._take_first_grads()
            return None

        def closure_then_take() -> Any:  # the step's backward runs inside its closure
            result = closure()
            self._take_first_grads()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_take}
        return (closure_then_take, *args[1:]), kwargs

    def _take_first_grads(self) -> None:
        record = self.record
        if record.first_step is None or record.model is None:
            return
        grads = [p.grad for p in unwrapped(record.model).parameters()]
        record.first_step.grads = [g.detach().to("cpu", torch.float64, copy=True) if g is not None else None
                                   for g in grads]
        record.first_step.micro_batches = record.micro_batches
        record.first_step.rng_drawn = self._rng_digest() != record.first_rng

    def _on_optimizer_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        record = self.record
        record.optimizer_steps += 1
        if optimizer is record.optimizer:
            record.iterations += 1
        for on_step in self._hooks["on_step"]:
            on_step(record)

    def _ddp_init(self, original: Any) -> Any:
        record, on_wraps = self.record, self._hooks["on_wrap"]

        def __init__(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            original(ddp, module, *args, **kwargs)
            record.ddp_modules.append(module)
            if on_wraps:
                bound = bind_ddp_arguments(original, ddp, module, args, kwargs)
                for on_wrap in on_wraps:
                    on_wrap(ddp, module, bound)

        return __init__

    def _join_init(self, original: Any) -> Any:
        record = self.record
        signature = inspect.signature(original)

        def __init__(join: Any, *args: Any, **kwargs: Any) -> None:
            original(join, *args, **kwargs)
            bound = signature.bind(join, *args, **kwargs)
            bound.apply_defaults()
            record.joins.append(JoinUse(tuple(type(j).__name__ for j in bound.arguments["joinables"]),
                                        bool(bound.arguments["enable"]),
                                        bool(bound.arguments["throw_on_early_termination"])))

        return __init__

    def _scaler_step(self, original: Any) -> Any:
        record = self.record

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = record.optimizer_steps
            result = original(scaler, optimizer, *args, **kwargs)
            if record.optimizer_steps == before:  # the optimizer did not step: its scaled gradients held inf or NaN
                first = record.first_step
                if first is not None and first.grads is None:
                    first.overflowed += 1
                # the trainer's loop counts it as a step (Lightning's global_step, a loop's counter), so steps,
                # digests and the snapshot at step k stay where the trainer's fit(k) and checkpoint put them
                self._skipped += 1
                self._register(optimizer)
                self._on_optimizer_step(optimizer, (), {})
            return result

        return step


def _cuda_rng() -> str | None:
    """A digest of the current CUDA device's RNG state (dropout on a GPU draws from it), None without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return input_digest(torch.cuda.get_rng_state())


def trainer_name(name: str) -> str:
    """A tensor's name in the model the micro-batches ran through, as the trainer names it: a Lightning
    module sits inside DDP inside Lightning's wrapper, as `_forward_module`."""
    return name.removeprefix("_forward_module.")


def buffer_names(model: Any) -> list[str]:
    """The buffers of the model the micro-batches ran through (none for no model), as the trainer names them."""
    return [trainer_name(name) for name, _ in unwrapped(model).named_buffers()] if model is not None else []


def unwrapped(model: Any) -> Any:
    """The model inside DDP (or any wrapper that keeps it as `.module`)."""
    return getattr(model, "module", model)


def recomputing() -> bool:
    """Whether a forward runs inside a backward: activation checkpointing (reentrant or not) recomputes its
    blocks' forwards there, which is no micro-batch of the fit (private: tests/test_versions.py asserts it)."""
    return torch._C._current_graph_task_id() >= 0


def _trainable(module: Any) -> bool:
    return any(p.requires_grad for p in module.parameters())


class ObservedState:
    """A `TrainState` read off the objects the fit used, for an adapter whose `fit`/`resume` returns
    nothing: the model's state_dict (without DDP's `module.`) and the optimizer's. Counters are not
    observable in absolute terms (a resumed fit counts from its checkpoint), so none are compared."""

    @staticmethod
    def of(result: Any, record: FitRecord) -> Any:
        if isinstance(result, TrainState):
            return result
        if record.model is None:
            raise RuntimeError("the fit returned no TrainState and ran no training forward to read one from")
        module = getattr(record.model, "module", record.model)
        params = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        optimizer = _cpu(record.optimizer.state_dict()) if record.optimizer is not None else {}
        return TrainState(params=params, optimizer=optimizer, scheduler=None, epoch=0,
                          global_step=record.optimizer_steps, position=0, observed=True)


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu(v) for v in value)
    return value


@contextlib.contextmanager
def ddp_argument_forced(name: str, value: Any) -> Iterator[None]:
    """Every `DistributedDataParallel(...)` built meanwhile gets `name=value`, its other arguments as
    the caller gave them (by keyword or by position): a trainer's own DDP, rerun with one setting the
    check needs (a process group of one, a gradient_as_bucket_view flag)."""

    original = DistributedDataParallel.__init__
    signature = inspect.signature(original)
    if name not in signature.parameters:
        raise AssertionError(f"DistributedDataParallel.__init__ takes no {name}: "
                             "update ddp_conformance.checks.support.observe")

    def __init__(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.arguments[name] = value
        original(*bound.args, **bound.kwargs)

    with mock.patch.object(DistributedDataParallel, "__init__", __init__):
        yield


def trains_batchnorm(model: Any) -> bool:
    """Whether the model normalises in training mode by each micro-batch's own statistics (BatchNorm),
    so that no run on another batch can recompute its gradients."""
    return any(isinstance(m, BATCH_NORMS) and m.training for m in unwrapped(model).modules())


def bind_ddp_arguments(init: Any, ddp: Any, module: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> inspect.BoundArguments | None:
    """DistributedDataParallel's constructor arguments by name, defaults included (None: they do not bind)."""
    try:
        bound = inspect.signature(init).bind(ddp, module, *args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return bound
