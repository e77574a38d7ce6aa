"""The two pieces that make a Lightning resume faithful, one line each in your project.

Lightning 2.x checkpoints hold the model, optimizers, schedulers, loops and callback states, but no
RNG state, and a plain DataLoader cannot continue an epoch in the middle: a resumed run draws other
dropout masks and random augmentations, and replays the epoch's first batches (Lightning warns, then
trains them twice and skips the rest). `resume_fidelity` names both; these are the remedies:

    from ddp_conformance.lightning import RNGStateCallback, ResumableDataLoader

    trainer = Trainer(..., callbacks=[RNGStateCallback()])      # or return it from configure_callbacks
    return ResumableDataLoader(dataset, batch_size=32, shuffle=True)   # in train_dataloader()

Both use Lightning's public mechanisms: a Callback's `state_dict`/`load_state_dict` (kept in the
checkpoint under `callbacks`) and the stateful-dataloader protocol of the fit loop (any train loader
with `state_dict`/`load_state_dict` is saved in the checkpoint and restored before the epoch goes on).
Lightning keeps the loader's class when it injects its DistributedSampler, so the loader stays
resumable under DDP. Importing this module imports Lightning; `import ddp_conformance` does not.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from .resumable import ResumableDataLoader as _LoopResumableDataLoader
from .resumable import gather_rng_states, restore_rng_state, rng_state_for_rank

__all__ = ["RNGStateCallback", "ResumableDataLoader"]


class ResumableDataLoader(_LoopResumableDataLoader):
    """`ddp_conformance.resumable.ResumableDataLoader` for Lightning's fit loop, which fetches one
    batch ahead of the one it trains where it cannot know the epoch's length (a loader with no
    `__len__`: an IterableDataset), to know which batch is the last. A checkpoint written after batch
    k then finds k + 1 yielded; that one is not trained, so the saved position leaves it out, and the
    resumed fit trains it. A loader with a length is not read ahead. (A fit that caps an unsized loader
    with an integer `limit_train_batches`, or a `training_step` taking `dataloader_iter`, is not read
    ahead either: use `ddp_conformance.resumable.ResumableDataLoader` there.)"""

    def read_ahead(self) -> int:
        try:
            len(self)
        except TypeError:  # no length: Lightning's _PrefetchDataFetcher holds one batch
            return LIGHTNING_PREFETCH
        return 0


#: batches Lightning's fit loop fetches ahead of training from a loader with no length
#: (`_PrefetchDataFetcher(prefetch_batches=1)`, chosen by `_select_data_fetcher`)
LIGHTNING_PREFETCH = 1


class RNGStateCallback(pl.Callback):
    """Saves every rank's torch (CPU and CUDA), numpy and python RNG state in each checkpoint and
    restores this rank's right before the first training batch after `fit(ckpt_path=...)`.

    Every rank's state, not rank 0's: ranks draw different numbers (per-rank seeds, dropout on
    different data), so rank 0's state would resume rank 1 on rank 0's stream. Saving is collective
    (an all-gather), which is safe because Lightning builds a checkpoint on every rank and only rank 0
    writes it. Restoring waits for the first batch because that is where the state was taken (after
    a batch, before the next one): anything drawn while setting up the resumed fit is not replayed.
    """

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] | dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict["ranks"]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._pending is not None:
            restore_rng_state(rng_state_for_rank(self._pending, trainer.global_rank))
            self._pending = None
