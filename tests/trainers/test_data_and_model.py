"""The torch reference's local pieces (no process group needed): sharding, set_epoch, the resumable
loader, seeded model init, the loss reduction, accumulation, RNG capture and atomic saves."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_conformance.adapter import RankContext
from ddp_conformance.config import RunConfig, load_config
from ddp_conformance.resumable import ResumableDataLoader, capture_rng_state, restore_rng_state
from ddp_conformance.trainers.torch_ref import TorchTrainer, atomic_save

from .support import CONFIGS


def adapter_for(config: RunConfig | None = None, tmp: Path = Path(".")) -> TorchTrainer:
    ctx = RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cpu", workdir=tmp)
    adapter = TorchTrainer()
    adapter.setup(config or RunConfig(), ctx)
    return adapter


def epoch_indices(adapter: TorchTrainer, world_size: int, epoch: int, size: int | None = None) -> list[list[int]]:
    dataset = adapter.make_dataset(size)
    return [
        [i for batch in adapter.make_loader(dataset, rank=r, world_size=world_size, epoch=epoch)
         for i in adapter.batch_indices(batch)]
        for r in range(world_size)
    ]


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 40), world_size=st.integers(1, 5), batch_size=st.integers(1, 6),
       drop_last=st.booleans(), shuffle=st.booleans(), seed=st.integers(0, 3))
def test_each_rank_gets_its_distributed_sampler_shard(size, world_size, batch_size, drop_last, shuffle, seed):
    data = replace(RunConfig().data, size=size, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle,
                   seed=seed)
    adapter = adapter_for(replace(RunConfig(), data=data))
    per_rank = epoch_indices(adapter, world_size, epoch=0)
    lengths = {len(r) for r in per_rank}
    assert len(lengths) == 1, "every rank gets the same number of samples"
    flat = [i for r in per_rank for i in r]
    if drop_last:
        assert len(set(flat)) == len(flat) == (size // world_size) * world_size
    else:
        assert set(flat) == set(range(size))
        assert len(flat) - size == (-size) % world_size  # DistributedSampler's padding, nothing more


def test_set_epoch_reshuffles_and_is_reproducible():
    adapter = adapter_for()
    epoch0, epoch0_again, epoch1 = (epoch_indices(adapter, 2, e) for e in (0, 0, 1))
    assert epoch0 == epoch0_again
    assert epoch0 != epoch1
    assert epoch0[0] != epoch0[1]


def test_resumable_loader_skips_what_was_consumed_in_that_epoch_only():
    adapter = adapter_for()
    dataset = adapter.make_dataset()
    loader = adapter.make_loader(dataset, rank=0, world_size=2, epoch=3)
    assert isinstance(loader, ResumableDataLoader)
    full = [adapter.batch_indices(b) for b in loader]

    iterator = iter(loader)
    consumed = [adapter.batch_indices(next(iterator)) for _ in range(3)]
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (3, 3)

    fresh = adapter.make_loader(dataset, rank=0, world_size=2, epoch=3)
    fresh.load_state_dict(state)
    assert consumed + [adapter.batch_indices(b) for b in fresh] == full
    assert len(fresh) == len(full)  # the epoch's length does not shrink (Lightning counts on it)

    other_epoch = adapter.make_loader(dataset, rank=0, world_size=2, epoch=0)
    other_epoch.load_state_dict({"epoch": 5, "position": 3})
    assert len([b for b in other_epoch]) == len(full)  # a state from another epoch skips nothing

    lazy = adapter.make_loader(dataset, rank=0, world_size=2, epoch=0)
    lazy.load_state_dict(state)
    iterator = iter(lazy)  # Lightning calls iter() first and set_epoch afterwards
    lazy.sampler.set_epoch(3)
    assert adapter.batch_indices(next(iterator)) == full[3]


def test_iterating_the_loader_does_not_touch_the_global_rng():
    adapter = adapter_for()
    loader = adapter.make_loader(adapter.make_dataset(), rank=0, world_size=1, epoch=0)
    before = torch.get_rng_state()
    list(loader)
    assert torch.equal(before, torch.get_rng_state())


def test_model_init_is_seeded_and_leaves_the_global_rng_alone():
    adapter = adapter_for(load_config(CONFIGS / "advanced.yaml"))
    before = torch.get_rng_state()
    a, b = adapter.make_model(), adapter.make_model()
    assert torch.equal(before, torch.get_rng_state())
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    other = adapter_for(replace(load_config(CONFIGS / "advanced.yaml"), seed=1)).make_model()
    assert not torch.equal(next(iter(other.parameters())), next(iter(a.parameters())))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_model_init_leaves_the_cuda_generator_that_dropout_draws_from_alone():
    """`torch.manual_seed` reseeds the CUDA generators too: a seeded build that forked only the CPU's
    reset a GPU run's dropout stream at every build, so a resume that lost its RNG state still matched."""
    from ddp_conformance.trainers.torch_ref import seeded

    torch.cuda.init()
    torch.cuda.manual_seed(1234)
    torch.rand(3, device="cuda")  # a stream that has moved on from its seed
    before = torch.cuda.get_rng_state()
    on_gpu = [seeded(0, lambda: torch.nn.Linear(4, 4, device="cuda")).weight for _ in range(2)]
    assert torch.equal(before, torch.cuda.get_rng_state())
    assert torch.equal(*on_gpu)  # a model built on the GPU is still seeded alike
    assert torch.equal(before, torch.cuda.get_rng_state())


def test_loss_is_the_batch_mean():
    adapter = adapter_for()
    dataset = adapter.make_dataset()
    model = adapter.make_model()
    batch = adapter.collate([dataset[i] for i in range(8)])
    per_sample = [adapter.loss(model, adapter.collate([dataset[i]])) for i in range(8)]
    torch.testing.assert_close(adapter.loss(model, batch), torch.stack(per_sample).mean())
    assert adapter.batch_indices(batch) == list(range(8))


@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_train_step_accumulates_to_the_full_batch_gradient(accumulate):
    config = load_config(None)
    config = replace(config, trainer=replace(config.trainer, accumulate_grad_batches=accumulate))
    adapter = adapter_for(config)
    dataset = adapter.make_dataset()
    batch = adapter.collate([dataset[i] for i in range(8)])
    stepped, reference = adapter.make_model(), adapter.make_model()
    loss = adapter.train_step(stepped, batch)
    full = adapter.loss(reference, batch)
    full.backward()
    torch.testing.assert_close(loss, full.detach())
    for p, q in zip(stepped.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_bf16_loss_runs_under_autocast():
    adapter = adapter_for(load_config(CONFIGS / "advanced.yaml"))
    dataset = adapter.make_dataset()
    model = adapter.make_model()
    captured = []
    model[0].register_forward_hook(lambda _m, _i, out: captured.append(out.dtype))
    loss = adapter.loss(model, adapter.collate([dataset[i] for i in range(4)]))
    assert captured == [torch.bfloat16] and loss.dtype == torch.float32


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    state = capture_rng_state()
    expected = (torch.rand(3), np.random.rand(), random.random())
    atomic_save({"rng": [state]}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)["rng"][0]
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    restore_rng_state(loaded)
    got = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # the temp file was renamed into place
