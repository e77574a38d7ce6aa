"""Both reference trainers on real process groups: they train, repeat themselves, run every config
in fixtures/configs/, and resume bit for bit; and the adapter surface the checks rely on works.

Every test body runs on every rank (`ddp` marker); tmp_path is shared by the ranks.
"""

from __future__ import annotations

import random

import pytest

from ddp_conformance.adapter import FitObserver, RankContext, StepInfo

from .support import CONFIG_FILES, CONFIGS, differences, make, run_config, trainer

TRAINERS = ["torch", "lightning"]


def all_gather(value: object) -> list[object]:
    import torch.distributed as dist

    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def param_vector(state: dict) -> list[float]:
    import torch

    return torch.cat([t.flatten().double() for t in state.values()]).tolist()


@pytest.mark.ddp(world_size=[1, 2, 4])
@pytest.mark.parametrize("name", TRAINERS)
def test_trains_loss_falls_and_same_seed_repeats(ddp, tmp_path, name):
    ctx = RankContext.from_fixture(ddp, tmp_path)
    cls, config = trainer(name), run_config(ctx)
    first = make(cls, config, ctx).fit(24)
    second = make(cls, config, ctx).fit(24)

    assert first.global_step == 24
    assert differences(first, second) == [], "same seed, same config: the two runs must be identical"
    window = 6
    early, late = sum(first.losses[:window]) / window, sum(first.losses[-window:]) / window
    assert late < 0.8 * early, f"loss did not fall: first {window} {early:.3f}, last {window} {late:.3f}"
    vectors = all_gather(param_vector(first.params))
    assert all(v == vectors[0] for v in vectors), "parameters differ between ranks after training"


@pytest.mark.ddp(world_size=2)
@pytest.mark.parametrize("config_file", CONFIG_FILES)
@pytest.mark.parametrize("name", TRAINERS)
def test_runs_from_each_config_with_its_ddp_kwargs(ddp, tmp_path, name, config_file):
    import math

    ctx = RankContext.from_fixture(ddp, tmp_path)
    config = run_config(ctx, CONFIGS / config_file)
    seen: dict = {}

    class Watch(FitObserver):
        def on_wrapped(self, model):
            seen.update(model._get_ddp_logging_data())
            seen.update(static_graph=model.static_graph, find_unused_parameters=model.find_unused_parameters)

    state = make(trainer(name), config, ctx).fit(6, observer=Watch())

    assert state.global_step == 6
    assert all(math.isfinite(loss) for loss in state.losses)
    strategy = config.trainer.strategy
    assert bool(seen["gradient_as_bucket_view"]) == bool(strategy.gradient_as_bucket_view)
    assert bool(seen["static_graph"]) == bool(strategy.static_graph)
    assert bool(seen["find_unused_parameters"]) == bool(strategy.find_unused_parameters)
    if strategy.bucket_cap_mb is not None:
        assert seen["bucket_cap_bytes"] == int(strategy.bucket_cap_mb * 1024 * 1024)


def disturb_rng(rank: int) -> None:
    """What a crash and a restart do to the RNGs: anything but the state at the checkpoint."""
    import numpy as np
    import torch

    torch.manual_seed(1000 + rank)
    np.random.seed(1000 + rank)
    random.seed(1000 + rank)


