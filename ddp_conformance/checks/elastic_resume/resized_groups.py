"""Runs in rank 0 of the check's group: start a group of another world size with
`torch.distributed.elastic.multiprocessing.start_processes` (its `PContext` owns the ranks' lifetime, their logs
and their return values keyed by rank), wait for it within a deadline, and end every rank of it either way."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

from .resized_rank import FIRST_ERROR, RankAnswer, ResizedJob, resume_in_group

HOST = "127.0.0.1"  # the group's ranks run on this host, beside the rank that starts them
POLL_SECONDS = 0.05


@dataclass
class GroupResult:
    """What one resized group answered, by rank; `timed_out`: some rank had not answered by the deadline."""

    world_size: int
    answers: dict[int, RankAnswer] = field(default_factory=dict)
    failed: tuple[int, str] | None = None  # the first rank that failed, and its error's line or how it ended
    raised: bool = False  # that rank raised (`RankRaised`), rather than died
    timed_out: bool = False
    seconds: float = 0.0  # the deadline it was given
    logs: str = ""  # where the ranks' stdout and stderr are


def resume_resized(job: ResizedJob, logs: Path) -> GroupResult:
    """Resume the trainer in a fresh group of `job.world_size` ranks on this host; every rank ended on return."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=job.seconds))
    job = replace(job, host=HOST, port=store.port)
    logs.mkdir(parents=True, exist_ok=True)
    context = start_processes(
        name=f"elastic_resume_ws{job.world_size}", entrypoint=resume_in_group,
        args={rank: (job,) for rank in range(job.world_size)},
        envs={rank: _env(rank, job) for rank in range(job.world_size)},
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL), start_method=_start_method())
    result = GroupResult(job.world_size, seconds=job.seconds, logs=str(logs))
    try:
        done = context.wait(timeout=job.seconds, period=POLL_SECONDS)
    finally:
        context.close()  # SIGTERM, then SIGKILL, to every rank still running
    if done is None:
        result.timed_out = True
        return result
    result.answers = {rank: answer for rank, answer in done.return_values.items() if isinstance(answer, RankAnswer)}
    if store.check([FIRST_ERROR]):  # the rank that raised first, whichever failure elastic saw first
        rank = int(store.get(FIRST_ERROR).decode())
        result.failed, result.raised = (rank, store.get(f"{FIRST_ERROR}/{rank}").decode()), True
    elif done.failures:  # a rank that died without raising (a signal, an exit): the one elastic found
        rank, failure = next(iter(done.failures.items()))
        result.failed = (rank, _said(failure.message) or f"exit code {failure.exitcode}")
    return result


def _said(message: Any) -> str:
    """A failure's message: elastic's error file holds {"message": text, "extraInfo": {...}} (`record`), a signal
    or an exit without one its own text."""
    text = message.get("message", "") if isinstance(message, dict) else message
    return str(text or "")


def _start_method() -> str:
    """"forkserver" where the platform has it: one clean server process per rank process, started at the first
    group with this package (and torch) imported, forks each rank of every later group in milliseconds, where a
    spawned rank imports torch afresh (seconds a rank on the 2-core machine). Never "fork": the rank that starts the
    groups runs gloo's threads."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload([resume_in_group.__module__])  # read when the server starts
    return "forkserver"


def _env(rank: int, job: ResizedJob) -> dict[str, str]:
    """What torchrun sets for a rank: a trainer that reads its rank or world size from the environment reads this
    group's (the rank that starts it has the check's group's in its own)."""
    size = str(job.world_size)
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": size, "LOCAL_WORLD_SIZE": size,
            "GROUP_RANK": "0", "NODE_RANK": "0", "MASTER_ADDR": job.host, "MASTER_PORT": str(job.port)}
