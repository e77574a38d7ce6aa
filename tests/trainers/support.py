"""Helpers for the trainer tests: configs reconciled for the running rank, state comparisons."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ddp_conformance.adapter import RankContext, TrainerAdapter, TrainState
from ddp_conformance.checks.support.model_state import flat
from ddp_conformance.config import RunConfig, load_config, reconcile

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "fixtures" / "configs"
CONFIG_FILES = sorted(p.name for p in CONFIGS.glob("*.yaml"))


def trainer(name: str) -> type[TrainerAdapter]:
    """A reference trainer class by its built-in name, imported only inside the rank that uses it."""
    if name == "torch":
        from ddp_conformance.trainers.torch_ref import TorchTrainer

        return TorchTrainer
    from ddp_conformance.trainers.lightning_ref import LightningTrainer

    return LightningTrainer


def run_config(ctx: RankContext, path: str | Path | None = None, **sections: dict[str, Any]) -> RunConfig:
    """A config file (or the defaults) with some sections' fields replaced, reconciled for ctx."""
    config = load_config(path)
    for section, changes in sections.items():
        config = replace(config, **{section: replace(getattr(config, section), **changes)})
    config, _ = reconcile(config, world_size=ctx.world_size, backend=ctx.backend, device_type=ctx.device_type)
    return config


def make(cls: type[TrainerAdapter], config: RunConfig, ctx: RankContext) -> Any:
    adapter = cls()
    adapter.setup(config, ctx)
    return adapter


def differences(a: TrainState, b: TrainState) -> list[str]:
    """Every way two final states differ, bit for bit: parameters, optimizer, scheduler, counters."""
    import torch

    found = []
    for part in ("params", "optimizer", "scheduler"):
        left, right = flat(getattr(a, part)), flat(getattr(b, part))
        if left.keys() != right.keys():
            found.append(f"{part}: keys differ: {sorted(left.keys() ^ right.keys())[:5]}")
            continue
        for key, x in left.items():
            y = right[key]
            if isinstance(x, torch.Tensor):
                if not torch.equal(x, y):
                    delta = (x.double() - y.double()).abs().max().item()
                    found.append(f"{part}.{key}: max |delta| {delta:.3g}")
            elif x != y:
                found.append(f"{part}.{key}: {x!r} != {y!r}")
    if a.counters != b.counters:
        found.append(f"counters: {a.counters} != {b.counters}")
    return found
