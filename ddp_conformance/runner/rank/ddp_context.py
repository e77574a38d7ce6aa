"""The value of the `ddp` fixture inside a rank: `DdpContext`, this rank of an initialised group.

The parent only knows the shape of the group (`wire.DdpPlan`); each rank replaces it with its own
`DdpContext` before the test body runs. No torch at module level: the launched mode imports this in
pytest itself, which stays free of torch for sessions that never run a distributed test.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..wire import STATUS_FILE_ENV

# a test may call `status` at every step of a fit (thousands a second): it writes at most this often,
# a few times a second, far more often than the parent shows a line (`parent.status_line`)
STATUS_WRITES_APART_SECONDS = 0.25
STATUS_MAX_CHARS = 300  # one terminal line's worth; the parent shows the first line of it


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
    # where `status` writes: set on rank 0 of a pool only (the parent shows one rank's words); "" on the
    # other ranks and under a launcher, where no parent reads it
    status_file: str = field(default="", repr=False)
    _status_at: float = field(default=-math.inf, init=False, repr=False, compare=False)

    def mark_group_unusable(self, reason: str) -> None:
        """Tell the harness this group must not serve another test (e.g. a thread of the test is still
        blocked in a collective); the pool is rebuilt after the test."""
        self.unusable_group = reason

    def status(self, text: str) -> None:
        """Say what the test is doing now ("fit 'uninterrupted', step 120 of 7501"): once a test has run
        for a while, the parent shows rank 0's latest words on the terminal. Cheap enough to call at
        every step: a call within STATUS_WRITES_APART_SECONDS of the last write is dropped. A no-op on
        other ranks and where no pool runs the test."""
        if not self.status_file:
            return
        now = time.monotonic()
        if now - self._status_at < STATUS_WRITES_APART_SECONDS:
            return
        self._status_at = now
        tmp = f"{self.status_file}.tmp"
        with contextlib.suppress(OSError):  # the pool's directory is gone: the pool is going away
            with open(tmp, "w", encoding="utf-8", errors="replace") as file:
                file.write(str(text)[:STATUS_MAX_CHARS])
            os.replace(tmp, self.status_file)  # the parent never reads half a line

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
    return DdpContext(rank=rank, local_rank=local_rank, world_size=world_size, backend=backend, device_name=device,
                      status_file=os.environ.get(STATUS_FILE_ENV, ""))
