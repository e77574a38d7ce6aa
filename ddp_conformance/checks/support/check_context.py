"""Both processes: what every check gets: a fresh adapter on demand, the reconciled config, figures, timing.

Figures go into the dict of the check's one result (`ddp_conformance.checks.CheckResult`), which
`run_check` puts in the `ddp` fixture's `figures` before the check starts, so whatever a check
measured before it failed is still reported.
"""

from __future__ import annotations

import contextlib
import functools
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from ...adapter import NotProvided, RankContext, TrainerAdapter, TrainerBuildError, adapter_name
from ...config import RunConfig, reconcile
from ...trainers.spec import TrainerSpec
from .adapter_errors import AdapterError, CallNamingAdapter

if TYPE_CHECKING:
    from .fit_record import FitRecord
    from .fit_watch import FitWatcher


class CheckFailed(AssertionError):
    """A conformance violation. The first line of the message is the diagnosis (the bug, not only
    the symptom); the runner puts it in the test's headline, so users fix from that line."""


def hide_on_verdict(info: Any) -> bool:
    """For `__tracebackhide__`: a verdict is the message, not the check's source, so the check's
    frames are left out of a CheckFailed traceback (and kept for any other error, a check's bug)."""
    return bool(info.errisinstance(CheckFailed))


@dataclass(frozen=True)
class CheckOptions:
    """What the pytest process decides for a check and pickles to the ranks.

    `stall_after` is how long every rank may go without progress, once some rank has left its
    fit, before the fit counts as hung: it is derived from the test timeout so that the check's own
    verdict (naming the ranks that stopped) arrives before the harness's generic timeout.
    """

    trainer: TrainerSpec  # parsed once in the pytest process; resolved (imported) in each rank
    config: RunConfig  # the `--ddp-config` file, read once in the pytest process
    stall_after: float
    advise: bool = False  # `--ddp-advise`: measure what a setting the config leaves off would give
    max_steps: int | None = None  # `--ddp-max-steps`: the most optimizer steps one fit may train


