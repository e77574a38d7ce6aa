"""Any tensor a user hands the harness, read as bytes it can hash, whatever its layout, strides, dtype,
device or class.

`t.contiguous().view(-1).view(torch.uint8)` reads most tensors without a copy, but not all: `contiguous()`
returns a tensor as it is when torch calls it contiguous, and torch ignores the stride of a dimension of
size 1, so a scalar expanded to shape (1,) (stride 0) or a one-element slice of a column (stride = the row's
length) stays with a stride other than 1, which a byte view refuses ("self.stride(-1) must be 1 to view
Float as Byte"). Sparse (COO, CSR...), nested, quantized, conjugated and meta tensors, tensor subclasses and
tensors on another device each fail some step of that line too. Here each is read as its values: a sparse
tensor as its dense values, a quantized one dequantized, a conjugate or negative view resolved, a nested one
component by component, a subclass through torch's own ops; what still cannot be read (a meta tensor has no
values, a bit-packed dtype has no bytes of its own) raises `UnreadableTensor`, which names the tensor.
A plain contiguous CPU tensor is still read without a copy: the recorder digests the parameters at each of a
fit's first steps.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


class UnreadableTensor(ValueError):
    """A tensor whose values the harness cannot read; the message names it and why."""


def shape_of(tensor: Any) -> tuple[int, ...] | str:
    """The tensor's shape; a nested tensor's, which has no single one, as its components' shapes."""
    try:
        return tuple(tensor.shape)
    except Exception:
        try:
            return "nested " + " ".join(str(tuple(part.shape)) for part in tensor.unbind())
        except Exception:
            return "unknown"


def describe(tensor: Any) -> str:
    """The tensor in words (class, dtype, shape, layout, device), for a skip or a digest of last resort."""
    parts = [f"dtype={getattr(tensor, 'dtype', '?')}", f"shape={shape_of(tensor)}",
             f"layout={getattr(tensor, 'layout', '?')}", f"device={getattr(tensor, 'device', '?')}"]
    return f"{type(tensor).__name__}({', '.join(parts)})"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's values as bytes (a view where the tensor is plain, contiguous and on the CPU); equal values
    of equal dtype give equal bytes, whatever the layout or strides. Raises `UnreadableTensor`."""
    try:
        if tensor.is_nested:
            return memoryview(b"".join(bytes(tensor_bytes(part)) for part in tensor.unbind()))
        if _wraps(tensor) and hasattr(tensor, "__tensor_flatten__"):  # DTensor, TwoTensor...: its inner tensors
            names, _ = tensor.__tensor_flatten__()
            return memoryview(b"".join(bytes(tensor_bytes(getattr(tensor, name))) for name in names))
        flat = _dense_cpu(tensor).reshape(-1)
        if not flat.numel():  # no values, whatever its stride (an empty slice keeps its step's)
            return memoryview(b"")
        if flat.stride(0) != 1:  # a size-1 dimension's stride, which contiguous() keeps, or a step's
            flat = flat.clone(memory_format=torch.contiguous_format)
        return byte_view(flat)
    except UnreadableTensor:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise UnreadableTensor(f"{describe(tensor)}: {type(exc).__name__}: {text[0][:160] if text else ''}") from exc


def byte_view(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous, dense CPU tensor, without a copy and without numpy (which torch does not
    require, nor this package): a ctypes array over its memory that keeps the tensor alive as long as the view."""
    data = flat.view(torch.uint8)
    array = (ctypes.c_ubyte * data.numel()).from_address(data.data_ptr())
    array.tensor = data  # the memory's owner, held while the view lives
    return memoryview(array).cast("B")


def readable_bytes(tensor: torch.Tensor) -> bytes | memoryview:
    """`tensor_bytes`, or for a tensor that cannot be read, its description: for digests taken while the user's
    fit runs (the recorder), which must never raise into it."""
    try:
        return tensor_bytes(tensor)
    except UnreadableTensor:
        return f"unreadable {describe(tensor)}".encode()


