"""Both processes: what a `lightning:` SPEC names, shared by the SPEC module (which builds it in the pytest process and
in every rank) and the Lightning adapter (which builds the run from it); imports no Lightning."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LightningParts:
    """What a `lightning:` SPEC names: zero-argument builders of the module and datamodule, or one
    factory returning the module, `(module, datamodule)` or `(module, datamodule, trainer_kwargs)`."""

    spec: str
    label: str
    module: Callable[[], Any] | None = None
    datamodule: Callable[[], Any] | None = None
    factory: Callable[[], Any] | None = None
