"""Scale on the 2-core machine: world size 8 runs (the soak of 500 warm tests is benchmarks/soak.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.mark.ddp(world_size=8)
def test_world_size_8_runs_on_two_cores(ddp):
    t = torch.tensor([float(ddp.rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(8))
    gathered = [torch.zeros(1) for _ in range(8)]
    dist.all_gather(gathered, torch.tensor([float(ddp.rank)]))
    assert [int(g.item()) for g in gathered] == list(range(8))
