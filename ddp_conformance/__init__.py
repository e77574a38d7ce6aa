"""Both processes: ddp-conformance: checks that PyTorch DDP training is correct, on real process groups, under pytest.

What a user's code imports is here (`__all__`): the adapter interface a class trainer implements, and the pieces
that make a resume faithful. Importing this package must stay cheap: the plugin is loaded into every pytest
session of a user's repo, so a name is imported from its module when first asked for (PEP 562), and torch and
lightning load only when a name that needs them is used, or a distributed test or the suite runs.
`ResumableDataLoader` here is the plain torch one, for a hand-written loop; a LightningModule's
`train_dataloader` returns `ddp_conformance.lightning.ResumableDataLoader`, which counts the batch Lightning's fit
loop reads ahead of an unsized loader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: each public name and the module that defines it
_HOMES = {
    "TrainerAdapter": "adapter", "NotProvided": "adapter", "TrainerBuildError": "adapter", "TrainState": "adapter",
    "StepInfo": "adapter", "FitObserver": "adapter", "RankContext": "adapter",
    "ResumableDataLoader": "resumable", "capture_rng_state": "resumable", "restore_rng_state": "resumable",
    "gather_rng_states": "resumable", "rng_state_for_rank": "resumable", "seed_all": "resumable",
    "RNGStateCallback": "lightning",
}
__all__ = ["FitObserver", "NotProvided", "RNGStateCallback", "RankContext", "ResumableDataLoader", "StepInfo",
           "TrainState", "TrainerAdapter", "TrainerBuildError", "capture_rng_state", "gather_rng_states",
           "restore_rng_state", "rng_state_for_rank", "seed_all"]

if TYPE_CHECKING:
    from .adapter import FitObserver, NotProvided, RankContext, StepInfo, TrainerAdapter, TrainerBuildError, TrainState
    from .lightning import RNGStateCallback
    from .resumable import (
        ResumableDataLoader,
        capture_rng_state,
        gather_rng_states,
        restore_rng_state,
        rng_state_for_rank,
        seed_all,
    )


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