@dataclass
class CheckContext:
    """One check run on one rank: the trainer factory, the config, where to work, what to report."""

    check_id: str
    spec: TrainerSpec
    factory: Callable[[], TrainerAdapter]
    config: RunConfig
    rank_ctx: RankContext
    ddp: Any
    workdir: Path
    stall_after: float
    figures: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    recordings: dict[str, FitRecord] = field(default_factory=dict)  # what each guarded fit really did
    # the notes of the adapters this check built that keep some (a script's files written outside its
    # checkpoint directory), reported with the check's; the lists, not the adapters, which hold models
    adapter_notes: list[list[str]] = field(default_factory=list)
    # what the harness changed in the run config ("trainer.devices: 'auto' replaced by 2"): noted once
    # the first adapter shows that the trainer takes the config (a script runs its own command line)
    config_notes: list[str] = field(default_factory=list)
    takes_config: bool | None = None  # None until the first adapter is built
    trainer_seconds: float = 0.0
    observed_steps: int = 0
    shared: bool = True
    advise: bool = False  # `--ddp-advise`: measure what a setting the config leaves off would give
    max_steps: int | None = None  # `--ddp-max-steps`: the most optimizer steps one fit may train
    # what makes the watchers of the checks that read the shared probe fit (`checks.probe_watchers`)
    probe_watchers: tuple[Callable[[], FitWatcher], ...] = ()
    # what plans the watchers of the checks that read the shared fit to n, from its k, n and checkpoint step
    long_fit_watchers: tuple[Callable[[int, int, int | None], tuple[Callable[[], FitWatcher], ...]], ...] = ()
    began: float = field(default_factory=time.perf_counter)
    _depth: int = 0

    @classmethod
    def create(cls, check_id: str, options: CheckOptions, ddp: Any, workdir: Path,
               figures: dict[str, Any]) -> CheckContext:
        """This rank's context: the SPEC resolved here, the session's config fitted to this group."""
        spec, config = options.trainer, options.config
        factory = spec.resolve()
        rank_ctx = RankContext.from_fixture(ddp, workdir)
        config, notes = reconcile(config, world_size=rank_ctx.world_size, backend=rank_ctx.backend,
                                  device_type=rank_ctx.device_type, num_nodes=rank_ctx.num_nodes)
        figures.update(world_size=rank_ctx.world_size, backend=rank_ctx.backend)
        shared = shared_directory(workdir / check_id, rank_ctx.rank)
        ctx = cls(check_id=check_id, spec=spec, factory=factory, config=config, rank_ctx=rank_ctx, ddp=ddp,
                  workdir=shared or workdir / check_id, stall_after=options.stall_after, figures=figures,
                  shared=shared is not None, advise=options.advise, max_steps=options.max_steps)
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        ctx.config_notes = notes
        return ctx

    def within_budget(self, fit: str, steps: int) -> None:
        """Skip before a fit of more optimizer steps than `--ddp-max-steps` allows, naming what it needed."""
        if self.max_steps is not None and steps > self.max_steps:
            pytest.skip(f"{self.check_id} needs a fit of {steps} optimizer steps ('{fit}'), more than "
                        f"--ddp-max-steps {self.max_steps} allows: raise the cap to {steps} to judge it")

    def require_shared_workdir(self) -> None:
        """Skip unless every rank sees the same directory (progress files, a checkpoint all read)."""
        if not self.shared:
            pytest.skip(f"{self.check_id} needs a directory every rank can read, and the ranks share none (ranks "
                        "on several nodes without a shared filesystem for pytest's tmp_path?)")

    # --- conveniences ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.rank_ctx.rank

    @property
    def world_size(self) -> int:
        return self.rank_ctx.world_size

    def adapter(self, config: RunConfig | None = None, rank_ctx: RankContext | None = None) -> TrainerAdapter:
        """A fresh adapter, set up with `config` (default: the run's config) as `rank_ctx` (default:
        this rank). Counted as the trainer's time: building it may import the trainer's framework
        (Lightning: ~3 s once)."""
        with self.training():
            adapter = CallNamingAdapter(self._built(self.factory))
            setup = functools.partial(adapter.setup, config or self.config,
                                      replace(rank_ctx or self.rank_ctx, workdir=self.workdir))
            if config is None and rank_ctx is None:  # as every check sets it up: a failure here fails them all
                self._built(setup)
            else:
                setup()
        notes = getattr(adapter, "conformance_notes", None)
        if isinstance(notes, list):
            self.adapter_notes.append(notes)
        self.takes_config = bool(getattr(adapter, "takes_config", True))
        for text in self.config_notes:
            self.config_note(text)
        self.config_notes = []
        return adapter  # type: ignore[return-value]  # a TrainerAdapter in all but name

    def _built(self, build: Callable[[], Any]) -> Any:
        """`build()`, its failure raised as the trainer's `TrainerBuildError`, from the trainer's own error."""
        try:
            return build()
        except NotProvided:
            raise
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc, AdapterError) and exc.__cause__ is not None else exc
            first = str(cause).splitlines()[0] if str(cause) else ""
            raise TrainerBuildError(f"trainer {adapter_name(self.spec.label)} could not be built: "
                                    f"{type(cause).__name__}{': ' if first else ''}{first}") from cause

    def config_note(self, text: str) -> None:
        """A note on what the harness did to the run config: kept only for a trainer that takes the
        config (held until the first adapter says whether it does)."""
        if self.takes_config is None:
            self.config_notes.append(text)
        elif self.takes_config and text not in self.notes:
            self.note(text)

    def note(self, text: str) -> None:
        """Something the check changed or could not do; reported with the figures."""
        self.notes.append(text)
        self.figures["notes"] = list(self.notes)

    @contextlib.contextmanager
    def training(self, steps: int = 0) -> Iterator[None]:
        """Time spent inside the trainer (building it, fit, resume, wrap, train_step...), reported as
        `trainer_seconds` beside the check's own `check_seconds`. Only the outermost span
        counts: an adapter built inside a guarded fit's thread is already inside its span."""
        self._depth += 1
        began = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.trainer_seconds += time.perf_counter() - began
            self.observed_steps += steps

    def fail(self, message: str, **figures: Any) -> CheckFailed:
        """Record the figures and return the exception to raise; `run_check` makes its message the
        result's verdict, one line (the rank's error's first line is what the runner shows, whole)."""
        message = " ".join(message.split())
        self.figures.update(figures)
        # the report's cell: the verdict's first clause, shortened at a word (never inside a figure), with
        # identifiers split at their underscores so that six columns of cells still fit 120 columns
        clause = message.split(":", 1)[0].replace("_", " ")
        self.figures.setdefault("summary", textwrap.shorten(clause, 40, placeholder="..."))
        self.finish({})
        return CheckFailed(message)

    def finish(self, figures: dict[str, Any]) -> dict[str, Any]:
        self.figures.update(figures)
        for notes in self.adapter_notes:
            self.notes.extend(n for n in notes if isinstance(n, str) and n not in self.notes)
        if self.notes:
            self.figures["notes"] = list(self.notes)
        total = time.perf_counter() - self.began
        self.figures["check_seconds"] = round(total, 4)
        self.figures["trainer_seconds"] = round(self.trainer_seconds, 4)
        self.figures["observed_steps"] = self.observed_steps
        return self.figures


