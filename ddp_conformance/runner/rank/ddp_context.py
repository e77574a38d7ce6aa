"""The value of the `ddp` fixture inside a rank: `DdpContext`, this rank of an initialised group.

The parent only knows the shape of the group (`wire.DdpPlan`); each rank replaces it with its own
`DdpContext` before the test body runs. No torch at module level: the launched mode imports this in
pytest itself, which stays free of torch for sessions that never run a distributed test.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DdpContext:
    """Where a test body is running: this rank inside an initialised default process group.

    `figures` is a place for a test to put numbers it measured; they travel back with the outcome and
    land in the report (rank 0's as the test's user properties, hence JUnit XML properties).
    """

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device_name: str
    figures: dict[str, Any] = field(default_factory=dict)
    unusable_group: str = ""

    def mark_group_unusable(self, reason: str) -> None:
        """Tell the harness this group must not serve another test (e.g. a thread of the test is still
        blocked in a collective); the pool is rebuilt after the test."""
        self.unusable_group = reason

    def __repr__(self) -> str:
        return f"DdpContext(rank={self.rank}/{self.world_size}, {self.backend}, {self.device_name})"

    @property
    def device(self) -> Any:
        """A `torch.device`: the rank's GPU (`rank_device`) or the CPU."""
        import torch  # deferred: torch is heavy to import, and pytest imports this module

        return torch.device(self.device_name)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_device(backend: str, local_rank: int, kind: str | None = None, gpus: int = 0) -> str:
    """The device a rank works on. `kind` cuda (the default under nccl): a GPU of those visible
    (CUDA_VISIBLE_DEVICES already narrowed to the pool's share), its own under nccl, shared round-robin
    under gloo when there are fewer than ranks; cpu (the default under gloo): the CPU."""
    kind = kind or ("cuda" if backend == "nccl" else "cpu")
    if kind != "cuda":
        return "cpu"
    return f"cuda:{local_rank % gpus if gpus > 0 else local_rank}"


def visible_gpus() -> int:
    """How many GPUs CUDA_VISIBLE_DEVICES lets this rank see (the pool always sets it for CUDA ranks),
    read without initialising CUDA."""
    return len([part for part in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()])


@functools.cache
def _identity() -> tuple[int, int, int, str, str]:
    """(rank, local_rank, world_size, backend, device) from the pool's environment, read once: a
    rank keeps them for life, and the environment is put back after every test anyway."""
    backend = os.environ["DDP_CONFORMANCE_BACKEND"]
    local_rank = int(os.environ["LOCAL_RANK"])
    kind = os.environ.get("DDP_CONFORMANCE_DEVICE")
    return (int(os.environ["RANK"]), local_rank, int(os.environ["WORLD_SIZE"]), backend,
            rank_device(backend, local_rank, kind, visible_gpus()))


def context_from_env() -> DdpContext:
    """A fresh context for one test (its figures start empty)."""
    rank, local_rank, world_size, backend, device = _identity()
    return DdpContext(rank=rank, local_rank=local_rank, world_size=world_size, backend=backend, device_name=device)
