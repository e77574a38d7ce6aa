"""The recorder reads what each rank trains through the wrappers that shard a DataLoader's batches
(Hugging Face accelerate's BatchSamplerShard, SkipBatchSampler, DataLoaderShard), with accelerate's own
classes where it is installed, and never fails a fit on a wrapper it does not know."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from ddp_conformance.checks.support import loader_wrappers
from ddp_conformance.checks.support.fit_watch import FitPlan
from ddp_conformance.checks.support.loader_watch import dropped_tail
from ddp_conformance.checks.support.observe import FitRecorder

NEEDS_ACCELERATE = "accelerate (the dev extra) is not installed: its wrappers cannot be built"


class Shard(BatchSampler):
    """A wrapper in accelerate's shape, by its attributes only: every `num_processes`-th batch of the inner one."""

    def __init__(self, batch_sampler, num_processes, process_index):
        self.batch_sampler, self.num_processes, self.process_index = batch_sampler, num_processes, process_index

    def __iter__(self):
        for position, batch in enumerate(self.batch_sampler):
            if position % self.num_processes == self.process_index:
                yield batch

    def __len__(self):
        return len(self.batch_sampler) // self.num_processes


def _train(loader, epochs=1):
    """A training loop: a forward, backward and step per batch of the loader's {"x": ...} batches."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for batch in loader:
            model(batch["x"]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


DATA = [{"x": torch.full((2,), float(i)), "id": i} for i in range(12)]


def test_a_wrapper_s_chain_is_read_by_its_attributes():
    inner = BatchSampler(RandomSampler(range(12)), batch_size=2, drop_last=False)
    shard = Shard(inner, num_processes=2, process_index=1)
    assert loader_wrappers.chain(shard) == [shard, inner] and loader_wrappers.is_wrapper(shard)
    assert not loader_wrappers.is_wrapper(inner) and loader_wrappers.chain(inner) == [inner]
    assert isinstance(loader_wrappers.ordering_sampler(shard), RandomSampler)
    assert loader_wrappers.shard(shard) == (1, 2) and loader_wrappers.shard(inner) is None
    assert loader_wrappers.described(shard) == "Shard (process 1 of 2) over BatchSampler"
    assert loader_wrappers.described(inner) is None


def test_the_recorder_records_the_indices_a_wrapper_yields_to_this_rank_not_the_inner_batch_sampler_s():
    """Before, the inner BatchSampler recorded every batch of the epoch: every rank looked like it iterated the
    whole dataset ("identical index sequences: no DistributedSampler")."""
    inner = BatchSampler(SequentialSampler(range(12)), batch_size=2, drop_last=False)
    original = Shard.__dict__["__iter__"]
    with FitRecorder() as recorder:
        _train(DataLoader(DATA, batch_sampler=Shard(inner, 2, 1)), epochs=2)
    assert Shard.__dict__["__iter__"] is original  # the wrapper's class is restored when the fit ends
    passes = recorder.record.training_passes()
    assert [p.batches for p in passes] == [[[2, 3], [6, 7], [10, 11]]] * 2 and all(p.indexed for p in passes)
    assert passes[0].sampler == "SequentialSampler" and passes[0].shuffle is False
    assert passes[0].wrappers == "Shard (process 1 of 2) over BatchSampler"


def test_a_wrapper_that_yields_no_indices_is_recorded_without_them_and_the_fit_runs():
    class Keys(BatchSampler):  # wraps another, yields keys, has none of BatchSampler's attributes
        def __init__(self, batch_sampler):
            self.batch_sampler = batch_sampler

        def __iter__(self):
            for batch in self.batch_sampler:
                yield [f"key{i}" for i in batch]

        def __len__(self):
            return len(self.batch_sampler)

    data = {f"key{i}": {"x": torch.full((2,), float(i))} for i in range(4)}
    loader = DataLoader(data, batch_sampler=Keys(BatchSampler(SequentialSampler(range(4)), 2, False)))
    with FitRecorder() as recorder:
        _train(loader)
    (recorded,) = recorder.record.training_passes()
    assert not recorded.indexed and recorded.batches == []
    assert dropped_tail(Keys(object())) == 0  # no drop_last, no sampler, no length: nothing this can know


def test_the_dropped_tail_is_read_through_the_wrappers():
    drops = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=True)
    assert dropped_tail(drops) == 1
    # 3 full batches, of which a shard over 2 processes keeps one round: 3 samples a rank of the 5 of a half
    assert dropped_tail(Shard(drops, 2, 0)) == 2
    keeps = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
    assert dropped_tail(Shard(keeps, 2, 0)) == 0 and dropped_tail(None) == 0


def test_accelerate_s_skip_batch_sampler_has_no_drop_last_and_is_read_through():
    """`skip_first_batches` wraps the batch sampler in a SkipBatchSampler, a BatchSampler without `drop_last`:
    reading it raised AttributeError in the harness on every accelerate resume."""
    data_loader = pytest.importorskip("accelerate.data_loader", reason=NEEDS_ACCELERATE)
    inner = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=True)
    shard = data_loader.BatchSamplerShard(inner, num_processes=2, process_index=1)
    skip = data_loader.SkipBatchSampler(shard, skip_batches=1)
    assert not hasattr(skip, "drop_last")
    assert dropped_tail(skip) == dropped_tail(shard) == 2
    assert loader_wrappers.described(skip) == ("SkipBatchSampler (skips 1 batches) over BatchSamplerShard (process 1 "
                                               "of 2) over BatchSampler")
    assert isinstance(loader_wrappers.ordering_sampler(skip), SequentialSampler)


def _accelerate_loader(process_index, skip=0):
    """A DataLoaderShard for process `process_index` of 2, as `Accelerator.prepare` builds it, without a group."""
    data_loader = pytest.importorskip("accelerate.data_loader", reason=NEEDS_ACCELERATE)
    inner = BatchSampler(SequentialSampler(range(12)), batch_size=2, drop_last=False)
    batch_sampler = data_loader.BatchSamplerShard(inner, num_processes=2, process_index=process_index)
    if skip:
        batch_sampler = data_loader.SkipBatchSampler(batch_sampler, skip_batches=skip)
    return data_loader.DataLoaderShard(DATA, batch_sampler=batch_sampler)


def test_accelerate_s_loader_shard_is_recorded_as_this_rank_s_share_and_its_skip_too():
    pytest.importorskip("accelerate", reason=NEEDS_ACCELERATE)
    from ddp_conformance.trainers import accelerate_state

    with accelerate_state.fresh(), FitRecorder() as recorder:  # its GradientState is left as it was
        _train(_accelerate_loader(0))
        _train(_accelerate_loader(1, skip=1))
    first, skipped = recorder.record.training_passes()
    assert first.batches == [[0, 1], [4, 5], [8, 9]] and first.indexed
    assert skipped.batches == [[6, 7], [10, 11]]
    assert skipped.wrappers.startswith("SkipBatchSampler (skips 1 batches) over BatchSamplerShard (process 1 of 2)")


def test_the_first_step_s_batch_is_the_one_a_loader_shard_handed_over_not_the_one_it_read_ahead():
    """DataLoaderShard reads its DataLoader one batch ahead: at the first forward its DataLoader has yielded 2
    batches. gradient_equivalence skipped every accelerate script ("its loader is not read one batch per
    micro-batch") and so missed a loss divided by the number of processes."""
    pytest.importorskip("accelerate", reason=NEEDS_ACCELERATE)
    from ddp_conformance.checks.gradient_equivalence.script_step import _first_step_problem
    from ddp_conformance.trainers import accelerate_state

    with accelerate_state.fresh(), FitRecorder(plan=FitPlan(first_step=True, keep_batches=True)) as recorder:
        _train(_accelerate_loader(1))
    first = recorder.record.first_step
    assert first.sources == [(0, 1)] and first.batches[0]["id"].tolist() == [2, 3]
    assert _first_step_problem(recorder.record) == ""


def test_accelerate_s_singletons_are_empty_inside_a_world_of_one_and_restored_after():
    state = pytest.importorskip("accelerate.state", reason=NEEDS_ACCELERATE)
    from ddp_conformance.trainers import accelerate_state

    with accelerate_state.fresh():  # whatever an earlier test left
        state.PartialState._shared_state.update(num_processes=2, process_index=1)
        with accelerate_state.fresh():
            assert state.PartialState._shared_state == {} and state.GradientState._shared_state == {}
            state.PartialState._shared_state["num_processes"] = 1  # the world of one's own Accelerator()
        assert state.PartialState._shared_state == {"num_processes": 2, "process_index": 1}
        from ddp_conformance.checks.support.one_world import world_of_one

        with world_of_one():  # a trainer's Accelerator() built in the world of one reads one process
            assert state.PartialState._shared_state == {}
        assert state.PartialState._shared_state["num_processes"] == 2


def test_attention_dropout_is_off_in_both_runs_of_a_script_s_first_step():
    """transformers' attention passes `dropout_p` to scaled_dot_product_attention in training: masks drawn for a
    rank's batch can never be redrawn for the global batch, so both runs drop nothing, as with F.dropout."""
    import torch.nn.functional as F

    from ddp_conformance.checks.gradient_equivalence.script_step import without_dropout

    q = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    plain = F.scaled_dot_product_attention(q, q, q)
    with without_dropout():
        before = torch.get_rng_state()
        assert torch.equal(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), plain)
        assert torch.equal(F.scaled_dot_product_attention(q, q, q, None, 0.5), plain)
        assert torch.equal(torch.get_rng_state(), before)  # no random numbers drawn


