"""Both processes: the run configuration: a Lightning-style YAML (the `trainer:` section DDP guides publish), validated
into frozen dataclasses.

Users already write `trainer: strategy: _target_: lightning.pytorch.strategies.DDPStrategy ...`; a
conformance run reads that same file, so the checks exercise the DDP kwargs people actually ship.
Errors are one line naming the file, the key path and the expected type, because a config typo
must stop the session before any process is spawned. This module never imports torch.

Shape (every key optional; defaults are DDP's and small enough to train in seconds on a CPU):

    seed: 0                       # model init and the RNGs at the start of a fit
    trainer:
      devices, accelerator, num_nodes   # taken from the harness (see `reconcile`)
      strategy: {_target_, gradient_as_bucket_view, bucket_cap_mb, static_graph, find_unused_parameters}
      sync_batchnorm: false
      precision: 32 | "32-true" | "bf16-mixed" | "16-mixed"
      accumulate_grad_batches: 1
    model: {input_dim, hidden, num_classes, dropout, batchnorm}
    data: {size, batch_size, shuffle, drop_last, seed}
    optim: {lr, weight_decay, scheduler: {step_size, gamma}}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DDP_TARGETS = (
    "lightning.pytorch.strategies.DDPStrategy",
    "lightning.pytorch.strategies.ddp.DDPStrategy",
    "pytorch_lightning.strategies.DDPStrategy",
    "pytorch_lightning.strategies.ddp.DDPStrategy",
)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_PRECISION_ALIASES: dict[Any, str] = {32: "32-true", "32": "32-true", "32-true": "32-true",
                                      "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}


class ConfigError(ValueError):
    """A config file that cannot be used; `str()` is one line that starts with the file's path (the
    plugin puts the option it came from in front: `--ddp-config: x.yaml: ...`)."""


@dataclass(frozen=True)
class StrategyConfig:
    """DDP constructor kwargs. None means "not in the file": DDP's own default applies.

    Kept distinct from an explicit value on purpose: `bucket_cap_mb=None` gives DDP's 1 MiB first
    bucket, an explicit 25 does not (torch reducer), so passing defaults would change bucketing.
    """

    target: str = DDP_TARGETS[0]
    gradient_as_bucket_view: bool | None = None
    bucket_cap_mb: float | None = None
    static_graph: bool | None = None
    find_unused_parameters: bool | None = None

    def ddp_kwargs(self) -> dict[str, Any]:
        """The kwargs for `DistributedDataParallel(...)` / `DDPStrategy(...)`: only keys the file set."""
        names = ("gradient_as_bucket_view", "bucket_cap_mb", "static_graph", "find_unused_parameters")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass(frozen=True)
class TrainerConfig:
    devices: int | str | list[int] = "auto"
    accelerator: str = "auto"
    num_nodes: int = 1
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    sync_batchnorm: bool = False
    precision: str = "32-true"
    accumulate_grad_batches: int = 1


@dataclass(frozen=True)
class ModelConfig:
    """An MLP classifier: Linear -> [BatchNorm] -> ReLU -> [Dropout] per hidden layer."""

    input_dim: int = 16
    hidden: tuple[int, ...] = (32, 32)
    num_classes: int = 4
    dropout: float = 0.0
    batchnorm: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Synthetic classification data; `batch_size` is per rank, `drop_last` is DistributedSampler's."""

    size: int = 64
    batch_size: int = 4
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    """StepLR, stepped once per optimizer step."""

    step_size: int = 8
    gamma: float = 0.5


@dataclass(frozen=True)
class OptimConfig:
    """AdamW."""

    lr: float = 0.05
    weight_decay: float = 0.01
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    source: str | None = None  # the file it came from, for messages; None means built-in defaults


# ---------------------------------------------------------------------------------------------------
# Loading


