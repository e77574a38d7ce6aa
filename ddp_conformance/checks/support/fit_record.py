"""What one fit did on this rank, as `observe.FitRecorder` saw it: the record and its parts.

Plain values and the objects the fit used (its model, optimizers, datasets), read by the checks in the
rank's process; `FitRecord.summary` is what crosses ranks. What a check's own watchers saw is theirs
(`FitRecord.watched`, `fit_watch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from .amp_watch import AmpRecord
from .digests import input_digest
from .replica_watch import ReplicaTrail

DIGESTED_INPUTS = 256  # a loader pass's micro-batch inputs are digested up to this many
Watcher = TypeVar("Watcher")


@dataclass
class LoaderPass:
    """One `iter()` of a DataLoader: its length, dataset size, sampler and the index batches drawn.

    `trained` says whether a training forward of a DDP model ran while this pass was the newest
    one, which separates the training loader's passes from validation or sanity-check passes."""

    length: int | None
    dataset_size: int | None
    sampler: str
    shuffle: bool | None
    replacement: bool | None = None  # the sampler draws with replacement (RandomSampler, WeightedRandomSampler)
    iterable: bool = False  # an IterableDataset: no indices, the dataset decides what each rank reads
    batches: list[list[int]] = field(default_factory=list)
    indexed: bool = False  # batches came from a batch sampler as lists of ints, so they are dataset indices
    tail: int = 0  # samples a BatchSampler(drop_last=True) leaves out at the end of each epoch's share
    share: int | None = None  # samples each rank draws an epoch where a shard pads whole batches itself
    # a loader over a Subset (a rank's own shard, a curriculum stage, a random_split): `batches` are the
    # Subset's own indices; `index_map` maps them to the underlying dataset's (`base_size` samples),
    # and `universe` (sorted) is the part of it the Subset holds
    base_size: int | None = None
    universe: list[int] | None = None
    index_map: list[int] | None = field(default=None, repr=False)
    # the batch samplers wrapping the loader's own, outermost first (accelerate's "BatchSamplerShard (process 1 of
    # 2) over BatchSampler"), whose batches are the ones recorded; None where none wraps it (`loader_wrappers`)
    wrappers: str | None = None
    # the loader is read by a wrapper that takes every rank's batches on one process and sends each its slice
    # (accelerate's dispatch_batches): what a rank's own DataLoader draws is not what it trains
    dispatched: bool = False

    def base_batches(self) -> list[list[int]]:
        """The batches as indices of the dataset under any Subsets."""
        return [[base_index(self.index_map, i) for i in batch] for batch in self.batches]
    trained: bool = False
    # with `draws`: the indices of each batch the pass yielded to the loop (what it trains, read-ahead included;
    # batches a resumed loader skips are drawn from its sampler but never yielded), None where they cannot be read
    yielded: list[list[int] | None] = field(default_factory=list)
    inputs: list[str | None] = field(default_factory=list)  # digests of its training micro-batches' inputs
    # (`fed_digest`): the first, and without indices the first DIGESTED_INPUTS: what each rank was fed
    # the loader's dataset itself: data_consistency reads it by index when the trainer cannot build it
    # on its own (a script); never gathered across ranks
    dataset: Any = field(default=None, repr=False)

    @property
    def first_input(self) -> str | None:
        return self.inputs[0] if self.inputs else None


class RngMark(NamedTuple):
    """torch's CPU RNG state as a micro-batch began: what a resumed run must start from to draw what the
    uninterrupted run drew there."""

    steps: int  # optimizer steps taken before this micro-batch
    rng: str  # a digest of the RNG state at its forward
    loader_drew: bool  # a DataLoader drew its own seeds since the micro-batch before it (or since the fit began)


@dataclass
class FirstStep:
    """The fit's first optimizer step as the optimizer got it, in `model.parameters()` order of the
    model the micro-batches ran through (unwrapped): enough to recompute that step in one process."""

    params: list[Any]  # CPU copies, before the first micro-batch
    grads: list[Any] | None = None  # float64 CPU copies of the gradients the first step applied
    micro_batches: int = 0  # micro-batches that went into them
    rng_drawn: bool = False  # torch's CPU or CUDA RNG advanced during them (dropout, random augmentation...)
    # optimizer steps a GradScaler skipped before it (their scaled gradients held inf or NaN, as at a first
    # step's initial scale): their micro-batches are counted in `micro_batches` but not in `grads`
    overflowed: int = 0
    # with keep_batches: per micro-batch, the batch the newest DataLoader pass last yielded (a CPU copy;
    # None when that pass had yielded none), that pass's index in `FitRecord.passes` (None: no pass)
    # and how many batches it had yielded
    batches: list[Any] = field(default_factory=list, repr=False)
    sources: list[tuple[int | None, int]] = field(default_factory=list)


class JoinUse(NamedTuple):
    """One `torch.distributed.algorithms.Join` the fit built: what it joins and how."""

    joinables: tuple[str, ...]  # the class names of the Joinables it shadows (DistributedDataParallel, ...)
    enable: bool
    throw_on_early_termination: bool


