"""The long fit's step marks: the parameters digested after each step, the state at step k."""

from __future__ import annotations

from ddp_conformance.checks.support.fit_watch import FitPlan


def test_steps_are_digested_and_snapshotted_only_on_request_and_a_second_optimizer_ends_the_step():
    """Only the fits that compare steps digest them (`step_marks.StepDigests`); the snapshot at step k holds
    the state after every optimizer of that iteration."""
    import functools

    import torch
    from torch import nn

    from ddp_conformance.checks.resume_fidelity.step_marks import SnapshotAt, StepDigests, snapshot_of, step_digests
    from ddp_conformance.checks.support.fit_watch import FitPlan
    from ddp_conformance.checks.support.observe import FitRecorder

    def fit(plan: FitPlan) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        first = torch.optim.SGD(model[0].parameters(), lr=0.1)
        second = torch.optim.SGD(model[1].parameters(), lr=0.1)
        after: list[dict] = []
        with FitRecorder(plan=plan) as recorder:
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
                first.step()
                second.step()
                after.append({k: v.clone() for k, v in model.state_dict().items()})
        return recorder.record, after

    plain, _ = fit(FitPlan())
    assert step_digests(plain) == [] and snapshot_of(plain) is None and plain.watchers == []
    record, after = fit(FitPlan(watchers=(StepDigests, functools.partial(SnapshotAt, 2))))
    assert len(step_digests(record)) == 6 and len(set(step_digests(record))) == 6  # every optimizer's step
    snapshot = snapshot_of(record)
    assert snapshot is not None and snapshot.step == 2 and snapshot.micro_batches == 2
    assert all(torch.equal(snapshot.state[k], v) for k, v in after[1].items())  # after both optimizers of step 2
