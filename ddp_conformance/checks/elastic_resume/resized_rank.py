"""Runs in a rank of a group of another world size, which rank 0 of the check's group started
(`resized_groups.py`): join that group, resume the trainer from the checkpoint written at the check's world size,
and return what it trained (torch.distributed.elastic's return values, keyed by rank). A rank that raises ends its
process with `RankRaised`, one line, which elastic records as the rank's failure: the rank that started the group
sees it at once and ends the group, where peers blocked in a collective with the raising rank would otherwise wait
for it (destroying a gloo group does not wake them)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn import SyncBatchNorm
from torch.nn.modules.batchnorm import _BatchNorm  # the base of every BatchNorm layer, SyncBatchNorm's too

from ...adapter import FitObserver, RankContext
from ...config import RunConfig
from ...trainers.spec import TrainerSpec
from ..support.first_steps import final_floats, zero_dropout
from ..support.fit_watch import FitPlan
from ..support.observe import FitRecorder, ObservedState

#: prctl's option that has the kernel signal a process when the thread that started it ends
PR_SET_PDEATHSIG = 1
#: the key of the group's store the first rank to raise claims (its rank), its error under FIRST_ERROR/<rank>
FIRST_ERROR = "first_error"


@dataclass(frozen=True)
class ResizedJob:
    """What every rank of one resized group is given (pickled by the spawn)."""

    spec: TrainerSpec
    config: RunConfig
    checkpoint: Path
    steps: int
    world_size: int
    host: str
    port: int  # of the TCPStore rank 0 of the check's group serves
    workdir: Path  # the check's, as its own ranks' adapters had it: a script's resume reads the step its fit noted
    seconds: float  # how long the group may take before its peers stop waiting for a missing rank


@dataclass
class RankAnswer:
    """One resized rank's result, or its error."""

    rank: int
    draws: list[tuple[int, list[int] | None]] = field(default_factory=list)  # `FitRecord.step_draws`
    steps: int = 0  # optimizer steps the resumed fit took
    final: dict[str, Any] | None = None  # rank 0's final parameters and buffers (`final_floats`)


class RankRaised(Exception):
    """The trainer raised in this rank: its error's first line and where, as "IndexError: list index out of range
    (trainer.py:42 in load_checkpoint)"."""


class DropoutOff(FitObserver):
    """Sets the model's dropout layers to 0 at its first forward, as the compared fit at the check's world size
    has them: their masks are drawn per rank, so another world size draws others."""

    def on_wrapped(self, model: Any) -> None:
        zero_dropout(model)


def resume_in_group(job: ResizedJob) -> RankAnswer:
    """The spawned function: this rank's answer; raises `RankRaised` where the trainer raised, after claiming the
    group's first error in its store (`FIRST_ERROR`): the peers it leaves in a collective raise too, once its process
    has ended, and elastic may see their failure first."""
    rank = int(os.environ["RANK"])
    _end_with_parent()
    store: dist.TCPStore | None = None
    try:
        timeout = timedelta(seconds=job.seconds)
        store = dist.TCPStore(job.host, job.port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ws{job.world_size}", store), rank=rank,
                                world_size=job.world_size, timeout=timeout)
        answer = _resume(job, rank)
    except Exception as exc:
        text = _first_line(exc)
        if store is not None:
            with contextlib.suppress(Exception):  # a store that is gone: elastic's record of the failure remains
                store.compare_set(FIRST_ERROR, "", str(rank))
                store.set(f"{FIRST_ERROR}/{rank}", text)
        raise RankRaised(text) from None  # the traceback is ours: the rank's stderr log keeps the rest
    dist.destroy_process_group()
    return answer


def _resume(job: ResizedJob, rank: int) -> RankAnswer:
    adapter = job.spec.resolve()()
    adapter.setup(job.config, RankContext(rank=rank, local_rank=rank, world_size=job.world_size, backend="gloo",
                                          device="cpu", workdir=job.workdir))
    with FitRecorder(DropoutOff(), rank, FitPlan(draws=adapter.batch_indices)) as recorder:
        result = adapter.resume(job.checkpoint, job.steps)
    record = recorder.record
    state = ObservedState.of(result, record)
    return RankAnswer(rank, draws=record.step_draws(), steps=record.optimizer_steps,
                      final=final_floats(state) if rank == 0 else None)


def unsynced_batchnorm(model: Any) -> list[str]:
    """The model's BatchNorm layers that normalise by each rank's own batch in training (not SyncBatchNorm): their
    statistics follow the per-rank batch, which a fixed global batch splits differently at each world size."""
    return [name or "the model" for name, module in model.named_modules()
            if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm) and module.training]


def _first_line(error: BaseException) -> str:
    """The error's type and first line, and the innermost frame outside this package (the trainer's)."""
    traceback.print_exception(error)  # whole, into the rank's stderr log
    text = str(error).strip()
    first = f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__
    package = str(Path(__file__).resolve().parents[2])
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(package)]
    return f"{first} ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else first


def _end_with_parent() -> None:
    """Have the kernel kill this rank when the check's rank that started it ends (killed by a timeout, say): no
    rank of a resized group outlives the check. Linux only; elsewhere the check's own deadline ends them."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
