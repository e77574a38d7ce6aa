"""What a rank's model holds when training starts, and after the fit's first step, per tensor.

initial_sync judges whether every rank starts from the same model. DDP makes it so in two places
(torch/nn/parallel/distributed.py): when it is built it broadcasts rank 0's parameters, and its
buffers unless `broadcast_buffers=False` (`init_sync=False` skips both), the tensors the module holds
then; at each forward it broadcasts the buffers again (`broadcast_buffers`, `forward_sync_buffers`
from torch 2.13), re-reading the module's buffers by name (pytorch#63916), but only if the module held
a buffer when DDP was built (`will_sync_module_buffers`). So the state is read where the model
first computes with it: at the first forward of the module DDP wraps, after DDP's own forward-time
broadcast, and again when the one-step fit has ended, for the tensors nothing re-broadcasts before
the next forward. Only digests cross ranks.

`WrapTime` is what the recorder's DDP constructor wrapper (`FitRecorder`, public constructor
arguments only) saw when the fit built its DDP. `StartWatch` is the probe's watcher
(`fit_watch.FitWatcher`) for this check.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ..support.digests import input_digest
from ..support.fit_record import FitRecord
from ..support.fit_watch import FitWatcher
from ..support.observe import unwrapped

PARAMETER, BUFFER = "parameter", "buffer"


@dataclass(frozen=True)
class WrapTime:
    """What one DistributedDataParallel took over when it was built."""

    tensors: frozenset[int]  # ids of the module's parameters and buffers then
    ignored: frozenset[int]  # ... of those DDP was told to ignore (`_ddp_params_and_buffers_to_ignore`)
    init_sync: bool  # it broadcast rank 0's parameters when built
    init_buffers: bool  # ... and its buffers
    forward_buffers: bool  # it broadcasts rank 0's buffers at each forward ...
    had_buffers: bool  # ... which it does only if the module held a buffer it does not ignore when built
    seen: bool = True  # False: built before the fit was watched, so read off the DDP later (tensors as of then)

    @classmethod
    def of(cls, ddp: Any, module: Any, bound: inspect.BoundArguments | None) -> WrapTime:
        arguments = bound.arguments if bound is not None else {}
        forward = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True))
        if arguments.get("forward_sync_buffers") is not None:  # torch >= 2.13: init sync keeps the buffers
            init_buffers = True
        else:
            legacy = arguments.get("broadcast_buffers")
            init_buffers = True if legacy is None else bool(legacy)
        ignored_names = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        named = [*module.named_parameters(), *module.named_buffers()]
        had_buffers = any(name not in ignored_names for name, _ in module.named_buffers())
        return cls(tensors=frozenset(id(t) for _, t in named),
                   ignored=frozenset(id(t) for name, t in named if name in ignored_names),
                   init_sync=bool(arguments.get("init_sync", True)), init_buffers=init_buffers,
                   forward_buffers=bool(forward), had_buffers=had_buffers, seen=bound is not None)


@dataclass(frozen=True)
class TensorState:
    kind: str  # PARAMETER or BUFFER
    digest: str
    at_wrap: bool  # the module held it when DDP was built (False: created or registered afterwards)
    ignored: bool  # DDP was told to leave it alone (rank-local by design)
    forward_synced: bool  # DDP broadcasts it from rank 0 before every forward
    gradient: bool = True  # a parameter that gets gradients (requires_grad); False for a frozen one (a teacher copy)


@dataclass
class StartState:
    """This rank's model at the first forward (`start`) and at the end of the one-step fit (`after`)."""

    wrapped: bool  # a DDP built during the fit wraps the model
    wrap: WrapTime | None
    start: dict[str, TensorState] = field(default_factory=dict)
    after: dict[str, str] = field(default_factory=dict)


def tensor_states(model: Any, wrap: WrapTime | None, digest: Any) -> dict[str, TensorState]:
    """Every parameter and buffer of `model` (the unwrapped one), by name."""
    states: dict[str, TensorState] = {}
    for kind, named in ((PARAMETER, model.named_parameters()), (BUFFER, model.named_buffers())):
        for name, tensor in named:
            known = wrap is not None and id(tensor) in wrap.tensors
            ignored = wrap is not None and id(tensor) in wrap.ignored
            synced = (kind == BUFFER and not ignored and wrap is not None and wrap.forward_buffers
                      and wrap.had_buffers)
            states[name] = TensorState(kind, digest(tensor.detach()), known, ignored, synced,
                                       kind == BUFFER or tensor.requires_grad)
    return states


def after_states(model: Any, digest: Any) -> dict[str, str]:
    return {name: digest(t.detach()) for name, t in [*model.named_parameters(), *model.named_buffers()]}



class StartWatch(FitWatcher):
    """Every parameter and buffer of the fit's model at its first forward (inside a DDP's forward, after its
    forward-time broadcast) and at the fit's end (`state`), with what each DDP built in the fit took over."""

    def __init__(self) -> None:
        self.state: StartState | None = None
        self._wraps: dict[int, WrapTime] = {}  # id(module) -> what the DDP built around it took over

    def on_wrap(self, ddp: Any, module: Any, arguments: inspect.BoundArguments | None) -> None:
        self._wraps[id(module)] = WrapTime.of(ddp, module, arguments)

    def on_model(self, model: Any, record: FitRecord) -> None:
        # a DDP's is taken inside its forward, unless this micro-batch is counted at its backward (eval mode)
        if not isinstance(model, DistributedDataParallel) or record.first_from_backward:
            self._take(model)

    def on_forward(self, module: Any, depth: int, record: FitRecord) -> None:
        if depth == 1 and self.state is None and record.micro_batches == 1 \
                and module is getattr(record.model, "module", None):  # after DDP's forward-time broadcast
            self._take(record.model)

    def on_end(self, record: FitRecord) -> None:
        if self.state is not None and record.model is not None:
            self.state.after = after_states(unwrapped(record.model), input_digest)

    def _take(self, model: Any) -> None:
        wrap = None
        if isinstance(model, DistributedDataParallel):  # a DDP built before the recorder: read off it now
            wrap = self._wraps.get(id(model.module)) or WrapTime.of(model, model.module, None)
        self.state = StartState(isinstance(model, DistributedDataParallel), wrap,
                                tensor_states(unwrapped(model), wrap, input_digest))
