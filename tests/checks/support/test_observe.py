"""FitRecorder sees what a hand-written DDP loop really does, with no call in the loop."""

from __future__ import annotations

import pytest

from ddp_conformance.checks.support.fit_watch import FitPlan


@pytest.mark.ddp(world_size=2)
def test_recorder_sees_ddp_micro_batches_steps_and_the_indices_drawn(ddp):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

    from ddp_conformance.checks.support.observe import FitRecorder

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(10, 3), torch.randn(10, 1))
    sampler = DistributedSampler(data, num_replicas=2, rank=ddp.rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    model = DistributedDataParallel(nn.Linear(3, 1), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder() as recorder:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for position, (x, y) in enumerate(loader):
                sync = position % 2 == 1
                context = model.no_sync() if not sync else torch.enable_grad()
                with context:
                    nn.functional.mse_loss(model(x), y).backward()
                if sync:
                    optimizer.step()
                    optimizer.zero_grad()
        with torch.no_grad():  # an evaluation pass: not the training loader's
            for x, _ in loader:
                model(x)
    record = recorder.record
    assert record.ddp["gradient_as_bucket_view"] is True and record.ddp["static_graph"] is False
    assert record.micro_batches == 6 and record.synced == [False, True, False] * 2
    assert record.optimizer_steps == 2
    assert [p.trained for p in record.passes] == [True, True, False]
    expected = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        expected.append([order[i:i + 2] for i in range(0, len(order), 2)])
    assert [p.batches for p in record.training_passes()] == expected
    assert record.passes[0].length == 3 and record.passes[0].dataset_size == 10
    assert record.passes[0].shuffle is True and record.passes[0].indexed
    # everything is put back: the next fit (or the user's code) runs unhooked
    assert "__iter__" in DataLoader.__dict__ and DataLoader.__iter__.__qualname__ == "DataLoader.__iter__"
    assert BatchSampler.__iter__.__qualname__ == "BatchSampler.__iter__"
    from torch.nn.modules import module

    assert not module._global_forward_pre_hooks


def test_a_first_step_one_process_cannot_redo_is_not_judged_and_says_why():
    import torch

    from ddp_conformance.checks.gradient_equivalence.fit_step import _unjudgeable
    from ddp_conformance.checks.support.fit_record import FirstStep, FitRecord, LoaderPass

    def record(model=None, rng_drawn=False, grads=True, indexed=True, overflowed=0):
        model = model or torch.nn.Linear(2, 2)
        step = FirstStep([p.detach() for p in model.parameters()], [torch.zeros(1)] if grads else None, 1, rng_drawn,
                         overflowed)
        loader = LoaderPass(length=4, dataset_size=8, sampler="DistributedSampler", shuffle=True, batches=[[0, 1]],
                            indexed=indexed, trained=True)
        return FitRecord(model=model, first_step=step, passes=[loader])

    assert _unjudgeable(record()) == ""
    assert "no optimizer step" in _unjudgeable(FitRecord())
    assert "no optimizer step" in _unjudgeable(record(grads=False))
    assert "drew random numbers during it (dropout" in _unjudgeable(record(rng_drawn=True))
    assert "a GradScaler skipped the fit's first 2 optimizer step(s)" in _unjudgeable(record(overflowed=2))
    batchnorm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert "BatchNorm in training mode" in _unjudgeable(record(model=batchnorm))
    assert _unjudgeable(record(model=batchnorm.eval())) == ""
    assert "no dataset indices through a BatchSampler" in _unjudgeable(record(indexed=False))


def test_the_recorder_keeps_what_optimizers_step_outside_the_model_and_what_each_batch_fed():
    import torch
    from torch.utils.data import DataLoader, Sampler

    from ddp_conformance.checks.support.digests import input_digest
    from ddp_conformance.checks.support.model_state import OUTSIDE, trained
    from ddp_conformance.checks.support.observe import FitRecorder

    class Pairs(Sampler):  # a hand-written batch sampler of keys, not indices: nothing to read by index
        def __iter__(self):
            return iter([["a", "b"], ["c", "d"], ["e", "f"]])

        def __len__(self):
            return 3

    rows = torch.arange(12.0).reshape(6, 2)
    loader = DataLoader({key: (rows[n],) for n, key in enumerate("abcdef")}, batch_sampler=Pairs())
    model, temperature = torch.nn.Linear(2, 1), torch.nn.Parameter(torch.ones(()))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)  # stepped by no optimizer: not compared
    optimizer = torch.optim.SGD([*model.parameters(), temperature, frozen], lr=0.1)
    with FitRecorder() as recorder:
        for (x,) in loader:
            (model(x).sum() * temperature).backward()
            optimizer.step()
    record = recorder.record
    outside = record.stepped_outside_model()
    name = "optimizer param_groups[0][2], a scalar"
    assert list(outside) == [name] and outside[name].data_ptr() == temperature.data_ptr()  # the live tensor
    assert sorted(trained(model.state_dict(), record, outside=[name])) == ["bias", OUTSIDE + name, "weight"]
    start, now = record.outside_digests()[name]  # before the first step, and after the last
    assert start == input_digest(torch.ones(())) and now == input_digest(temperature.detach()) != start
    [fed] = record.training_passes()
    assert fed.sampler == "Pairs" and fed.shuffle is None and not fed.indexed
    assert len(fed.inputs) == 3 and len(set(fed.inputs)) == 3 and fed.first_input == fed.inputs[0]


def test_the_ranks_micro_batches_are_joined_along_the_batch_dimension_or_the_skip_says_why():
    from collections import namedtuple

    import torch

    from ddp_conformance.checks.gradient_equivalence.script_step import Unjudged, _size_problem, concatenated

    Pair = namedtuple("Pair", "x y")
    joined = concatenated([{"pair": Pair(torch.zeros(2, 3), torch.zeros(2)), "task": "lm"},
                           {"pair": Pair(torch.ones(2, 3), torch.ones(2)), "task": "lm"}])
    assert isinstance(joined["pair"], Pair) and joined["pair"].x.shape == (4, 3) and joined["task"] == "lm"
    assert joined["pair"].y.tolist() == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(Unjudged, match="cannot be concatenated"):
        concatenated([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(Unjudged, match="differ between ranks"):
        concatenated([(torch.zeros(2), "a"), (torch.zeros(2), "b")])
    assert "differ in size" in _size_problem([[torch.zeros(4)], [torch.zeros(3)]])
    assert _size_problem([[torch.zeros(4), torch.zeros(4)], [torch.zeros(4), torch.zeros(4)]]) == ""


@pytest.mark.parametrize(("dropout", "randint_batches", "drew"), [
    (0.0, False, False),  # the PyTorch DDP tutorial's loop: only the loaders draw (their seeds, each pass)
    (0.5, False, True),  # dropout
    (0.0, True, True),  # nanoGPT's batches: torch.randint offsets drawn by the loop
])
def test_the_trainer_s_rng_draws_are_told_from_a_dataloader_s_own(dropout, randint_batches, drew):
    """A DataLoader without a generator draws its `_base_seed` from torch's RNG at every pass, and a
    RandomSampler its seed at its first batch: that is not the trainer using random numbers, which is
    what an RNG verdict needs. The RNG state at every micro-batch is kept with the steps before it."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_conformance.checks.support.observe import FitRecorder

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    loader = DataLoader(data, batch_size=2, shuffle=True)  # RandomSampler, no generator
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(dropout), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder() as recorder:
        for _epoch in range(3):
            for x, y in loader:
                if randint_batches:
                    picked = torch.randint(len(data), (2,))
                    x, y = data.tensors[0][picked], data.tensors[1][picked]
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    record = recorder.record
    assert record.rng_consumed is drew
    trail = record.rng_trail
    # the loader's draws: its `_base_seed` and the RandomSampler's seed, before each pass's first batch
    assert [m.steps for m in trail] == list(range(12))
    assert [m.loader_drew for m in trail] == [True, False, False, False] * 3
    assert trail[0].rng == record.first_rng and len({m.rng for m in trail}) == (12 if drew else 3)


@pytest.mark.ddp(world_size=2)
def test_recorder_sees_ddp_join_and_how_it_is_entered(ddp):
    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from ddp_conformance.checks.support.fit_record import JoinUse
    from ddp_conformance.checks.support.observe import FitRecorder

    model = DistributedDataParallel(nn.Linear(3, 1))
    with FitRecorder() as recorder:
        with model.join(throw_on_early_termination=True):
            model(torch.randn(2, 3)).sum().backward()
        with Join([model], enable=False):
            model(torch.randn(2, 3)).sum().backward()
    assert recorder.record.joins == [JoinUse(("DistributedDataParallel",), True, True),
                                     JoinUse(("DistributedDataParallel",), False, False)]
    assert Join.__init__.__qualname__ == "Join.__init__"  # put back after the fit


def test_steps_a_grad_scaler_skips_are_counted_as_the_trainer_counts_them_not_taken_for_a_window():
    """A GradScaler whose scaled gradients overflow skips `optimizer.step()`, so no step hook runs: the first
    applied step comes micro-batches later, and those before it are not in its gradients. The trainer's loop
    still counts the skipped step (Lightning's global_step does), so step k's snapshot is the trainer's step k:
    counted otherwise, a checkpoint at k was compared with the state one applied step later ("the model
    weights are not restored" for Lightning's demo at 16-mixed on an H200)."""
    import torch
    from torch import nn

    from ddp_conformance.checks.gradient_equivalence.fit_step import _unjudgeable
    from ddp_conformance.checks.gradient_equivalence.script_step import _first_step_problem
    from ddp_conformance.checks.resume_fidelity.step_marks import SnapshotAt, StepDigests, snapshot_of, step_digests
    from ddp_conformance.checks.support.observe import FitRecorder

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    inputs = [torch.full((2, 3), float("inf")), torch.randn(2, 3), torch.randn(2, 3)]  # a first batch that overflows
    after = []
    plan = FitPlan(first_step=True, watchers=(StepDigests, lambda: SnapshotAt(2)))
    with FitRecorder(plan=plan) as recorder:
        for x in inputs:
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            after.append(model.weight.detach().clone())
    record = recorder.record
    assert (record.first_step.overflowed, record.first_step.micro_batches, record.optimizer_steps) == (1, 2, 3)
    assert torch.equal(snapshot_of(record).state["weight"], after[1]) and not torch.equal(after[0], after[1])
    assert len(step_digests(record)) == 3 and step_digests(record)[0] != step_digests(record)[1]
    assert all(torch.isfinite(g).all() for g in record.first_step.grads)
    assert torch.amp.GradScaler.step.__qualname__ == "GradScaler.step"  # put back after the fit
    skipped = "a GradScaler skipped the fit's first 1 optimizer step(s)"  # neither rerun takes 2 micro-batches for it
    assert skipped in _unjudgeable(record) and skipped in _first_step_problem(record)


def test_a_recompute_is_refused_when_make_dataset_is_not_what_the_fit_s_loader_yielded():
    """Lightning's BoringModel builds its RandomDataset anew in train_dataloader(): make_dataset() then holds
    other random tensors than the fit read, and a recompute from it computes another step. The kept batches are
    matched by how many the pass had yielded, so a loop that fetches one ahead (Lightning's) still matches."""
    import torch
    from torch.utils.data import default_collate

    from ddp_conformance.checks.gradient_equivalence.fit_step import _fed_other_items
    from ddp_conformance.checks.support.fit_record import FirstStep

    data = [torch.full((2,), float(i)) for i in range(8)]
    sampled = [[3, 1], [0, 2], [5, 4]]
    adapter = type("Adapter", (), {"collate": staticmethod(default_collate)})()

    def first(*counts):
        step = FirstStep([], [torch.zeros(1)], len(counts))
        step.batches = [default_collate([data[i] for i in sampled[c - 1]]) for c in counts]
        step.sources = [(0, c) for c in counts]
        return step

    assert not _fed_other_items(adapter, data, first(1, 2), sampled)
    assert not _fed_other_items(adapter, data, first(2, 3), sampled)  # fetched one ahead, as Lightning does
    redrawn = [torch.randn(2) for _ in data]  # the same indices, data built again
    assert _fed_other_items(adapter, redrawn, first(1, 2), sampled)


def test_with_model_hooks_only_the_recorder_leaves_every_other_module_s_forward_unhooked():
    """compiled_model's fits: a forward compiled after the first micro-batch traces none of the recorder's hooks,
    which still count every micro-batch of the model; an unused parameter's None gradient is no gradient."""
    import torch
    from torch import nn
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

    from ddp_conformance.checks.support.observe import FitRecorder

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    spare = nn.Linear(3, 3)  # a parameter the graph never uses
    model.add_module("spare", spare)
    model.forward = lambda x: model[2](model[1](model[0](x)))  # type: ignore[method-assign]
    before = (len(_global_forward_pre_hooks), len(_global_forward_hooks))
    with FitRecorder(plan=FitPlan(model_hooks_only=True)) as recorder:
        assert (len(_global_forward_pre_hooks), len(_global_forward_hooks)) == (before[0] + 1, before[1] + 1)
        for step in range(3):
            output = model(torch.randn(2, 3))
            assert (len(_global_forward_pre_hooks), len(_global_forward_hooks)) == before
            assert not model[0]._forward_pre_hooks and len(model._forward_pre_hooks) == 1
            if step == 0:  # before any gradient: as a compiled backward calls it for a parameter it did not use
                for hook in spare.weight._backward_hooks.values():
                    hook(None)
            output.sum().backward()
    assert recorder.record.micro_batches == 3 and recorder.record.model is model
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_activation_checkpointing_s_recomputed_forwards_are_no_micro_batches():
    """A checkpointed block's forward runs again inside the backward (reentrant or not): the recorder counted each
    recomputation as a micro-batch, so a correct fit with checkpointing read as three micro-batches per step."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from ddp_conformance.checks.support.observe import FitRecorder

    class Checkpointed(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.stem, self.block = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.reentrant = reentrant

        def forward(self, x):
            x = self.stem(x)
            for _ in range(2):
                x = checkpoint(self.block, x, use_reentrant=self.reentrant)
            return x.sum()

    for reentrant in (True, False):
        model = Checkpointed(reentrant)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with FitRecorder() as recorder:
            for _ in range(2):
                model(torch.randn(2, 3)).backward()
                optimizer.step()
        assert recorder.record.micro_batches == 2 and recorder.record.optimizer_steps == 2
