"""The YAML config: the Lightning-style shape loads, every mistake is one line naming key path and type."""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest

from ddp_conformance.config import ConfigError, RunConfig, StrategyConfig, load_config, reconcile
from tests.trainers.support import CONFIG_FILES, CONFIGS


def write(tmp_path, text: str, name: str = "basic.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error(tmp_path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_none_gives_the_defaults():
    config = load_config(None)
    assert config == RunConfig()
    assert config.trainer.strategy.ddp_kwargs() == {}  # DDP's own defaults, nothing forced


def test_fixture_configs_are_the_guides():
    assert set(CONFIG_FILES) >= {"basic.yaml", "advanced.yaml", "bucket_small.yaml", "bucket_medium.yaml",
                                 "bucket_large.yaml"}
    basic = load_config(CONFIGS / "basic.yaml")
    assert basic.trainer.strategy.ddp_kwargs() == {"gradient_as_bucket_view": True, "static_graph": False}
    assert basic.trainer.sync_batchnorm and basic.trainer.devices == -1 and basic.trainer.accelerator == "gpu"
    advanced = load_config(CONFIGS / "advanced.yaml")
    assert advanced.trainer.precision == "bf16-mixed" and advanced.trainer.accumulate_grad_batches == 1
    for name, cap in (("small", 25), ("medium", 50), ("large", 100)):
        assert load_config(CONFIGS / f"bucket_{name}.yaml").trainer.strategy.bucket_cap_mb == cap
    for name in CONFIG_FILES:
        head = (CONFIGS / name).read_text().splitlines()[0]  # each config says where it comes from
        assert head.startswith(("# A DDP performance guide's", "# A DDP bucket guide's", "# Not from a guide")), head


def test_seed_snippets_load_verbatim(tmp_path):
    """The trainer blocks exactly as the seed documents print them (comments included)."""
    config = load_config(write(tmp_path, """
        trainer:
          devices: -1  # all GPUs
          accelerator: gpu
          strategy:
            _target_: lightning.pytorch.strategies.DDPStrategy
            gradient_as_bucket_view: true
            bucket_cap_mb: 25  # adjust to the model size
            static_graph: false
        """))
    assert config.trainer.strategy == StrategyConfig(gradient_as_bucket_view=True, bucket_cap_mb=25.0,
                                                     static_graph=False)


def test_values_and_aliases(tmp_path):
    config = load_config(write(tmp_path, """
        seed: 3
        trainer:
          precision: 32
          strategy: ddp
        model: {hidden: [8, 8, 8], dropout: 0.5, batchnorm: true}
        data: {size: 10, batch_size: 2, shuffle: false, drop_last: true, seed: 5}
        optim: {lr: 1e-4, weight_decay: 0, scheduler: {step_size: 3, gamma: 0.1}}
        """))
    assert config.seed == 3 and config.trainer.precision == "32-true"
    assert config.model.hidden == (8, 8, 8) and config.data.drop_last
    assert config.optim.lr == pytest.approx(1e-4)  # YAML 1.1 would have read "1e-4" as a string
    assert config.source and config.source.endswith("basic.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer:\n  strategy:\n    bucket_cap_mb: big\n",
         "trainer.strategy.bucket_cap_mb: expected a number, got 'big'"),
        ("trainer:\n  strategy:\n    bucket_size: 25\n",
         "trainer.strategy.bucket_size: unknown key (expected one of: _target_, gradient_as_bucket_view,"),
        ("trainr:\n  devices: 1\n", "trainr: unknown key (expected one of: seed, trainer, model, data, optim)"),
        ("trainer:\n  strategy:\n    gradient_as_bucket_view: yes please\n",
         "trainer.strategy.gradient_as_bucket_view: expected a boolean (true/false), got 'yes please'"),
        ("trainer:\n  accumulate_grad_batches: 1.5\n",
         "trainer.accumulate_grad_batches: expected an integer, got 1.5"),
        ("trainer:\n  accumulate_grad_batches: true\n",
         "trainer.accumulate_grad_batches: expected an integer, got True"),
        ("trainer:\n  accumulate_grad_batches: 0\n",
         "trainer.accumulate_grad_batches: expected an integer >= 1, got 0"),
        ("trainer:\n  precision: fp8\n",
         "trainer.precision: expected one of 32, '32-true', 'bf16-mixed', '16-mixed', got 'fp8'"),
        ("trainer:\n  strategy:\n    _target_: lightning.pytorch.strategies.FSDPStrategy\n",
         "trainer.strategy._target_: expected lightning.pytorch.strategies.DDPStrategy, got"),
        ("trainer:\n  strategy: fsdp\n", "trainer.strategy: expected a DDPStrategy mapping or 'ddp', got 'fsdp'"),
        ("trainer:\n  devices: many\n", "trainer.devices: expected an integer >= 1, -1, 'auto'"),
        ("trainer: [1, 2]\n", "trainer: expected a mapping, got a list"),
        ("model:\n  hidden: [8, x]\n", "model.hidden[1]: expected an integer, got 'x'"),
        ("model:\n  dropout: 1.0\n", "model.dropout: expected a number in [0, 1), got 1.0"),
        ("optim:\n  lr: '1e-3'\n", "optim.lr: expected a number, got '1e-3'"),
        ("optim:\n  scheduler:\n    gamma: -1\n", "optim.scheduler.gamma: expected a number > 0, got -1"),
        ("- 1\n- 2\n", "(top level): expected a mapping, got a list"),
    ],
)
def test_errors_name_the_key_path_and_the_expected_type(tmp_path, text, expected):
    message = error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'basic.yaml'}: ")
    assert expected in message


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^\S*nope\.yaml: cannot read the file: No such file"):
        load_config(tmp_path / "nope.yaml")
    message = error(tmp_path, "trainer:\n  strategy: [unclosed\n")
    assert "invalid YAML at line" in message


def test_reconcile_takes_devices_from_the_harness_and_says_so():
    config = load_config(CONFIGS / "basic.yaml")
    cpu, notes = reconcile(config, world_size=4, backend="gloo", device_type="cpu")
    assert (cpu.trainer.devices, cpu.trainer.accelerator, cpu.trainer.num_nodes) == (4, "cpu", 1)
    assert not cpu.trainer.sync_batchnorm
    assert any(n.startswith("trainer.devices: -1 replaced by 4") for n in notes)
    assert any(n.startswith("trainer.accelerator: 'gpu' replaced by 'cpu'") for n in notes)
    assert any("SyncBatchNorm was not exercised" in n for n in notes)
    assert all("\n" not in n for n in notes)

    gpu, notes = reconcile(config, world_size=4, backend="nccl", device_type="cuda", num_nodes=2)
    assert (gpu.trainer.devices, gpu.trainer.accelerator, gpu.trainer.num_nodes) == (2, "gpu", 2)
    assert gpu.trainer.sync_batchnorm
    assert not any("SyncBatchNorm" in n for n in notes)

    fp16 = replace(config, trainer=replace(config.trainer, precision="16-mixed"))
    assert reconcile(fp16, world_size=2, backend="gloo", device_type="cpu")[0].trainer.precision == "bf16-mixed"
    assert reconcile(fp16, world_size=2, backend="nccl", device_type="cuda")[0].trainer.precision == "16-mixed"

    same, notes = reconcile(RunConfig(), world_size=1, backend="gloo", device_type="cpu")
    again, more = reconcile(same, world_size=1, backend="gloo", device_type="cpu")
    assert again == same and more == []


def test_config_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, ddp_conformance.config as c; c.load_config(None); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
