"""Which backend and devices a distributed test gets, decided in the parent before anything spawns.

The decisions are pure functions of a few facts (GPUs visible, NCCL built in), so they are tested on
CPU machines; only `probe_hardware` touches torch, and only when a distributed test is about to run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    """What the parent can see: visible CUDA devices and whether torch was built with NCCL."""

    cuda_devices: tuple[str, ...]
    nccl_available: bool | None  # None: not asked (no GPU device on this machine, torch not imported)


@dataclass(frozen=True)
class Placement:
    """A decided backend and the device kind its ranks work on, or the reason the test must be skipped."""

    backend: str
    skip_reason: str | None = None
    device: str = "cpu"  # "cpu" or "cuda"


def _gpu_device_nodes() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def probe_hardware() -> Hardware:
    """Ask torch what this process may use. On a Linux machine with no GPU device node at all, the
    answer is known without importing torch (seconds on a small CI runner), so the parent skips it."""
    if sys.platform.startswith("linux") and not _gpu_device_nodes():
        return Hardware(cuda_devices=(), nccl_available=None)
    import torch  # deferred: seconds, paid only when a distributed test is about to run
    import torch.distributed as dist

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = _split_visible(visible)[:count] if visible else [str(i) for i in range(count)]
    return Hardware(cuda_devices=tuple(names), nccl_available=dist.is_available() and dist.is_nccl_available())


def choose_backend(requested: str, world_size: int, hw: Hardware, device: str = "auto") -> Placement:
    """auto: nccl when there is one GPU per rank, else gloo. An explicit nccl that cannot run is a skip
    whose reason says what is missing, decided here so no spawn is wasted on it.

    `device` says where the ranks work: auto puts them on their GPUs under nccl and on the CPU under gloo;
    cuda puts them on GPUs under either, so with fewer GPUs than ranks they run gloo and share the GPUs
    (rank i on GPU i mod n: one GPU cannot hold two NCCL ranks); cpu keeps them on the CPU, under gloo."""
    gpus = len(hw.cuda_devices)
    if device == "cuda" and gpus == 0:
        return Placement("gloo", skip_reason="--ddp-device cuda: no CUDA device is visible here (found 0)")
    if device == "cpu" or requested == "gloo":
        return Placement("gloo", device="cuda" if device == "cuda" else "cpu")
    if requested == "auto":
        if hw.nccl_available and gpus >= world_size:
            return Placement("nccl", device="cuda")
        return Placement("gloo", device="cuda" if device == "cuda" else "cpu")
    if gpus < world_size:
        return Placement("nccl", skip_reason=f"nccl needs {world_size} GPUs, found {gpus}")
    if not hw.nccl_available:
        return Placement("nccl", skip_reason="nccl is not available in this torch build")
    return Placement("nccl", device="cuda")


def _split_visible(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def worker_gpu_share(devices: tuple[str, ...], worker_index: int, worker_count: int) -> tuple[str, ...]:
    """The GPUs one pytest-xdist worker may use: a contiguous, disjoint slice, so two workers' pools
    never share a device (DeepSpeed rotates devices per worker and still oversubscribes). A worker whose
    slice is empty gets no GPU, and its nccl tests skip with the count it found."""
    if worker_count <= 1:
        return devices
    if not 0 <= worker_index < worker_count:
        raise ValueError(f"worker index {worker_index} outside 0..{worker_count - 1}")
    base, extra = divmod(len(devices), worker_count)
    start = worker_index * base + min(worker_index, extra)
    size = base + (1 if worker_index < extra else 0)
    return devices[start : start + size]


def xdist_worker() -> tuple[int, int]:
    """(index, count) of this pytest-xdist worker, (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if name.startswith("gw") and name[2:].isdigit():
        return int(name[2:]), max(count, 1)
    return 0, 1
