"""The harness reads any tensor a user hands it (`support/tensor_bytes.py`): every layout, stride, dtype and
class gives the bytes of its values, the same as a fresh contiguous copy's, or names what it cannot read; no
digest of the harness's raises into a check or a fit."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_conformance.checks.support.digests import fed_digest, input_digest, step_digest
from ddp_conformance.checks.support.model_state import digest, item_digest
from ddp_conformance.checks.support.tensor_bytes import UnreadableTensor, readable_bytes, tensor_bytes

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]

#: views with unusual strides: zero strides from expand, a size-1 dimension with a stride other than 1 (which
#: contiguous() keeps), steps, transposes, and as_strided overlapping its elements
VIEWS = {
    "as is": lambda t: t,
    "expanded": lambda t: t.unsqueeze(0).expand(3, *t.shape),
    "expanded last": lambda t: t.unsqueeze(-1).expand(*t.shape, 2),
    "scalar expanded to one": lambda t: t.reshape(-1)[0].expand(1) if t.numel() else t,
    "one-element column": lambda t: t.reshape(-1, 1).expand(-1, 3)[:1, 1] if t.numel() else t,
    "stepped": lambda t: t.reshape(-1)[::2],
    "transposed": lambda t: t.reshape(-1, 1).t() if t.dim() < 2 else t.transpose(0, -1),
    "overlapping": lambda t: t.reshape(-1).as_strided((2, 2), (0, 1)) if t.numel() >= 2 else t,
}


def canonical(tensor: torch.Tensor) -> bytes:
    """The values' bytes from a fresh tensor with a contiguous layout of its own (what the harness reads)."""
    values = tensor.detach()
    fresh = torch.empty(values.shape, dtype=values.dtype)
    fresh.copy_(values.resolve_conj().resolve_neg())
    return bytes(fresh.reshape(-1).view(torch.uint8).numpy())


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4
    base = values.to(dtype) if dtype is not torch.bool else values > 0
    return VIEWS[draw(st.sampled_from(sorted(VIEWS)))](base)


@settings(max_examples=300, deadline=None)
@given(tensors())
def test_every_strided_view_reads_as_its_values(tensor: torch.Tensor) -> None:
    assert bytes(tensor_bytes(tensor)) == canonical(tensor)
    assert item_digest(tensor, strict=True) == item_digest(torch.empty_like(tensor).copy_(tensor).contiguous())
    assert digest({"t": tensor}) == digest({"t": tensor.clone(memory_format=torch.contiguous_format)})
    for digest_of in (input_digest, step_digest, fed_digest):
        assert digest_of([tensor]) == digest_of([tensor.clone(memory_format=torch.contiguous_format)])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:torch.quantize_per_tensor")
@settings(max_examples=100, deadline=None)
@given(tensors(), st.sampled_from(["coo", "csr", "conj", "quantized", "subclass", "parameter", "requires grad"]))
def test_other_layouts_dtypes_and_classes_read_as_their_values(tensor: torch.Tensor, kind: str) -> None:
    made = {"coo": lambda: tensor.to_sparse(),
            "csr": lambda: tensor.reshape(1, -1).to_sparse_csr(),
            "conj": lambda: tensor.to(torch.complex64).conj(),
            "quantized": lambda: torch.quantize_per_tensor(tensor.float(), 0.5, 3, torch.qint8) if tensor.dtype in (
                torch.float32, torch.float64) else None,
            "subclass": lambda: tensor.as_subclass(_Tagged),
            "parameter": lambda: torch.nn.Parameter(tensor, requires_grad=False),
            "requires grad": lambda: tensor.clone().requires_grad_() * 1 if tensor.is_floating_point() else None}
    try:
        special = made[kind]()
    except (RuntimeError, NotImplementedError, TypeError):  # torch cannot build that kind from this tensor
        return
    if special is None:
        return
    expected = {"quantized": lambda: special.dequantize(), "conj": lambda: special.resolve_conj(),
                "coo": lambda: tensor, "csr": lambda: tensor}.get(kind, lambda: special)()
    assert bytes(tensor_bytes(special)) == canonical(expected)
    item_digest(special, strict=True)  # reads without raising
    assert step_digest([special]) == step_digest([expected.detach().clone(memory_format=torch.contiguous_format)])