@dataclass
class FitRecord:
    """Everything one fit did on this rank, as the hooks saw it."""

    ddp: dict[str, Any] | None = None  # the settings of the first DDP module that ran forward
    model_type: str = ""  # the class of the model the micro-batches ran through
    micro_batches: int = 0
    synced: list[bool] = field(default_factory=list)  # per micro-batch of a DDP model
    optimizer_steps: int = 0  # as the trainer counts them: a step a GradScaler skipped counts too
    iterations: int = 0  # steps of the first optimizer that stepped: one an iteration, however many step
    grad_steps: int = 0  # optimizer steps that found gradients on their parameters
    nonzero_grad_steps: int = 0  # ... of which some gradient was nonzero
    # whether this rank's own backward (before DDP averages it with the other ranks') ever gave a
    # parameter of the model a nonzero gradient; None: no backward reached the model's parameters
    local_grad_nonzero: bool | None = None
    # the micro-batches ran through a module a DistributedDataParallel built during the fit wraps
    # (`model.module(x)`): DDP's forward, which readies its reducer, never ran
    bypassed_ddp: bool = False
    ddp_modules: list[Any] = field(default_factory=list, repr=False)  # the modules DDPs built in the fit wrap
    passes: list[LoaderPass] = field(default_factory=list)
    first_rng: str | None = None  # a digest of torch's RNG state (CPU, and CUDA once in use) at the first micro-batch
    # whether the trainer drew from torch's RNG (CPU, and CUDA once in use) after its first micro-batch (dropout,
    # augmentation, batches drawn with torch.randint), not counting a DataLoader's own draws as it begins a pass
    # (its `_base_seed`, a RandomSampler's seed): every loader without a generator makes those, whatever the
    # trainer does
    rng_consumed: bool | None = None
    rng_trail: list[RngMark] = field(default_factory=list)  # per micro-batch, the first TRACED_RNG
    model: Any = field(default=None, repr=False)  # the model the micro-batches ran through
    optimizers: list[Any] = field(default_factory=list, repr=False)  # every optimizer that stepped, first first
    outside_start: dict[str, str] = field(default_factory=dict)  # stepped_outside_model's digests before its step
    first_step: FirstStep | None = field(default=None, repr=False)  # only when the plan asked
    # the first micro-batch was counted at its backward: a forward in eval mode that trained (`replica_watch`)
    first_from_backward: bool = False
    joins: list[JoinUse] = field(default_factory=list)  # every `Join` context the fit built (DDP's `join()` too)
    # with `draws`: per micro-batch, (the pass newest at its forward, the batch of it the micro-batch trained, -1 if
    # unknown, optimizer steps taken before it)
    micro_draws: list[tuple[int, int, int]] = field(default_factory=list)
    # each module's training flag and the no-gradient parameters' changes, per micro-batch (`replica_watch`)
    replicas: ReplicaTrail = field(default_factory=ReplicaTrail)
    # autocast per micro-batch, GradScaler use, clipping on still-scaled gradients (`amp_watch`)
    amp: AmpRecord = field(default_factory=AmpRecord)
    watchers: list[Any] = field(default_factory=list, repr=False)  # the plan's `FitWatcher`s, as they saw the fit

    def watched(self, kind: type[Watcher]) -> Watcher | None:
        """The fit's watcher of this kind (None: the fit had none)."""
        return next((w for w in self.watchers if isinstance(w, kind)), None)

    @property
    def optimizer(self) -> Any:
        """The first optimizer that stepped (None before any step)."""
        return self.optimizers[0] if self.optimizers else None

    def training_passes(self) -> list[LoaderPass]:
        return [p for p in self.passes if p.trained]

    def stepped_outside_model(self) -> dict[str, Any]:
        """The trainable tensors the fit's optimizers step that the model its micro-batches ran through
        does not hold (a learnable loss temperature beside the DDP model): DDP all-reduces only the
        gradients of the module it wraps, so nothing keeps these in step across ranks. Named by their
        place in the optimizer, the only name they have here."""
        inside = {id(p) for p in self.model.parameters()} if self.model is not None else set()
        found: dict[str, Any] = {}
        for o, optimizer in enumerate(self.optimizers):
            for g, group in enumerate(optimizer.param_groups):
                for i, param in enumerate(group["params"]):
                    if id(param) not in inside and param.requires_grad:
                        where = f"optimizer {o} " if o else "optimizer "
                        shape = f"shape {tuple(param.shape)}" if param.dim() else "a scalar"
                        found[f"{where}param_groups[{g}][{i}], {shape}"] = param.detach()
        return found

    def outside_digests(self) -> dict[str, tuple[str, str]]:
        """(digest before the fit's first optimizer step, digest now) of each tensor stepped outside
        the model: only those that start alike on every rank are replicas that must stay alike (a
        model-parallel shard starts, and stays, different per rank by design)."""
        now = self.stepped_outside_model()
        return {name: (start, input_digest(now[name])) for name, start in self.outside_start.items() if name in now}

    def step_draws(self) -> list[tuple[int, list[int] | None]]:
        """With `draws`: per micro-batch, (the optimizer step it adds to, counted from 1, the dataset indices it
        trained, None where they are not known)."""
        return [(steps + 1, self.passes[index].yielded[nth] if index >= 0 and nth >= 0 else None)
                for index, nth, steps in self.micro_draws]

    def summary(self) -> dict[str, Any]:
        """Plain values, for figures and for gathering across ranks."""
        return {"micro_batches": self.micro_batches, "synced": sum(self.synced),
                "optimizer_steps": self.optimizer_steps, "loader_passes": len(self.training_passes()),
                "model_type": self.model_type, "ddp": self.ddp}


def base_index(index_map: list[int] | None, index: int) -> int:
    """An index of the loader's dataset as the underlying dataset's; one the Subset does not have
    stays outside it (negative), for the check to name, never an error in the fit."""
    if index_map is None:
        return index
    return index_map[index] if 0 <= index < len(index_map) else -1 - abs(index)
