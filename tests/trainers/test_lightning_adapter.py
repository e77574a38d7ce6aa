"""The Lightning adapter's local pieces (no process group): what it keeps of a factory's Trainer
arguments, the one-line conflict with the run config, batch splitting, and running a method as DDP's
forward. Its behaviour in ranks is tested through the suite (tests/examples/test_lightning_module.py,
and the Lightning reference, which is this adapter, in tests/trainers and tests/checks)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from ddp_conformance.adapter import RankContext
from ddp_conformance.config import RunConfig
from ddp_conformance.lightning import RNGStateCallback
from ddp_conformance.trainers.lightning_adapter import (
    LightningAdapter,
    LightningBuild,
    call_as_forward,
    split_batch,
    step_loss,
)
from ddp_conformance.trainers.lightning_parts import LightningParts


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return {"loss": self(batch["x"]).pow(2).mean()}


def adapter(tmp_path: Path, kwargs: dict, config: RunConfig | None = None) -> tuple[LightningAdapter, LightningBuild]:
    lit = LightningAdapter(LightningParts(spec="lightning:t.py:make", label="make", factory=lambda: Tiny()))
    lit.setup(config or RunConfig(), RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cpu",
                                                 workdir=tmp_path))
    return lit, LightningBuild(Tiny(), None, kwargs)


def test_a_factorys_trainer_arguments_are_kept_and_the_harness_decides_its_own(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    theirs = RNGStateCallback()
    lit, built = adapter(tmp_path, {"gradient_clip_val": 0.5, "max_epochs": 10, "logger": True, "precision": 32,
                                    "callbacks": [theirs, ModelCheckpoint(monitor="val_loss")]})
    trainer = lit.make_trainer(built, [], max_steps=7)
    assert trainer.gradient_clip_val == 0.5 and trainer.max_steps == 7 and trainer.max_epochs == -1
    assert trainer.logger is None and not trainer.checkpoint_callbacks  # the harness checkpoints, nobody else
    assert theirs in trainer.callbacks


@pytest.mark.parametrize(("key", "value", "config"), [("precision", "bf16-mixed", "'32-true'"),
                                                      ("accumulate_grad_batches", 4, "1")])
def test_a_factory_that_contradicts_the_run_config_is_one_line(tmp_path, key, value, config):
    lit, built = adapter(tmp_path, {key: value})
    with pytest.raises(ValueError) as caught:
        lit.make_trainer(built, [], max_steps=1)
    assert str(caught.value) == (f"the trainer's arguments set {key}={value!r} but the run config says {config}: the "
                                 f"checks judge with the config's, so set trainer.{key} in the --ddp-config file")


def test_the_config_decides_precision_and_accumulation(tmp_path):
    config = RunConfig()
    config = replace(config, trainer=replace(config.trainer, accumulate_grad_batches=2))
    lit, built = adapter(tmp_path, {"precision": "32", "accumulate_grad_batches": 2}, config)
    assert lit.make_trainer(built, [], max_steps=1).accumulate_grad_batches == 2


def test_batches_of_any_shape_split_into_micro_batches():
    Pair = namedtuple("Pair", "x y")
    batch = {"x": torch.arange(6.0).reshape(6, 1), "meta": "kept", "pair": Pair(torch.arange(6), torch.ones(6))}
    parts = split_batch(batch, 3)
    assert [p["x"].flatten().tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["meta"] == "kept" and isinstance(p["pair"], Pair) and len(p["pair"].y) == 2 for p in parts)
    assert len(split_batch([torch.arange(2)], 4)) == 2  # empty micro-batches are dropped


def test_a_method_runs_as_the_wrappers_forward_and_forward_is_restored():
    module = Tiny()
    calls = []

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args):
            calls.append("wrapper")
            return self.module(*args)

    out = call_as_forward(Wrapper(), module, "training_step", {"x": torch.ones(2, 3)}, 0)
    assert calls == ["wrapper"] and step_loss(out) is out["loss"]
    assert "forward" not in vars(module) and module(torch.ones(1, 3)).shape == (1, 1)


def test_a_step_that_reads_the_trainer_runs_beside_the_trainer_the_fit_would_build(tmp_path):
    """`self.trainer` outside a fit: the Trainer the adapter would fit with (this rank's world size:
    a loss divided by it is divided as in the fit), `self.log` silent, detached again afterwards."""

    class ReadsTrainer(Tiny):
        def training_step(self, batch, batch_idx):
            self.log("step", float(self.trainer.global_step))
            return self(batch["x"]).sum() * self.trainer.world_size

    # the message the adapter recognises is Lightning's own: if a release rewords it, this fails loudly
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        ReadsTrainer().trainer  # noqa: B018
    lit = LightningAdapter(LightningParts(spec="lightning:t.py:make", label="make", factory=lambda: Tiny()))
    lit.setup(RunConfig(), RankContext(rank=0, local_rank=0, world_size=3, backend="gloo", device="cpu",
                                       workdir=tmp_path))
    module, x = ReadsTrainer(), torch.ones(2, 3)
    assert float(lit.loss(module, {"x": x}).detach()) == pytest.approx(3 * float(module(x).sum().detach()))
    assert module._trainer is None


def test_a_step_that_needs_a_running_fit_is_not_provided_rather_than_an_error(tmp_path):
    from ddp_conformance.adapter import NotProvided

    class NeedsFit(Tiny):
        def training_step(self, batch, batch_idx):
            return self(batch["x"]).sum() * len(self.trainer.train_dataloader)

    lit, _ = adapter(tmp_path, {})
    with pytest.raises(NotProvided, match=r"use self\.trainer, and with a Trainer attached outside Trainer\.fit it "
                                          r"raised TypeError"):
        lit.loss(NeedsFit(), {"x": torch.ones(2, 3)})


def test_a_factorys_ddp_strategy_settings_are_kept_with_the_configs_on_top(tmp_path):
    from lightning.pytorch.strategies import DDPStrategy

    config = RunConfig()
    config = replace(config, trainer=replace(config.trainer, strategy=replace(config.trainer.strategy,
                                                                              gradient_as_bucket_view=True)))
    lit, _ = adapter(tmp_path, {}, config)
    lit.parts = replace(lit.parts, factory=lambda: (Tiny(), None, {"strategy": DDPStrategy(
        find_unused_parameters=True, broadcast_buffers=False)}))
    assert lit.ddp_kwargs() == {"find_unused_parameters": True, "broadcast_buffers": False,
                                "gradient_as_bucket_view": True}
    assert lit.strategy()._ddp_kwargs == lit.ddp_kwargs()  # the fits' strategy, and wrap's DDP, use them


@pytest.mark.parametrize(("strategy", "config", "expected"), [
    ("ddp_find_unused_parameters_true", {}, {"find_unused_parameters": True}),
    ("ddp", {"static_graph": True}, {"static_graph": True}),
    (None, {}, {}),
])
def test_a_strategy_named_by_its_registered_name_is_read_too(strategy, config, expected):
    from ddp_conformance.trainers.lightning_adapter import merged_ddp_kwargs

    assert merged_ddp_kwargs(strategy, config) == expected


@pytest.mark.parametrize(("strategy", "config", "line"), [
    ("find", {"find_unused_parameters": False},
     "the trainer's DDPStrategy sets find_unused_parameters=True but the run config says False: the checks judge "
     "with the config's, so set trainer.strategy.find_unused_parameters in the --ddp-config file (or leave it out "
     "there)"),
    ("fsdp", {}, "the trainer's arguments set strategy='fsdp', which is not Lightning's DDPStrategy: the checks run "
     "the fit under DDPStrategy, so leave strategy out of the Trainer arguments (DDP's settings go in the "
     "--ddp-config file's trainer.strategy)"),
    ("hook", {}, "the trainer's DDPStrategy sets ddp_comm_hook, which the checks' own DDP steps cannot carry (they "
     "would judge gradients without it): leave it out to check this trainer"),
])
def test_a_strategy_setting_the_checks_cannot_keep_is_one_line_naming_where_it_belongs(strategy, config, line):
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddp_conformance.trainers.lightning_adapter import merged_ddp_kwargs

    given = {"find": DDPStrategy(find_unused_parameters=True), "fsdp": "fsdp",
             "hook": DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)}[strategy]
    with pytest.raises(ValueError) as caught:
        merged_ddp_kwargs(given, config)
    assert str(caught.value) == line


@pytest.mark.parametrize("first", ["fit", "make_dataset", "make_model"])
def test_a_fit_builds_the_module_once_and_reads_the_strategy_off_that_build(tmp_path, first):
    """The DDP kwargs come from the factory's Trainer arguments; reading them off a build of their own cost a
    second initialisation of the model per adapter (0.1-0.2 s for Lightning's demo transformer), whichever
    of its builds comes first: a fit's, the probe fit's that reads the train loader, or make_model's."""
    from lightning.pytorch.strategies import DDPStrategy

    builds = []

    def factory():
        builds.append(1)
        return Tiny(), None, {"strategy": DDPStrategy(find_unused_parameters=True)}

    class Stop(Exception):
        pass

    lit, _ = adapter(tmp_path, {})
    lit.parts = replace(lit.parts, factory=factory)

    def make_trainer(built, callbacks, **run):
        assert lit.strategy()._ddp_kwargs == {"find_unused_parameters": True}
        raise Stop

    lit.make_trainer = make_trainer
    if first == "make_model":
        lit.make_model()
        assert lit.ddp_kwargs() == {"find_unused_parameters": True}
    else:
        with pytest.raises(Stop):
            lit.fit(1) if first == "fit" else lit.make_dataset()
    assert len(builds) == 1


def test_in_a_world_of_one_the_strategy_s_one_device_is_the_rank_s_own_gpu(tmp_path):
    """A check's single-process reference runs on every rank as rank 0 of 1: its one device must be the GPU
    that rank trains on (rank 1's cuda:1), not cuda:0, where a step reading the strategy's root device would
    put its tensors. Read without touching a GPU."""
    lit = LightningAdapter(LightningParts(spec="lightning:t.py:make", label="make", factory=lambda: Tiny()))
    lit.setup(RunConfig(), RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cuda:1",
                                       workdir=tmp_path))
    assert lit.parallel_devices() == [torch.device("cuda", 1)]