def bit_sums(tensors: list[torch.Tensor]) -> list[int | bytes | memoryview]:
    """Each tensor's values as one number: a plain dense tensor's bits summed as integers modulo 2**64 on its own
    device (a GPU's parameters are not copied to the host: one small tensor a device comes back), any other tensor's
    as its values read on the CPU, and one without a single run of values (nested, meta) as its bytes
    (`readable_bytes`). Integer addition is exact and associative, so the sum does not depend on how the reduction
    is split; one changed element always moves it (by its change in bits, times 2**32 in a word's high half), while
    two changes can cancel (one element a bit up, another the same bit down).

    The sum runs over 8-byte words (a float32 tensor read as int64 is reduced at twice the rate of one read element
    by element), and over the elements of a last part word: a split made by the dtype and number of elements, never
    by the layout, so that equal values give equal sums."""
    sums: list[Any] = [_bit_sum_or_bytes(t) for t in tensors]
    on_device: dict[torch.device, list[int]] = {}
    for index, value in enumerate(sums):
        if isinstance(value, torch.Tensor):
            on_device.setdefault(value.device, []).append(index)
    for indices in on_device.values():  # one transfer a device
        for index, value in zip(indices, torch.stack([sums[i] for i in indices]).tolist(), strict=True):
            sums[index] = value
    return sums


_ELEMENT_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _plain_dense(t: torch.Tensor) -> bool:
    """A dense strided tensor whose storage holds its values as they read: not sparse, quantized, nested, meta, a
    conjugate or negative view, or a subclass that keeps its values elsewhere."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta and not t.is_quantized
            and not t.is_nested and not t.is_conj() and not t.is_neg() and not _wraps(t))


def _bit_sum_or_bytes(t: torch.Tensor) -> torch.Tensor | bytes | memoryview:
    """A tensor that is not plain and dense is summed as its values on the CPU (`_dense_cpu`); one that cannot be
    read is its description. Never raises: the recorder digests the parameters while the user's fit runs."""
    try:
        return _bit_sum(t if _plain_dense(t) else _dense_cpu(t))
    except Exception:  # a nested tensor, a wrapper subclass, a meta tensor: no single run of values to sum
        return readable_bytes(t)


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The bits of the tensor's leading whole 8-byte words summed as int64, plus its remaining elements' bits (fewer
    than 8 bytes), each as an integer of its size: the split follows from the dtype and count alone."""
    flat = t.detach().reshape(-1)
    if not flat.numel():
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    if flat.stride(0) != 1 or flat.data_ptr() % 8:  # a step's stride, or a view at an odd offset in its storage
        flat = flat.clone(memory_format=torch.contiguous_format)
    size = flat.element_size()
    whole = flat.numel() * size // 8 * 8 // size  # the elements in whole words
    words = flat[:whole].view(torch.int64).sum() if whole else torch.zeros((), dtype=torch.int64, device=flat.device)
    if whole == flat.numel():
        return words
    return words + flat[whole:].view(_ELEMENT_INTS[size]).sum(dtype=torch.int64)


def _dense_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a plain strided CPU tensor (not necessarily contiguous)."""
    t = tensor.detach()
    if t.is_meta:
        raise UnreadableTensor(f"{describe(tensor)}: a meta tensor holds no values")
    if t.is_quantized:
        t = t.dequantize()
    if t.layout != torch.strided:  # sparse COO / CSR / CSC / BSR / BSC, mkldnn
        t = _densified(t)
    t = t.resolve_conj().resolve_neg().cpu()
    if type(t) is not torch.Tensor:
        t = _plain(t)
    return t


def _densified(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's dense values; for a dtype torch's sparse kernels lack (float8), through a wider dtype
    that holds each value exactly, and back."""
    try:
        return t.to_dense()
    except (RuntimeError, NotImplementedError):
        wider = torch.complex128 if t.dtype.is_complex else torch.float64 if t.dtype.is_floating_point else torch.int64
        return t.to(wider).to_dense().to(t.dtype)


def _wraps(t: torch.Tensor) -> bool:
    """Whether the tensor is a wrapper subclass: a `__torch_dispatch__` of its own, its data in inner tensors."""
    return getattr(type(t), "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A subclass's values as a plain tensor: one that keeps its data in its own storage (no `__torch_dispatch__`
    of its own) is viewed as a torch.Tensor; a wrapper subclass that does not flatten has none to view."""
    if not _wraps(t):
        return t.as_subclass(torch.Tensor)
    raise UnreadableTensor(f"{describe(t)}: a tensor subclass with a __torch_dispatch__ of its own and no "
                           "__tensor_flatten__, whose values are not in its storage")
