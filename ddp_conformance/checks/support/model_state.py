"""Comparing training states: flattening nested states, bitwise differences, parameter digests.

Shared by the checks that compare runs (resume_fidelity) or ranks (rank_participation). Parameters
are told apart from buffers because BatchNorm running statistics are updated from each rank's own
batch after DDP's buffer broadcast, so they legitimately differ between ranks.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...adapter import TrainState
from .tensor_bytes import readable_bytes, shape_of, tensor_bytes

BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state (dicts, lists, tensors, numbers) as {dotted.path: leaf}."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flat(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for index, item in enumerate(value):
            out.update(flat(item, f"{prefix}[{index}]"))
        return out
    return {prefix: value}


@dataclass(frozen=True)
class Difference:
    part: str  # params | optimizer | scheduler | counters
    key: str
    left: str  # the uninterrupted run's value, shown short
    right: str  # the resumed run's value
    delta: float | None = None  # max |left - right| for tensors

    def describe(self) -> str:
        if self.delta is not None and self.left.startswith("tensor"):
            return f"{self.part} {self.key}: max |delta| {self.delta:.3g}"
        return f"{self.part} {self.key}: {self.right} instead of {self.left}"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.item():.6g}" if value.numel() == 1 else f"tensor{tuple(value.shape)}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value)


def _same(x: Any, y: Any, rtol: float) -> tuple[bool, float | None]:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, None
        if _equal(x, y):
            return True, None
        try:
            return _within(x, y, rtol)
        except (RuntimeError, NotImplementedError, TypeError):  # a layout or dtype torch's arithmetic lacks
            return False, None  # (sparse, quantized): bitwise apart, by how much not told
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return False, None
    return x == y, None


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """torch.equal, or where a layout or device has no `equal` (sparse, meta), the same bytes (`tensor_bytes`)."""
    try:
        return bool(torch.equal(x, y))
    except (RuntimeError, NotImplementedError, TypeError):
        return bytes(readable_bytes(x)) == bytes(readable_bytes(y))


def _within(x: torch.Tensor, y: torch.Tensor, rtol: float) -> tuple[bool, float | None]:
    """Whether two unequal tensors of one shape and dtype are within rtol x x's largest |value|, and by how much."""
    if x.is_complex():
        delta, scale = float((x - y).abs().max()), float(x.abs().max())
        return delta <= rtol * scale, delta
    if not x.is_floating_point():
        return False, float((x.double() - y.double()).abs().max())
    if x.element_size() < 4:  # half types: their deltas would round to 3 digits
        x, y = x.float(), y.float()
    # in the tensors' own dtype, from the extremes: float64 copies of a large model's parameters cost a rank more
    # than the comparison (benchmarks/RESULTS.md)
    delta = _largest(x - y) if x.numel() else 0.0
    scale = _largest(x) if x.numel() else 0.0
    return delta <= rtol * scale, delta


def tensors_differ(reference: dict[str, Any], other: dict[str, Any], rtol: float = 0.0) -> bool:
    """Whether some tensor of `other` (on any device) differs from `reference`'s of that name as `differences`
    tells them apart (a name `other` lacks differs); it stops at the first."""
    for name, value in reference.items():
        got = other.get(name)
        if got is None or got.shape != value.shape:
            return True
        got = got.detach().to(value.device)
        if _equal(value, got):
            continue
        if rtol == 0 or not _same(value, got, rtol)[0]:
            return True
    return False


def _largest(tensor: Any) -> float:
    """max |tensor| (nan where it holds a nan), without an |tensor| copy."""
    low, high = (float(v) for v in torch.aminmax(tensor))
    return float("nan") if math.isnan(low) or math.isnan(high) else max(high, -low)