def test_a_dispatched_loader_is_marked_and_its_first_step_is_not_judged_on_batches_it_did_not_train():
    """accelerate's DataLoaderDispatcher (`dispatch_batches=True`) reads every rank's batches on rank 0 and sends
    each its slice: what rank 0's DataLoader yields is not what any rank trains, so it is named, never used."""
    data_loader = pytest.importorskip("accelerate.data_loader", reason=NEEDS_ACCELERATE)
    from ddp_conformance.checks.gradient_equivalence.script_step import _first_step_problem
    from ddp_conformance.trainers import accelerate_state

    with accelerate_state.fresh(), FitRecorder(plan=FitPlan(first_step=True, keep_batches=True)) as recorder:
        _train(data_loader.DataLoaderDispatcher(DATA, batch_size=2))
    (recorded,) = recorder.record.training_passes()
    assert recorded.dispatched and recorder.record.first_step.batches == [None]
    assert "dispatches the batches" in _first_step_problem(recorder.record)


def test_an_iterable_dataset_shard_is_recorded_as_an_iterable_and_its_first_step_batch_is_the_one_trained():
    data_loader = pytest.importorskip("accelerate.data_loader", reason=NEEDS_ACCELERATE)
    from torch.utils.data import IterableDataset

    from ddp_conformance.trainers import accelerate_state

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(DATA)

    shard = data_loader.IterableDatasetShard(Stream(), batch_size=2, num_processes=2, process_index=1)
    with accelerate_state.fresh(), FitRecorder(plan=FitPlan(first_step=True, keep_batches=True)) as recorder:
        _train(data_loader.DataLoaderShard(shard, batch_size=2))
    (recorded,) = recorder.record.training_passes()
    assert recorded.iterable and not recorded.indexed
    assert recorder.record.first_step.batches[0]["id"].tolist() == [2, 3]  # process 1's half of the first 4


def test_the_indices_each_micro_batch_trains_are_the_handed_over_batch_s_with_keyword_inputs():
    """A forward called with keyword arguments (`model(**batch)`, as transformers models are) shows the recorder no
    tensor to match: the batch a micro-batch trains is then the one the DataLoaderShard handed over, not the one it
    read ahead (resume_fidelity's data-position evidence)."""
    pytest.importorskip("accelerate", reason=NEEDS_ACCELERATE)
    from ddp_conformance.trainers import accelerate_state

    model = torch.nn.Linear(2, 1)
    with accelerate_state.fresh(), FitRecorder(plan=FitPlan(draws=lambda batch: batch["id"].tolist())) as recorder:
        for batch in _accelerate_loader(1):
            model(input=batch["x"]).sum().backward()
    assert [indices for _, indices in recorder.record.step_draws()] == [[2, 3], [6, 7], [10, 11]]
