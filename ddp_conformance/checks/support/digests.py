"""Digests of what a fit holds and feeds its model, only ever compared with another rank's or fit's digest.

`input_digest` reads a value's bytes (tensors of any layout, arrays, nested containers, the plain values
beside them) into SHA-1; `step_digest` sums each parameter's bits on its own device (`tensor_bytes.bit_sums`)
for the per-step digests a fit of many steps pays at each one.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import zlib
from typing import Any

import torch

from .tensor_bytes import bit_sums, readable_bytes


def nonzero(tensor: Any) -> bool:
    """Whether any element is nonzero: `count_nonzero` reads a dense CPU tensor several times faster than
    `any()` (benchmarks/RESULTS.md), which the recorder pays at every step of a fit whose
    first gradient is an embedding's, mostly zero rows; sparse tensors keep `any()`."""
    return bool(tensor.count_nonzero()) if tensor.layout == torch.strided else bool(tensor.any())


def input_digest(value: Any) -> str:
    """A digest of tensors (and the plain values beside them), to tell whether ranks hold the same."""

    digest = hashlib.sha1()
    _digest_into(digest, value)
    return digest.hexdigest()[:16]


def step_digest(parameters: list[Any]) -> str:
    """A digest of the parameters after an optimizer step, only ever compared with another fit's or
    rank's digest of the same step: each tensor's bit sum (`bit_sums`, on its own device), in order. A chance
    cancellation would hide one difference, where parameters that part stay apart over the following steps."""
    value = 0
    for item in bit_sums(parameters):
        value = zlib.crc32(item.to_bytes(8, "little", signed=True) if isinstance(item, int) else item, value)
    return f"{value:08x}"


def fed_digest(inputs: Any) -> str | None:
    """A digest of a micro-batch's inputs as the model's forward got them, or None when no tensor or
    array is among them: keyword arguments (`model(input_ids=x)`) never reach a global forward hook (the
    model's own forward hook digests them: `_on_keyword_inputs`), and a digest of nothing would make every
    rank look fed alike."""

    digest = hashlib.sha1()
    if isinstance(inputs, tuple):  # the forward's arguments: a plain number beside the tensors is the step's
        # position (Lightning's wrapper is called with (batch, batch_idx)), not what the model is fed
        inputs = tuple(value for value in inputs if not isinstance(value, int))
    return digest.hexdigest()[:16] if _digest_into(digest, inputs) else None


def _digest_into(digest: Any, item: Any) -> int:
    """Feed `item` into `digest`: tensors and arrays by their bytes, mappings (a tokenizer's
    BatchEncoding too), sequences and dataclasses element by element, plain values by repr. Returns
    how many tensors and arrays it saw."""

    if isinstance(item, torch.Tensor):
        digest.update(readable_bytes(item))  # no copy for a plain tensor; never raises into the fit
        return 1
    if hasattr(item, "__array_interface__") and hasattr(item, "tobytes"):  # a numpy array
        digest.update(item.tobytes())
        return 1
    if isinstance(item, collections.abc.Mapping):
        return sum(_digest_into(digest, item[key]) for key in sorted(item, key=str))
    if isinstance(item, list | tuple):
        return sum(_digest_into(digest, element) for element in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(_digest_into(digest, getattr(item, f.name)) for f in dataclasses.fields(item))
    if isinstance(item, int | float | str | bool):
        digest.update(repr(item).encode())
    return 0
