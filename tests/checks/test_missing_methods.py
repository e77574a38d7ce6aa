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



ONE_RANK_CANNOT = """
from ddp_conformance.adapter import NotProvided
from ddp_conformance.trainers.torch_ref import TorchTrainer


class Trainer(TorchTrainer):
    name = "one-rank-cannot"
    real_rank = None  # the rank this process has in the real group, seen at its first setup
    cannot = 0  # the rank whose single-process loss cannot be computed

    def setup(self, config, ctx):
        if Trainer.real_rank is None:
            Trainer.real_rank = ctx.rank
        super().setup(config, ctx)

    def loss(self, model, batch):
        if self.ctx.world_size == 1 and Trainer.real_rank == self.cannot:
            raise NotProvided(self, "loss", "this rank's single-process loss reads files only rank 0 has")
        return super().loss(model, batch)
"""


@pytest.mark.parametrize("cannot", [0, pytest.param(1, marks=pytest.mark.slow)])  # rank 1's: -m slow
def test_a_reference_rank_0_cannot_compute_is_not_computed_on_any(pytester: pytest.Pytester, cannot: int) -> None:
    """gradient_equivalence's single-process step: rank 0 computes it for every rank. Told NotProvided there,
    every rank judges the fit's first step instead (a rank that went its own way into a fit once left the others
    waiting in the check's next collective: a hang). Another rank computes nothing there, but recomputes the
    fit's first step: told NotProvided then, every rank leaves that step unjudged, and says why."""
    pytester.makepyfile(one_rank_cannot=ONE_RANK_CANNOT.replace("cannot = 0", f"cannot = {cannot}"))
    result = pytester.runpytest_subprocess(
        "--pyargs", "ddp_conformance.suite", "--ddp-world-size", "2", "--ddp-timeout", "30", "-p", "no:cacheprovider",
        "--ddp-trainer", "one_rank_cannot.py:Trainer", "--ddp-checks", "gradient_equivalence", "--ddp-report",
        "report.json")
    result = json.loads((pytester.path / "report.json").read_text())["results"][0]
    figures = result["figures"]
    assert result["outcome"] == "passed", result
    if cannot == 0:  # every rank judged the fit's first step alone, from its run
        assert figures["fit_step"] == "judged" and "fit_step_max_rel_delta" not in figures, result
    else:  # the DDP step judged with rank 0's reference; the fit's step recomputed on no rank
        assert figures["fit_step"] == "not judged" and figures["max_rel_delta"] < 1e-5, result
        assert any(note.startswith("the fit's first optimizer step is not recomputed: ") and "only rank 0 has" in note
                   for note in figures["notes"]), result
