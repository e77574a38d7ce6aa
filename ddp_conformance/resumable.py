"""What a resume needs that a plain torch/Lightning setup loses: the data position and the RNG states.

Public, torch-only pieces (no Lightning import), used by both references and offered to users:
- `ResumableDataLoader`: a drop-in `DataLoader` with `state_dict`/`load_state_dict`, so a resume in
  the middle of an epoch continues with the next batch instead of replaying the epoch. Lightning
  (>= 2.2) saves and restores the state of any train loader that has this pair (its fit loop keeps
  `state_dict()` of every stateful loader in the checkpoint), so in a Lightning project swapping
  `DataLoader(` for `ddp_conformance.lightning.ResumableDataLoader(` is the whole change (that one
  also counts out the batch Lightning reads ahead of training); a hand-written loop calls the pair
  itself.
- RNG state helpers (`capture_rng_state`, `restore_rng_state`, `gather_rng_states`,
  `rng_state_for_rank`), weights_only-safe: `torch.load`'s default since 2.6 rejects numpy arrays.
  `ddp_conformance.lightning.RNGStateCallback` puts them into Lightning checkpoints.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

__all__ = ["ResumableDataLoader", "capture_rng_state", "gather_rng_states", "restore_rng_state",
           "rng_state_for_rank", "seed_all"]


_GENERATOR_POSITION = 12  # DataLoader(dataset, batch_size, ..., multiprocessing_context, generator, *, ...)


class ResumableDataLoader(DataLoader):
    """A DataLoader that resumes in the middle of an epoch: same arguments as `DataLoader`.

    `state_dict()` holds the epoch, the batches yielded in it (`position`) and the state of the
    loader's own random generator; after `load_state_dict`, the next iteration *of that epoch*
    skips what was already consumed, and a later epoch draws what it would have drawn.

    - The epoch is read from the sampler (`sampler.epoch`, which `DistributedSampler.set_epoch`
      sets) when the first batch is requested, because Lightning calls `set_epoch` after `iter()`.
    - Without a `generator` argument the loader makes its own, seeded from `torch.initial_seed()`
      (what `seed_everything` set): a plain DataLoader instead draws each epoch's worker base seed
      from the global RNG, which shifts the training RNG stream by one draw per epoch at points a
      resume cannot reproduce (an epoch that starts before the checkpoint is captured, after it is
      restored). Its state at the start of the epoch is saved, so a resumed epoch gets the same
      worker seeds (same random augmentation in workers) and a resumed shuffle the same order.
    - Skipped batches are fetched and discarded: cheap for in-memory data, one pass over the
      consumed part of the epoch otherwise.
    - The position is the batches the loop has trained: those yielded, less `read_ahead()` that a
      loop fetches before it trains them (none in a plain `for batch in loader`; see
      `ddp_conformance.lightning.ResumableDataLoader` for Lightning's fit loop). An epoch read to its
      end is saved as finished, so a resume starts the next one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("generator") is None and len(args) <= _GENERATOR_POSITION:
            kwargs["generator"] = torch.Generator().manual_seed(torch.initial_seed())
        super().__init__(*args, **kwargs)
        self._pending: dict[str, Any] | None = None
        self._epoch = 0
        self._position = 0
        self._exhausted = False  # the current epoch's iterator has yielded its last batch
        self._epoch_start = self.generator.get_state() if self.generator is not None else None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._resumable_iter()

    def _resumable_iter(self) -> Iterator[Any]:
        epoch = self._current_epoch()
        skip = self._apply_pending(epoch)
        self._epoch, self._position, self._exhausted = epoch, 0, False
        if self.generator is not None:
            self._epoch_start = self.generator.get_state()
        for index, batch in enumerate(super().__iter__()):
            if index < skip:
                continue
            self._position = index + 1
            yield batch
        self._exhausted = True

    def read_ahead(self) -> int:
        """Batches yielded that the loop has not trained yet when it saves a checkpoint: none in a
        loop that trains each batch as it gets it."""
        return 0

    def _current_epoch(self) -> int:
        """The sampler's epoch (DistributedSampler.set_epoch), else the dataset's (an IterableDataset
        that shards itself), else unknown: then a pending state is for the epoch about to start,
        since nothing can say otherwise (a sampler without set_epoch resumes its position too)."""
        for owner in (self.sampler, self.dataset):
            if hasattr(owner, "epoch"):
                return int(owner.epoch)
        if self._pending is not None:
            return int(self._pending.get("epoch", self._epoch))
        return self._epoch

    def _apply_pending(self, epoch: int) -> int:
        """Restore the saved generator state; the number of batches of this epoch to skip."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0
        finished = bool(pending.get("finished")) or self._finished(int(pending.get("position", 0)))
        same_epoch = pending.get("epoch") == epoch and not finished
        state = pending.get("epoch_generator" if same_epoch else "generator")
        if state is not None and self.generator is not None:
            self.generator.set_state(state)
        return int(pending.get("position", 0)) if same_epoch else 0

    def _finished(self, position: int) -> bool:
        """Whether `position` batches are a whole epoch (then a resume starts the next one)."""
        try:
            return position >= len(self)
        except TypeError:  # an IterableDataset without __len__: only the position is known
            return False

    def state_dict(self) -> dict[str, Any]:
        trained = self._position if self._exhausted else max(0, self._position - self.read_ahead())
        state: dict[str, Any] = {"epoch": self._epoch, "position": trained, "finished": self._exhausted}
        if self.generator is not None and self._epoch_start is not None:
            state["epoch_generator"] = self._epoch_start.clone()
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)


# ---------------------------------------------------------------------------------------------------
# RNG state


def installed_numpy() -> ModuleType | None:
    """numpy where it is installed: torch does not require it, and a process without it has no numpy RNG
    to carry across a resume."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def seed_all(seed: int) -> None:
    """Seed torch, numpy (where installed) and python alike (what Lightning's seed_everything does)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np = installed_numpy()
    if np is not None:
        np.random.seed(seed)


def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy (where installed) and python RNG states, as tensors/ints/tuples."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np = installed_numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state["numpy"] = {"name": name, "keys": torch.tensor([int(k) for k in keys], dtype=torch.int64),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned (possibly after a weights_only round trip)."""
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(_as_python_state(state["python"]))
    numpy_state, np = state.get("numpy"), installed_numpy()
    if numpy_state is not None and np is not None:
        keys = np.asarray(numpy_state["keys"].cpu().tolist(), dtype=np.uint32)
        np.random.set_state((numpy_state["name"], keys, numpy_state["pos"], numpy_state["has_gauss"],
                             numpy_state["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([part.cpu() for part in state["cuda"]])


def _as_python_state(value: Any) -> Any:
    """random.setstate needs tuples; a round trip through some serialisers gives lists."""
    if isinstance(value, list):
        return tuple(_as_python_state(v) for v in value)
    return value


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (collective). Ranks can draw different random numbers
    (per-rank seeds, uneven work), so rank 0's state alone would not resume rank 1 exactly."""
    mine = capture_rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def rng_state_for_rank(states: list[dict[str, Any]] | dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's entry; exact only when resuming on the world size that saved it."""
    if isinstance(states, dict):
        return states
    return states[rank] if rank < len(states) else states[0]