def shared_directory(mine: Path, rank: int) -> Path | None:
    """Rank 0's directory, if every rank can see it (collective). In the plugin's own pools every
    rank gets the same tmp_path anyway; under torchrun each pytest process has its own, so rank 0's
    is used, which exists for all ranks of one node but not across nodes without a shared filesystem."""
    import torch.distributed as dist  # deferred: torch is heavy, and the pytest process imports this module

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    if rank == 0:
        mine.mkdir(parents=True, exist_ok=True)
        (mine / ".rank0").write_text("")
    theirs = Path(from_rank_zero(str(mine)))
    visible = all_gather((theirs / ".rank0").is_file())
    return theirs if all(visible) else None


_Value = TypeVar("_Value")


#: [the default group it was made for, the checks' own group]: made again when the default group is (a rebuilt one)
_OWN_GROUP: list[Any] = []


def own_group() -> Any:
    """The checks' own process group: gloo over every rank of the default group, made at the first collective of
    the checks (collective: every rank reaches it at the same point). The trainer's collectives run in the default
    group, the checks' here: a hung fit's record (`collectives.py`) then numbers the trainer's collectives alone,
    and the checks never wait in a slot of the trainer's sequence."""
    import torch.distributed as dist  # deferred: torch is heavy, and the pytest process imports this module

    world = dist.group.WORLD
    if not _OWN_GROUP or _OWN_GROUP[0] is not world:
        _OWN_GROUP[:] = [world, dist.new_group(backend="gloo")]
    return _OWN_GROUP[1]


def all_gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (collective; pickled objects)."""
    import torch.distributed as dist  # deferred: torch is heavy, and the pytest process imports this module

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=own_group())
    return out


def from_rank_zero(value: _Value) -> _Value:
    """Rank 0's `value` on every rank (collective; pickled)."""
    import torch.distributed as dist  # deferred: torch is heavy, and the pytest process imports this module

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0, group=own_group())
    return box[0]


def tensors_from_rank_zero(tensors: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's named tensors (None values kept) on every rank, as CPU tensors (collective; `tensors` is
    read on rank 0 only). The names, shapes and dtypes go pickled; the values as CPU tensors, through the
    checks' own gloo group: pickled tensors were 0.7 s for 58 MB at world size 4, and torch 2.4 warned on
    unpickling them."""
    import torch  # deferred: torch is heavy, and the pytest process imports this module
    import torch.distributed as dist  # deferred: as torch

    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert tensors is not None
        return tensors
    zero = dist.get_rank() == 0
    layout = from_rank_zero({name: None if t is None else (tuple(t.shape), t.dtype) for name, t in tensors.items()}
                            if zero and tensors is not None else None)
    out: dict[str, Any] = {}
    for name, shape_dtype in layout.items():
        if shape_dtype is None:
            out[name] = None
            continue
        value = tensors[name].cpu() if zero and tensors is not None else torch.empty(shape_dtype[0],
                                                                                     dtype=shape_dtype[1])
        dist.broadcast(value, src=0, group=own_group())
        out[name] = value
    return out


def on_every_rank(call: Callable[[], _Value]) -> _Value:
    """`call()`'s value where it answered on every rank; where it raised NotProvided on some rank, that
    NotProvided (the first such rank's words) raised on every rank. Collective: a rank that went on
    alone (a Lightning probe whose loader gave this rank no batch) would wait in the check's next
    collective for ranks that took the other branch."""
    try:
        value, missing = call(), None
    except NotProvided as exc:
        missing = exc
    reasons = all_gather(None if missing is None else (missing.what, str(missing)))
    first = next((reason for reason in reasons if reason is not None), None)
    if first is None:
        return value
    if missing is None:  # another rank's words: the same kind of answer, raised here too
        missing = NotProvided("", first[0])
        missing.args = (first[1],)
    raise missing


def rounded(value: float) -> str:
    """A float for a verdict: 3 significant digits."""
    return f"{value:.3g}"


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GiB"  # pragma: no cover