def differences(a: TrainState, b: TrainState, rtol: float = 0.0) -> list[Difference]:
    """Every way state `b` differs from `a`: bitwise when rtol is 0, else floating-point tensors may
    differ by rtol x their largest |value| (integers and counters always exactly)."""
    found: list[Difference] = []
    for part in ("params", "optimizer", "scheduler"):
        left, right = flat(getattr(a, part) or {}), flat(getattr(b, part) or {})
        for key in sorted(left.keys() | right.keys()):
            if key not in right:
                found.append(Difference(part, key, _short(left[key]), "missing"))
            elif key not in left:
                found.append(Difference(part, key, "missing", _short(right[key])))
            else:
                same, delta = _same(left[key], right[key], rtol)
                if not same:
                    found.append(Difference(part, key, _short(left[key]), _short(right[key]), delta))
    for key, value in a.counters.items():
        got = b.counters.get(key, "missing")
        if got != value:
            found.append(Difference("counters", key, repr(value), repr(got)))
    return found


def parameters(params: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
    """The trained parameters of a state dict, without buffers (and without DDP's `module.`)."""
    stripped = {k.removeprefix("module."): v for k, v in params.items()}
    if names:
        picked = {k: v for k, v in stripped.items() if k in set(names)}
        if picked:
            return picked
    return {k: v for k, v in stripped.items() if not k.endswith(BUFFER_SUFFIXES)}


def buffers(params: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
    """The buffers of a state dict (`names`: the model's buffer names, where known; else those named
    as BatchNorm's are), without DDP's `module.`."""
    stripped = {k.removeprefix("module."): v for k, v in params.items()}
    known = set(names or ())
    return {k: v for k, v in stripped.items() if k in known or k.endswith(BUFFER_SUFFIXES)}


OUTSIDE = "outside the model: "  # names the tensors an optimizer stepped that the model does not hold


def trained(params: dict[str, Any], record: Any, names: list[str] | None = None,
            outside: Sequence[str] = ()) -> dict[str, Any]:
    """The tensors a fit trained: the model's parameters (`parameters`), and of those its optimizers
    stepped outside the model (`FitRecord.stepped_outside_model`), the `outside` ones, named with
    OUTSIDE first."""
    stepped = record.stepped_outside_model() if record is not None else {}
    return parameters(params, names) | {OUTSIDE + name: stepped[name] for name in outside if name in stepped}


def drifted(outside: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """From every rank's `FitRecord.outside_digests()` ({name: (start, now)}): the tensors stepped
    outside the model that started alike on every rank and now differ (replicas out of step), and
    those that started differently (rank-local by design, a model-parallel shard: not compared)."""
    names = set(outside[0]).intersection(*outside[1:]) if outside else set()
    local = sorted(n for n in names if len({o[n][0] for o in outside}) > 1)
    drift = sorted(n for n in names if n not in local and len({o[n][1] for o in outside}) > 1)
    return drift, local


def digest(tensors: dict[str, Any]) -> str:
    """A hash of the tensors' names and exact bytes, to compare ranks without moving tensors."""

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(readable_bytes(tensors[name]))
    return h.hexdigest()


def item_digest(item: Any, strict: bool = False) -> str:
    """A hash of a dataset item's content: tensors and arrays by dtype, shape and bytes, containers
    element by element, anything else by pickle (or repr), so that ranks can compare items without
    sending them. Equal content gives equal digests in every process, whatever a tensor's layout, strides
    or device (`tensor_bytes`). A tensor it cannot read raises `UnreadableTensor` where `strict`, else is
    hashed by its description."""
    h = hashlib.sha256()
    _feed(h, item, tensor_bytes if strict else readable_bytes)
    return h.hexdigest()


def _feed(h: Any, value: Any, read: Callable[[torch.Tensor], Any]) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"tensor {value.dtype} {shape_of(value)};".encode())
        h.update(read(value))
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        h.update(f"array {getattr(value, 'dtype', '')} {getattr(value, 'shape', '')};".encode())
        h.update(value.tobytes())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)};".encode())
        for key in sorted(value, key=repr):
            _feed(h, key, read)
            _feed(h, value[key], read)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)};".encode())
        for element in value:
            _feed(h, element, read)
    elif value is None or isinstance(value, (str, bytes, int, float, bool)):
        h.update(f"{type(value).__name__} {value!r};".encode())
    else:
        try:
            h.update(pickle.dumps(value, protocol=4))
        except Exception:
            h.update(repr(value).encode())  # an address in it makes the item look random: not compared