@settings(max_examples=200, deadline=None)
@given(tensors(), st.integers(0, 63), st.data())
def test_a_step_digest_tells_any_one_changed_element(tensor: torch.Tensor, bit: int, data: st.DataObject) -> None:
    """Whatever the dtype, count, layout or alignment, one element with one bit flipped moves its bit sum: the
    per-step digest (`bit_sums`) sums words and elements, which one change alone never cancels."""
    changed = tensor.detach().clone(memory_format=torch.contiguous_format).reshape(-1)
    if not changed.numel():
        return
    raw = changed.view(torch.uint8)
    position = data.draw(st.integers(0, raw.numel() - 1))
    raw[position] ^= 1 << (bit % 8 if tensor.dtype != torch.bool else 0)  # a bool's other bits are not values
    offset = torch.empty(changed.numel() + 1, dtype=changed.dtype)[1:]  # a view at an odd offset in its storage
    offset.copy_(changed)
    assert step_digest([changed]) != step_digest([tensor]) and step_digest([offset]) == step_digest([changed])


class _Tagged(torch.Tensor):
    """A tensor subclass that keeps its data in its own storage (as a library's tagged tensor type)."""


def test_wrapper_subclasses_and_nested_tensors_are_read_through_their_parts() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    values = torch.arange(6.0).reshape(2, 3)
    assert bytes(tensor_bytes(TwoTensor(values, values * 2))) == canonical(values) + canonical(values * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
    assert bytes(tensor_bytes(nested)) == canonical(torch.ones(2)) + canonical(torch.zeros(3))
    assert item_digest(nested, strict=True) != item_digest(torch.ones(5), strict=True)


def test_a_tensor_without_values_is_named_by_a_strict_read_and_described_otherwise() -> None:
    meta = torch.empty(3, 4, device="meta")
    with pytest.raises(UnreadableTensor, match=r"Tensor\(dtype=torch.float32, shape=\(3, 4\).*device=meta\).*meta "
                                               "tensor holds no values"):
        item_digest({"x": meta}, strict=True)
    assert bytes(readable_bytes(meta)).startswith(b"unreadable Tensor(dtype=torch.float32, shape=(3, 4)")
    for digest_of in (input_digest, step_digest, fed_digest, item_digest):
        digest_of([meta])  # the recorder's digests never raise into a fit
    assert digest({"meta": meta})


def test_data_consistency_skips_naming_the_item_and_the_tensor_it_cannot_read() -> None:
    from ddp_conformance.checks.data_consistency import _view

    readable = _view([(torch.zeros(()).expand(1), torch.zeros(8).expand(4, 8))] * 3)
    assert set(readable["digests"]) == {0, 1, 2} and None not in readable["digests"].values()
    view = _view([(torch.ones(2), torch.empty(2, device="meta"))] * 3)
    assert view == {"lacks": "the trainer's dataset's item 0 holds a tensor the harness cannot read, Tensor(dtype="
                             "torch.float32, shape=(2,), layout=torch.strided, device=meta): a meta tensor holds no "
                             "values: the ranks' items cannot be compared"}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:torch.quantize_per_tensor")
def test_states_of_any_layout_are_compared_without_raising() -> None:
    from ddp_conformance.adapter import TrainState
    from ddp_conformance.checks.support.model_state import differences, tensors_differ

    x = torch.arange(9.0).reshape(3, 3)
    kinds = {"coo": torch.Tensor.to_sparse, "csr": torch.Tensor.to_sparse_csr,
             "quantized": lambda t: torch.quantize_per_tensor(t, 0.5, 0, torch.qint8),
             "complex": lambda t: t.to(torch.complex64) * 1j, "expanded": lambda t: t[:1].expand(3, 3)}
    left = {name: make(x) for name, make in kinds.items()} | {"meta": torch.empty(2, device="meta")}
    right = {name: make(x + 1) for name, make in kinds.items()} | {"meta": torch.empty(2, device="meta")}
    def state(params: dict[str, torch.Tensor]) -> TrainState:
        return TrainState(params=params, optimizer={}, scheduler=None, epoch=0, global_step=0, position=0)

    assert not differences(state(left), state(left))
    found = differences(state(left), state(right), rtol=1e-6)
    assert sorted(d.key for d in found) == sorted(kinds)
    assert next(d for d in found if d.key == "complex").delta == 1.0  # the imaginary part counts
    assert tensors_differ(left, right) and not tensors_differ(left, dict(left))
