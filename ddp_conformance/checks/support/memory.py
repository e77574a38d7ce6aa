"""Measuring what a training step holds in memory, for bucket_view_memory.

CPU: glibc's heap counters, `mallinfo2()` in-use bytes (`uordblks + hblkhd`: small-chunk arenas of
every thread plus mmapped chunks, which is where torch puts large tensors), read through ctypes.
Exact byte counts of live allocations, so a few KiB of noise against MiB of gradients (measured:
two runs of the same setting agree within ~4 KiB, see the report figures). glibc has no peak
counter, so the peak is *sampled*: after every parameter's gradient is accumulated (a
post-accumulate-grad hook) and after every step.
CUDA: `torch.cuda.memory_allocated` / `max_memory_allocated` after `reset_peak_memory_stats`.

Figures are always measured, never computed from the config.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_mallinfo2: Callable[[], _MallInfo2] | None = None


def heap_counter() -> Callable[[], int] | None:
    """A function returning this process's in-use heap bytes, or None without glibc >= 2.33."""
    global _mallinfo2
    if _mallinfo2 is None:
        try:  # the glibc soname first: find_library runs `ldconfig -p` in a subprocess
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            name = ctypes.util.find_library("c")
            if name is None:
                return None
            libc = ctypes.CDLL(name)
        function = getattr(libc, "mallinfo2", None)
        if function is None:
            return None
        function.restype = _MallInfo2
        function.argtypes = []
        _mallinfo2 = function

    def in_use() -> int:
        info = _mallinfo2()  # type: ignore[misc]
        return int(info.uordblks + info.hblkhd)

    return in_use


def shares_its_base(grad: Any) -> bool:
    """Whether `grad` is a view that still lives in the storage it is a view of (a DDP bucket, with
    gradient_as_bucket_view). `p.grad.data = f(p.grad.data)` keeps `_is_view()` true and the
    `_base` it had, but moves the data to a new storage: only the storages tell."""
    base = grad._base if grad._is_view() else None
    return base is not None and grad.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


@dataclass
class StepMemory:
    """One measured run: build, wrap, `steps` train_steps."""

    gradient_as_bucket_view: bool
    footprint: int  # bytes held after the last step, relative to before the model was built
    peak: int  # the largest in-use seen during the steps (sampled on CPU), relative to the same base
    grad_bytes: int
    is_ddp: bool
    ddp_flag: bool | None  # what DDP itself reports (_get_ddp_logging_data), None if not DDP
    all_views: bool
    grad_storages: int
    grads: int
    buckets: int
    wrapped_type: str
    samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DdpSetting:
    """What the trainer's `wrap` builds, read off it without a step."""

    is_ddp: bool
    ddp_flag: bool | None  # what DDP itself reports (_get_ddp_logging_data), None if not DDP
    wrapped_type: str


def ddp_setting(adapter: Any) -> DdpSetting:
    """Build the adapter's model and wrap it the trainer's way (collective: DDP broadcasts the
    parameters), and read the gradient_as_bucket_view DDP reports; nothing is trained or measured. The
    DDP is left to the garbage collector: a caller that measures next collects it first."""
    wrapped = adapter.wrap(adapter.make_model())
    is_ddp = hasattr(wrapped, "_get_ddp_logging_data")
    flag = bool(wrapped._get_ddp_logging_data().get("gradient_as_bucket_view")) if is_ddp else None
    return DdpSetting(is_ddp, flag, type(wrapped).__name__)


def _buckets(logging: dict[str, Any]) -> int:
    """The number of rebuilt buckets DDP reports, 0 while its logger has not recorded them yet
    (it records runtime stats on sampled iterations; the construction-time layout is replaced)."""
    sizes = str(logging.get("rebuilt_bucket_sizes") or "")
    return len([s for s in sizes.split(",") if s.strip()])


def settle(read: Callable[[], int], wait: float = 0.005, attempts: int = 40) -> int:
    """Collect garbage, then read until two reads agree: a gloo worker thread can drop the last
    reference to a finished all-reduce (and free its bucket) just after the caller moved on, which
    showed as whole buckets (0.8-2.4 MB) appearing in, or missing from, the next run's figures."""

    gc.collect()
    last = read()
    for _ in range(attempts):
        time.sleep(wait)
        now = read()
        if now == last:
            return now
        last = now
    return last


def measure_step(adapter: Any, batch: Any, flag: bool, steps: int, device_type: str) -> StepMemory:
    """Build the adapter's model, wrap it the trainer's way, run `steps` of its train_step, and
    read what that holds. Gradients are not zeroed between steps (they accumulate in place), so
    from the second step on each setting keeps its steady-state layout."""

    gc.collect()
    if device_type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        read: Callable[[], int] = torch.cuda.memory_allocated
    else:
        counter = heap_counter()
        assert counter is not None
        read = counter
        base = settle(read)
    samples: list[int] = []
    model = adapter.make_model()
    wrapped = adapter.wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(lambda _p: samples.append(read())) for p in params]
    try:
        for _ in range(steps):
            adapter.train_step(wrapped, batch)
            samples.append(read())
    finally:
        for handle in handles:
            handle.remove()
    if device_type == "cuda":
        torch.cuda.synchronize()
        footprint, peak = read() - base, torch.cuda.max_memory_allocated() - base
    else:
        footprint = settle(read) - base
        peak = max(samples) - base
    is_ddp = hasattr(wrapped, "_get_ddp_logging_data")
    logging = wrapped._get_ddp_logging_data() if is_ddp else {}
    grads = [p.grad for p in params if p.grad is not None]
    result = StepMemory(
        gradient_as_bucket_view=flag, footprint=footprint, peak=peak,
        grad_bytes=sum(p.numel() * p.element_size() for p in params), is_ddp=is_ddp,
        ddp_flag=bool(logging.get("gradient_as_bucket_view")) if is_ddp else None,
        all_views=bool(grads) and all(shares_its_base(g) for g in grads),
        grad_storages=len({g.untyped_storage().data_ptr() for g in grads}), grads=len(grads),
        buckets=_buckets(logging), wrapped_type=type(wrapped).__name__, samples=len(samples),
        extra={"find_unused_parameters": bool(getattr(wrapped, "find_unused_parameters", False)),
               "static_graph": bool(getattr(wrapped, "static_graph", False))} if is_ddp else {})
    del model, wrapped, params, grads, handles
    gc.collect()
    return result
