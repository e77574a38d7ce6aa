"""What each BatchNorm layer did in the fit's first micro-batch on this rank, kept as per-channel sums.

sync_batchnorm judges whether a layer normalised by the statistics of the *global* batch (every
rank's micro-batch) or of this rank's alone. The layer's input can be large (a CNN's feature maps),
so nothing but per-channel sums crosses ranks: the count, sum and sum of squares of the input give
the global mean and variance exactly as SyncBatchNorm pools them (it gathers counts, means and
inverse standard deviations); the running statistics before and after the forward give what the
layer recorded; and the sums of the output and of input times output give the per-channel line
`output = slope * input + offset` the layer applied (a BatchNorm in training mode is exactly that
line within a channel), so the normalisation itself is judged, not only the bookkeeping.

Watched through the forward hooks `FitRecorder` already holds (global, public), during the fit's
first micro-batch only, and only the first call of each layer in it: `NormWatch` is the probe's
watcher (`fit_watch.FitWatcher`) for this check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..support.fit_record import FitRecord
from ..support.fit_watch import FitWatcher
from ..support.observe import BATCH_NORMS, unwrapped


@dataclass
class NormLayer:
    """One BatchNorm layer's first training-mode forward on this rank, as CPU float64 per-channel sums."""

    name: str  # as the unwrapped model names it
    kind: str  # its class
    synced: bool  # a SyncBatchNorm
    group_size: int | None  # the size of the process group a SyncBatchNorm synchronises over
    device: str  # where its input was
    batch: int  # the micro-batch's size (the input's first dimension)
    count: int  # elements per channel
    momentum: float | None
    eps: float
    sums: Any
    squares: Any
    out_sums: Any
    cross: Any  # sum of input * output
    weight: Any | None
    bias: Any | None
    mean_before: Any | None  # None: it tracks no running statistics
    var_before: Any | None
    mean_after: Any | None
    var_after: Any | None
    tracked_after: int | None  # num_batches_tracked after the forward
    resolution: float = 0.0  # the machine epsilon of the coarser of its input's and output's dtypes


class NormWatch(FitWatcher):
    """The BatchNorm layers of the fit's model (`names`, as the unwrapped model names them) and what each
    in training mode did in the first micro-batch (`layers`, the first call of each)."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self.layers: list[NormLayer] = []
        self._before: dict[int, tuple[Any, Any]] = {}
        self._done: set[int] = set()

    @property
    def names(self) -> list[str]:
        return list(self._names.values())

    def on_model(self, model: Any, record: FitRecord) -> None:
        self._names = {id(module): name for name, module in unwrapped(model).named_modules()
                       if isinstance(module, BATCH_NORMS)}

    def on_forward(self, module: Any, depth: int, record: FitRecord) -> None:
        key = id(module)
        if record.micro_batches == 1 and key in self._names and key not in self._done and module.training \
                and key not in self._before:
            self._before[key] = (_copy(module.running_mean), _copy(module.running_var))

    def on_forward_end(self, module: Any, args: Any, output: Any, record: FitRecord) -> None:
        key = id(module)
        if record.micro_batches != 1 or key not in self._before or key in self._done or not args \
                or not isinstance(output, torch.Tensor):
            return
        self._done.add(key)
        mean_before, var_before = self._before.pop(key)
        self.layers.append(_layer(self._names[key], module, args[0], output, mean_before, var_before))


def _layer(name: str, module: Any, inputs: Any, output: Any, mean_before: Any, var_before: Any) -> NormLayer:
    with torch.no_grad():
        x = _channels(inputs)
        y = _channels(output)
        group = getattr(module, "process_group", None)
        synced = isinstance(module, torch.nn.SyncBatchNorm)
        tracked = module.num_batches_tracked
        return NormLayer(
            name=name, kind=type(module).__name__, synced=synced,
            group_size=_group_size(group) if synced else None, device=inputs.device.type,
            batch=int(inputs.shape[0]), count=int(x.shape[1]), momentum=module.momentum, eps=float(module.eps),
            sums=x.sum(dim=1), squares=(x * x).sum(dim=1), out_sums=y.sum(dim=1), cross=(x * y).sum(dim=1),
            weight=_copy(module.weight), bias=_copy(module.bias), mean_before=mean_before, var_before=var_before,
            mean_after=_copy(module.running_mean), var_after=_copy(module.running_var),
            tracked_after=int(tracked) if tracked is not None else None,
            resolution=max(_epsilon(inputs.dtype), _epsilon(output.dtype)))


def _channels(tensor: Any) -> Any:
    """(channels, elements) in float64 on the CPU: BatchNorm normalises over every dimension but the second."""
    return tensor.detach().transpose(0, 1).reshape(tensor.shape[1], -1).double().cpu()


def _epsilon(dtype: Any) -> float:
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def _copy(tensor: Any) -> Any:
    return None if tensor is None else tensor.detach().double().cpu().clone()


def _group_size(group: Any) -> int | None:
    if not dist.is_initialized():
        return None
    return dist.get_world_size(group) if group is not None else dist.get_world_size()
