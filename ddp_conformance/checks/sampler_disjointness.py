"""sampler_disjointness: over an epoch of the trainer's own loader, the ranks' samples are a partition.

Each rank builds *its own* loader (`make_loader(rank=this rank)`) for two epochs and the indices are
gathered, rather than one process building every rank's loader: a trainer that reads the rank
from the process group instead of the `rank` argument would look right when built elsewhere and
still be wrong where it runs. The rules and diagnoses are in `sampling.py`.
"""

from __future__ import annotations

from typing import Any

from .base import CheckContext, all_gather, hide_on_verdict
from .sampling import analyse

EPOCHS = (0, 1)


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    adapter = ctx.adapter()
    dataset = adapter.make_dataset()
    size = len(dataset)  # type: ignore[arg-type]
    mine: list[list[list[int]]] = []
    batches = 0
    with ctx.training():
        for epoch in EPOCHS:
            loader = adapter.make_loader(dataset, rank=ctx.rank, world_size=ctx.world_size, epoch=epoch)
            mine.append([adapter.batch_indices(batch) for batch in loader])
            batches += len(mine[-1])
    ctx.figures["loader_batches_read"] = batches  # no training step is observed here
    gathered = all_gather(mine)
    epochs = [[gathered[r][e] for r in range(ctx.world_size)] for e in range(len(EPOCHS))]
    shuffle = ctx.config.data.shuffle
    verdict = analyse(epochs, size, shuffle)
    figures = dict(verdict.figures)
    if not shuffle:
        ctx.note("data.shuffle is false: the order across epochs is not judged")
    elif figures.get("order_changes") is None:
        ctx.note("too few samples per epoch to judge the order across epochs")
    if not verdict.ok:
        raise ctx.fail(verdict.diagnosis, **figures)
    overlap = figures.get("padding_duplicates", 0)
    figures["summary"] = f"disjoint, {overlap} padding dup" + ("" if overlap == 1 else "s")
    return figures
