"""The value of the `ddp` fixture, in the parent and in the ranks.

The parent only knows the shape of the group (a `DdpPlan`); each rank replaces it with its own
`DdpContext` before the test body runs. Neither imports torch at module level, so the plugin stays
free for sessions that never run a distributed test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DdpPlan:
    """What the parent decided for a test: its world size and backend."""

    world_size: int
    backend: str


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
        """A `torch.device`: cuda:local_rank under nccl, cpu under gloo."""
        import torch

        return torch.device(self.device_name)

    @property
    def is_main(self) -> bool:
        return self.rank == 0
