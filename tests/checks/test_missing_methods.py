"""An adapter that provides only part of the interface: the checks it can serve run, the others are
skipped with the reason naming the trainer and the missing method (never failed)."""

from __future__ import annotations

import json

import pytest

from ddp_conformance.checks import DEFAULT_CHECKS

PARTIAL_ADAPTER = """
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_conformance.adapter import TrainerAdapter


class OnlyData(TrainerAdapter):
    name = "only-data"

    def make_dataset(self, size=None):
        n = size or 40
        return TensorDataset(torch.arange(n), torch.randn(n, 4, generator=torch.Generator().manual_seed(0)))

    def make_loader(self, dataset, *, rank, world_size, epoch):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        return DataLoader(dataset, batch_size=4, sampler=sampler)

    def batch_indices(self, batch):
        return batch[0].tolist()
"""


def test_missing_adapter_methods_skip_with_the_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(partial_adapter=PARTIAL_ADAPTER)
    result = pytester.runpytest_subprocess(
        "--pyargs", "ddp_conformance.suite", "--ddp-world-size", "2", "-p", "no:cacheprovider", "-rs",
        "--ddp-trainer", "partial_adapter.py:OnlyData", "--ddp-report", "report.json",
    )
    result.assert_outcomes(passed=2, skipped=len(DEFAULT_CHECKS) - 2)
    outcomes = {r["check"]: r for r in json.loads((pytester.path / "report.json").read_text())["results"]}
    assert outcomes["sampler_disjointness"]["outcome"] == "passed"
    assert outcomes["data_consistency"]["outcome"] == "passed"
    for check in ("rank_participation", "gradient_equivalence", "resume_fidelity", "bucket_view_memory",
                  "sync_batchnorm"):
        assert outcomes[check]["outcome"] == "skipped"
        assert "trainer partial_adapter.OnlyData does not provide" in outcomes[check]["message"], outcomes[check]

