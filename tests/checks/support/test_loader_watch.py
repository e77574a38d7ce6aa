"""The loader passes a fit makes, as the recorder's LoaderWatch records them: hand-written batch samplers,
nested Subsets, the first step's batches."""

from __future__ import annotations

from ddp_conformance.checks.support.fit_watch import FitPlan


def test_a_hand_written_batch_sampler_of_indices_is_recorded_and_its_class_restored():
    """A length-bucketing sampler is a `Sampler` yielding lists of indices, no BatchSampler: its
    class's __iter__ is wrapped for the fit, and only the outermost of nested batch samplers records."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler, TensorDataset

    from ddp_conformance.checks.support.observe import FitRecorder

    class Buckets(Sampler):  # regroups a BatchSampler's batches, as bucketing samplers do
        def __init__(self):
            self.inner = BatchSampler(SequentialSampler(range(6)), batch_size=2, drop_last=False)

        def __iter__(self):
            flat = [i for batch in self.inner for i in batch]
            yield from ([flat[i], flat[i + 3]] for i in range(3))

        def __len__(self):
            return 3

    original = Buckets.__dict__["__iter__"]
    loader = DataLoader(TensorDataset(torch.arange(12.0).reshape(6, 2)), batch_sampler=Buckets())
    model = torch.nn.Linear(2, 1)
    with FitRecorder() as recorder:
        for _epoch in range(2):
            for (x,) in loader:
                model(x).sum().backward()
    assert Buckets.__dict__["__iter__"] is original  # restored when the fit ends
    passes = recorder.record.training_passes()
    assert [p.batches for p in passes] == [[[0, 3], [1, 4], [2, 5]]] * 2 and all(p.indexed for p in passes)
    assert passes[0].sampler == "Buckets" and len(passes[0].inputs) == 1  # indices: only the first input digested


def test_indices_into_nested_subsets_are_recorded_as_the_underlying_dataset_s():
    import torch
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from ddp_conformance.checks.support.fit_record import base_index
    from ddp_conformance.checks.support.observe import FitRecorder

    base = TensorDataset(torch.arange(20.0))
    shard = Subset(Subset(base, range(1, 20, 2)), [4, 0, 2])  # odd samples, then three of them
    with FitRecorder() as recorder:
        for _ in DataLoader(shard, batch_size=2):
            pass
    (recorded,) = recorder.record.passes
    assert recorded.batches == [[0, 1], [2]] and recorded.indexed  # the Subset's own, as a DataLoader draws
    assert recorded.base_batches() == [[9, 1], [5]]
    assert recorded.dataset_size == 3 and recorded.base_size == 20 and recorded.universe == [1, 5, 9]
    assert base_index([9, 1], 2) < 0 and base_index([9, 1], -1) < 0 and base_index(None, 7) == 7


def _loop(loader, model, read_ahead=False):
    """One optimizer step over 2 micro-batches of `loader` (reading the next batch before each
    forward's backward, as nanoGPT's loop does, or a further one ahead with `read_ahead`)."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(loader)
    batch = next(batches)
    if read_ahead:
        next(batches)  # a batch read before the first forward needs it
    for _ in range(2):
        out = model(batch["x"]).sum()
        batch = next(batches)  # the next micro-batch's, fetched before this backward
        out.backward()
    optimizer.step()
    optimizer.step()  # a later step's batches are not kept


def test_the_first_step_s_batches_are_kept_as_the_loader_yielded_them_and_read_ahead_shows():
    import torch
    from torch.utils.data import DataLoader

    from ddp_conformance.checks.gradient_equivalence.script_step import _first_step_problem
    from ddp_conformance.checks.support.observe import FitRecorder

    data = [{"x": torch.full((3,), float(i)), "id": i} for i in range(8)]
    with FitRecorder(plan=FitPlan(first_step=True, keep_batches=True)) as recorder:
        _loop(DataLoader(data, batch_size=2), torch.nn.Linear(3, 1))
    first = recorder.record.first_step
    assert first.micro_batches == 2 and first.sources == [(0, 1), (0, 2)]
    assert [b["id"].tolist() for b in first.batches] == [[0, 1], [2, 3]]
    assert first.batches[1]["x"][:, 0].tolist() == [2.0, 3.0]
    assert _first_step_problem(recorder.record) == ""
    with FitRecorder(plan=FitPlan(first_step=True, keep_batches=True)) as recorder:
        _loop(DataLoader(data, batch_size=2), torch.nn.Linear(3, 1), read_ahead=True)
    assert recorder.record.first_step.sources == [(0, 2), (0, 3)]
    assert "its loader is not read one batch per micro-batch" in _first_step_problem(recorder.record)
    with FitRecorder(plan=FitPlan(first_step=True)) as recorder:  # not asked: nothing kept, the loader's own iterator
        _loop(DataLoader(data, batch_size=2), torch.nn.Linear(3, 1))
    assert recorder.record.first_step.batches == []
    assert "no DataLoader" in _first_step_problem(recorder.record)