@pytest.mark.ddp(world_size=[2, 4])
@pytest.mark.parametrize("name", TRAINERS)
def test_resume_mid_epoch_with_dropout_is_bitwise(ddp, tmp_path, name):
    """Checkpoint at step 5 (mid-epoch at world size 2: 8 batches an epoch), resume to 12.

    Bitwise at world size <= 2. Above, gloo's ring all-reduce sums each element in an order that
    depends on its offset in DDP's bucket, and a fresh DDP (the resumed run's) runs its first
    iteration with the initial bucket layout before rebuilding it in gradient-ready order, so that
    one step can differ in the last bit (measured: 1.2e-7). Nothing a trainer can fix; asserted
    here as "only that small".
    """
    import torch

    from ddp_conformance.trainers import lightning_ref, torch_ref

    ctx = RankContext.from_fixture(ddp, tmp_path)
    cls = trainer(name)
    config = run_config(ctx, model={"dropout": 0.3})
    full = make(cls, config, ctx).fit(12)

    writes: list[str] = []
    original = torch_ref.atomic_save
    module = lightning_ref if name == "lightning" else torch_ref

    def recording_save(payload, path):
        writes.append(str(path))
        original(payload, path)

    module.atomic_save = recording_save
    try:
        part = make(cls, config, ctx).fit(12, checkpoint_dir=tmp_path / "ckpt", checkpoint_at=5)
    finally:
        module.atomic_save = original
    disturb_rng(ctx.rank)
    resumed = make(cls, config, ctx).resume(part.checkpoint, 12)

    if ctx.world_size <= 2:
        assert differences(full, resumed) == []
        assert resumed.losses == full.losses[5:], "the resumed run must see the same batches and masks"
    else:
        assert full.counters == resumed.counters
        for key, value in full.params.items():
            torch.testing.assert_close(resumed.params[key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(resumed.losses, full.losses[5:], rtol=1e-5, atol=1e-6)
    assert all_gather(len(writes)) == [1] + [0] * (ctx.world_size - 1), "only rank 0 writes"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [part.checkpoint.name]
    payload = torch.load(part.checkpoint, weights_only=True)
    model_keys = payload["model"] if name == "torch" else payload["state_dict"]
    assert not [k for k in model_keys if k.startswith("module.")], "checkpoint holds DDP-wrapped keys"


@pytest.mark.ddp(world_size=2)
def test_both_references_train_identically(ddp, tmp_path):
    """Same model, data, sampler, optimizer and precision: the Lightning reference is the torch
    reference's training under Lightning (advanced.yaml: bf16-mixed, dropout, BatchNorm)."""
    import torch

    ctx = RankContext.from_fixture(ddp, tmp_path)
    config = run_config(ctx, CONFIGS / "advanced.yaml")
    states = [make(trainer(name), config, ctx).fit(10) for name in TRAINERS]
    torch_state, lightning_state = states
    assert torch_state.losses == lightning_state.losses
    assert torch_state.counters == lightning_state.counters
    assert [k.removeprefix("net.") for k in lightning_state.params] == list(torch_state.params)
    for a, b in zip(torch_state.params.values(), lightning_state.params.values(), strict=True):
        assert torch.equal(a, b)


# --- what the fidelity machinery is for: take a piece away and the resume check sees it ---------


def _torch_without_rng():
    from ddp_conformance.trainers.torch_ref import TorchTrainer

    class TorchWithoutRng(TorchTrainer):
        def checkpoint_payload(self):
            payload = super().checkpoint_payload()
            del payload["rng"]
            return payload

    return TorchWithoutRng


def _lightning_without_rng():
    from ddp_conformance.trainers.lightning_ref import LightningTrainer

    class LightningWithoutRng(LightningTrainer):
        def trainer_arguments(self):
            return {}

    return LightningWithoutRng


def _lightning_plain_loader():
    from torch.utils.data import DataLoader

    from ddp_conformance.trainers.lightning_ref import LightningTrainer

    class LightningPlainLoader(LightningTrainer):
        def build_loader(self, dataset, sampler):
            return DataLoader(dataset, batch_size=self.config.data.batch_size, sampler=sampler)

    return LightningPlainLoader


@pytest.mark.ddp(world_size=2)
@pytest.mark.parametrize(
    ("variant", "dropout"),
    [(_torch_without_rng, 0.3), (_lightning_without_rng, 0.3), (_lightning_plain_loader, 0.0)],
    ids=["torch-no-rng", "lightning-no-rng", "lightning-plain-loader"],
)
def test_out_of_the_box_gaps_break_the_resume(ddp, tmp_path, variant, dropout):
    ctx = RankContext.from_fixture(ddp, tmp_path)
    cls = variant()
    config = run_config(ctx, model={"dropout": dropout})
    full = make(cls, config, ctx).fit(12)
    part = make(cls, config, ctx).fit(12, checkpoint_dir=tmp_path / "ckpt", checkpoint_at=5)
    disturb_rng(ctx.rank)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own "dataloader is not resumable" warning
        resumed = make(cls, config, ctx).resume(part.checkpoint, 12)
    assert any(d.startswith("params.") for d in differences(full, resumed))


# --- the surface the conformance checks use ------------------------------------------------------


@pytest.mark.ddp(world_size=2)
@pytest.mark.parametrize("config_file", ["basic.yaml", "tiny.yaml"])
@pytest.mark.parametrize("name", TRAINERS)
def test_train_step_on_shards_equals_global_batch_gradient(ddp, tmp_path, name, config_file):
    """basic: gradient_as_bucket_view (grads must be bucket views); tiny: accumulation + static_graph."""
    import torch

    ctx = RankContext.from_fixture(ddp, tmp_path)
    config = run_config(ctx, CONFIGS / config_file)
    adapter = make(trainer(name), config, ctx)
    dataset = adapter.make_dataset()
    per_rank = 4
    global_batch = adapter.collate([dataset[i] for i in range(per_rank * ctx.world_size)])
    shard = adapter.collate([dataset[i] for i in range(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)])

    # eval mode: dropout masks and BatchNorm batch statistics legitimately differ between shards
    reference = adapter.make_model().eval()
    wrapped = adapter.wrap(adapter.make_model().eval())
    torch.manual_seed(0)
    adapter.train_step(wrapped, shard)
    adapter.loss(reference, global_batch).backward()

    ddp_grads = dict(wrapped.module.named_parameters())
    for pname, param in reference.named_parameters():
        torch.testing.assert_close(ddp_grads[pname].grad, param.grad, msg=lambda m, n=pname: f"{n}: {m}")
    views = [p.grad._is_view() for p in wrapped.parameters()]
    assert all(views) if config.trainer.strategy.gradient_as_bucket_view else not any(views)


@pytest.mark.ddp(world_size=2)
@pytest.mark.parametrize("name", TRAINERS)
def test_observer_sees_every_micro_batch_and_the_wrapped_model(ddp, tmp_path, name):
    from torch.nn.parallel import DistributedDataParallel

    ctx = RankContext.from_fixture(ddp, tmp_path)
    config = run_config(ctx, CONFIGS / "tiny.yaml")  # accumulate_grad_batches: 2, 8 batches an epoch
    events: list[tuple[str, StepInfo]] = []
    wrapped: list[object] = []

    class Record(FitObserver):
        def on_wrapped(self, model):
            wrapped.append(model)

        def before_step(self, info):
            events.append(("before", info))

        def after_step(self, info):
            events.append(("after", info))

    make(trainer(name), config, ctx).fit(6, observer=Record())

    assert len(wrapped) == 1 and isinstance(wrapped[0], DistributedDataParallel)
    befores = [info for kind, info in events if kind == "before"]
    afters = [info for kind, info in events if kind == "after"]
    assert len(befores) == len(afters) == 12  # 6 optimizer steps x 2 micro-batches
    assert [i.global_step for i in befores] == [n // 2 for n in range(12)]
    assert [i.optimizer_step for i in befores] == [n % 2 == 1 for n in range(12)]
    assert [(i.epoch, i.position) for i in befores] == [(n // 8, n % 8) for n in range(12)]
    assert all(i.loss is not None and i.rank == ctx.rank and i.batch_size == 3 for i in afters)


@pytest.mark.ddp(world_size=2)
def test_lightning_leaves_the_rank_environment_as_it_found_it(ddp, tmp_path):
    """Ranks run test after test: a Trainer must not take WORLD_SIZE away (strategy teardown deletes
    it), leave PL_* variables behind, or need LOCAL_RANK to be preset (it would relaunch pytest)."""
    import os

    import torch.distributed as dist

    ctx = RankContext.from_fixture(ddp, tmp_path)
    config = run_config(ctx)
    local_rank = os.environ.pop("LOCAL_RANK", None)
    before = dict(os.environ)
    try:
        make(trainer("lightning"), config, ctx).fit(2)
        assert dict(os.environ) == before
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    assert dist.is_initialized() and dist.get_world_size() == 2


@pytest.mark.ddp(world_size=2)
def test_lightning_leaves_the_ranks_stack_dump_and_crash_handlers_armed(ddp, tmp_path):
    """At the end of every fit Lightning's Trainer sets each signal back to what Python's `signal`
    module saw: SIG_DFL for faulthandler's handlers, which sit beneath Python. The pool's stack
    request for a hang in a later fit then killed the rank ("died (killed by SIGUSR1)") and a
    segfault lost its traceback; the adapter installs them again after every fit."""
    import signal

    from ddp_conformance.runner.parent.process import catches_signal

    ctx = RankContext.from_fixture(ddp, tmp_path)
    make(trainer("lightning"), run_config(ctx), ctx).fit(2)
    assert catches_signal("self", signal.SIGUSR1) and catches_signal("self", signal.SIGSEGV)