class _Loader:
    """Walks the parsed YAML, converting each value or raising one ConfigError with its key path."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {path or '(top level)'}: {message}")

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"expected a mapping, got {_show(value)}")
        for key in value:
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                raise self.fail(where, f"unknown key (expected one of: {', '.join(allowed)})")
        return value

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected a boolean (true/false), got {_show(value)}")
        return value

    def integer(self, value: Any, path: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {_show(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"expected an integer >= {minimum}, got {value}")
        return value

    def number(self, value: Any, path: str, minimum: float | None = None, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"expected a number, got {_show(value)}")
        if positive and not value > 0:
            raise self.fail(path, f"expected a number > 0, got {value}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"expected a number >= {minimum}, got {value}")
        return float(value)

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {_show(value)}")
        return value

    # --- sections -----------------------------------------------------------------------------

    def run(self, raw: Any) -> RunConfig:
        top = self.mapping(raw, "", ("seed", "trainer", "model", "data", "optim"))
        out = RunConfig(source=self.where)
        if "seed" in top:
            out = replace(out, seed=self.integer(top["seed"], "seed"))
        return replace(
            out,
            trainer=self.trainer(top.get("trainer"), "trainer"),
            model=self.model(top.get("model"), "model"),
            data=self.data(top.get("data"), "data"),
            optim=self.optim(top.get("optim"), "optim"),
        )

    def strategy(self, raw: Any, path: str) -> StrategyConfig:
        if raw == "ddp":
            return StrategyConfig()
        if isinstance(raw, str):
            raise self.fail(path, f"expected a DDPStrategy mapping or 'ddp', got {raw!r}")
        section = self.mapping(raw, path, _names(StrategyConfig, target="_target_"))
        kwargs: dict[str, Any] = {}
        if "_target_" in section:
            target = self.string(section["_target_"], f"{path}._target_")
            if target not in DDP_TARGETS:
                raise self.fail(f"{path}._target_", f"expected {DDP_TARGETS[0]}, got {target!r}")
            kwargs["target"] = target
        for name in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters"):
            if name in section:
                kwargs[name] = self.boolean(section[name], f"{path}.{name}")
        if "bucket_cap_mb" in section:
            kwargs["bucket_cap_mb"] = self.number(section["bucket_cap_mb"], f"{path}.bucket_cap_mb",
                                                  positive=True)
        return StrategyConfig(**kwargs)

    def trainer(self, raw: Any, path: str) -> TrainerConfig:
        section = self.mapping(raw, path, _names(TrainerConfig))
        kwargs: dict[str, Any] = {}
        if "devices" in section:
            kwargs["devices"] = self.devices(section["devices"], f"{path}.devices")
        if "accelerator" in section:
            kwargs["accelerator"] = self.string(section["accelerator"], f"{path}.accelerator")
        if "num_nodes" in section:
            kwargs["num_nodes"] = self.integer(section["num_nodes"], f"{path}.num_nodes", minimum=1)
        if "strategy" in section:
            kwargs["strategy"] = self.strategy(section["strategy"], f"{path}.strategy")
        if "sync_batchnorm" in section:
            kwargs["sync_batchnorm"] = self.boolean(section["sync_batchnorm"], f"{path}.sync_batchnorm")
        if "precision" in section:
            value = section["precision"]
            if isinstance(value, bool) or value not in _PRECISION_ALIASES:
                raise self.fail(f"{path}.precision",
                                f"expected one of 32, '32-true', 'bf16-mixed', '16-mixed', got {_show(value)}")
            kwargs["precision"] = _PRECISION_ALIASES[value]
        if "accumulate_grad_batches" in section:
            kwargs["accumulate_grad_batches"] = self.integer(
                section["accumulate_grad_batches"], f"{path}.accumulate_grad_batches", minimum=1)
        return TrainerConfig(**kwargs)

    def devices(self, value: Any, path: str) -> int | str | list[int]:
        if isinstance(value, str) and value == "auto":
            return value
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
        if isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1):
            return value
        raise self.fail(path, f"expected an integer >= 1, -1, 'auto' or a list of integers, got {_show(value)}")

    def model(self, raw: Any, path: str) -> ModelConfig:
        section = self.mapping(raw, path, _names(ModelConfig))
        kwargs: dict[str, Any] = {}
        for name in ("input_dim", "num_classes"):
            if name in section:
                kwargs[name] = self.integer(section[name], f"{path}.{name}", minimum=1)
        if "hidden" in section:
            value = section["hidden"]
            if not isinstance(value, list):
                raise self.fail(f"{path}.hidden", f"expected a list of integers, got {_show(value)}")
            kwargs["hidden"] = tuple(self.integer(v, f"{path}.hidden[{i}]", minimum=1)
                                     for i, v in enumerate(value))
        if "dropout" in section:
            kwargs["dropout"] = self.number(section["dropout"], f"{path}.dropout", minimum=0.0)
            if kwargs["dropout"] >= 1:
                raise self.fail(f"{path}.dropout", f"expected a number in [0, 1), got {kwargs['dropout']}")
        if "batchnorm" in section:
            kwargs["batchnorm"] = self.boolean(section["batchnorm"], f"{path}.batchnorm")
        return ModelConfig(**kwargs)

    def data(self, raw: Any, path: str) -> DataConfig:
        section = self.mapping(raw, path, _names(DataConfig))
        kwargs: dict[str, Any] = {}
        for name, minimum in (("size", 1), ("batch_size", 1), ("seed", None)):
            if name in section:
                kwargs[name] = self.integer(section[name], f"{path}.{name}", minimum=minimum)
        for name in ("shuffle", "drop_last"):
            if name in section:
                kwargs[name] = self.boolean(section[name], f"{path}.{name}")
        return DataConfig(**kwargs)

    def optim(self, raw: Any, path: str) -> OptimConfig:
        section = self.mapping(raw, path, _names(OptimConfig))
        kwargs: dict[str, Any] = {}
        if "lr" in section:
            kwargs["lr"] = self.number(section["lr"], f"{path}.lr", positive=True)
        if "weight_decay" in section:
            kwargs["weight_decay"] = self.number(section["weight_decay"], f"{path}.weight_decay", minimum=0.0)
        if "scheduler" in section:
            spath = f"{path}.scheduler"
            sched = self.mapping(section["scheduler"], spath, _names(SchedulerConfig))
            skw: dict[str, Any] = {}
            if "step_size" in sched:
                skw["step_size"] = self.integer(sched["step_size"], f"{spath}.step_size", minimum=1)
            if "gamma" in sched:
                skw["gamma"] = self.number(sched["gamma"], f"{spath}.gamma", positive=True)
            kwargs["scheduler"] = SchedulerConfig(**skw)
        return OptimConfig(**kwargs)


def _names(cls: type, **renamed: str) -> tuple[str, ...]:
    return tuple(renamed.get(f.name, f.name) for f in fields(cls))


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return repr(value)


def _yaml_loader() -> type:
    """SafeLoader that also reads `1e-4` as a float (YAML 1.2), as DDP guides write learning rates.

    PyYAML follows YAML 1.1, where a float needs a dot, so `lr: 1e-4` would arrive as a string.
    """
    import yaml  # deferred: yaml is heavy to import

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return Loader


def load_config(path: str | Path | None) -> RunConfig:
    """Read a config file; None gives the built-in defaults. Raises ConfigError with one line."""
    if path is None:
        return RunConfig()
    import yaml  # deferred: yaml is heavy to import

    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the file: {exc.strerror or exc}") from None
    try:
        raw = yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from None
    return _Loader(where).run(raw)


# ---------------------------------------------------------------------------------------------------
# Reconciling with the harness


def reconcile(
    config: RunConfig, *, world_size: int, backend: str, device_type: str, num_nodes: int = 1
) -> tuple[RunConfig, list[str]]:
    """Make the config fit the process group the harness started; return it and one note per change.

    The harness, not the file, decides how many processes exist and on what device: a guide's
    `devices: -1, accelerator: gpu` on a CPU runner must still be checked, just on what is there.
    `sync_batchnorm` on CPU falls back to plain BatchNorm because torch refuses SyncBatchNorm in CPU
    modules ("SyncBatchNorm layers only work with GPU modules"); the note says it was not exercised.
    `16-mixed` on CPU becomes `bf16-mixed`, as Lightning does, so both references train alike.
    """
    trainer = config.trainer
    notes: list[str] = []
    devices = world_size // num_nodes
    accelerator = "gpu" if device_type == "cuda" else "cpu"
    if trainer.devices != devices:
        notes.append(f"trainer.devices: {trainer.devices!r} replaced by {devices} "
                     f"(the harness runs {world_size} rank(s) on {num_nodes} node(s))")
    if trainer.accelerator != accelerator:
        notes.append(f"trainer.accelerator: {trainer.accelerator!r} replaced by {accelerator!r} "
                     f"(the harness uses backend {backend} on {device_type})")
    if trainer.num_nodes != num_nodes:
        notes.append(f"trainer.num_nodes: {trainer.num_nodes} replaced by {num_nodes} (from the harness)")
    sync_batchnorm = trainer.sync_batchnorm
    if sync_batchnorm and device_type != "cuda":
        sync_batchnorm = False
        notes.append("trainer.sync_batchnorm: true, but SyncBatchNorm only works with GPU modules; plain "
                     "BatchNorm was used on CPU, so SyncBatchNorm was not exercised")
    precision = trainer.precision
    if precision == "16-mixed" and device_type != "cuda":
        precision = "bf16-mixed"
        notes.append("trainer.precision: '16-mixed' replaced by 'bf16-mixed' (fp16 AMP is not supported on "
                     "CPU; Lightning makes the same substitution)")
    trainer = replace(trainer, devices=devices, accelerator=accelerator, num_nodes=num_nodes,
                      sync_batchnorm=sync_batchnorm, precision=precision)
    return replace(config, trainer=trainer), notes
