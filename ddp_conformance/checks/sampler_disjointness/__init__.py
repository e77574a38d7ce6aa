"""sampler_disjointness: over the epochs the real fit trains on, the ranks' samples are a partition.

The indices come from the fit itself (`observe.FitRecorder` records what each rank's training
loader drew), never from a restatement: a loop that forgets `set_epoch` fails here even when the
adapter's `make_loader` calls it. The fit runs long enough to finish three epochs: a one-step probe
fit first measures the training loader's length and the micro-batches per optimizer step
(`progress.epoch_steps`). An epoch longer than `plan.LONG_EPOCH_STEPS` is not trained whole: the
steps the fit trains are judged as a started epoch (no overlap), and the note says what is left.
Both fits are the ones resume_fidelity judges too, run once for both (`support/shared_fit.py`). Where
the adapter also provides `make_loader`/`batch_indices`, they are cross-checked against the fit
("make_loader yields samples the fit never consumed"); where the fit's batches are not lists of
dataset indices (a batch sampler of keys), the fit's own inputs are judged (`loader_schemes.judge_inputs`: no batch fed
to two ranks, a new order each epoch), then the helpers' indices where the adapter has them.

The sampling scheme is recognised from what the fit used, and each is held to its own invariant:
a partition (DistributedSampler or any sampler without replacement: `sampling.py`), independent
per-rank draws with replacement, or a rank-sharded IterableDataset (`loader_schemes.py`). Advice never
asks for something that would break another scheme.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from ... import plan
from ...adapter import NotProvided
from ...trainers.spec import LIGHTNING, SCRIPT
from ..support import shared_fit
from ..support.check_context import CheckContext, all_gather, hide_on_verdict, on_every_rank
from ..support.loader_watch import dropped_tail
from ..support.progress import epoch_steps
from ..support.sampling import analyse, analyse_started_epoch, per_rank_split
from . import loader_schemes

#: SPEC kinds checked with no adapter the user wrote
NO_ADAPTER_KINDS = (LIGHTNING, SCRIPT)
#: the epochs judged. Three, not two: a loop that rebuilds its loader later in the run (a curriculum's
#: second stage, progressive resizing) or tells the sampler the epoch only some of the time
#: (`set_epoch(epoch // 2)`) is sound in epochs 0 and 1
EPOCHS = tuple(range(plan.WHOLE_EPOCHS))


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    try:
        record = shared_fit.probe(ctx)
    except NotProvided as exc:
        if exc.what != "fit":
            raise
        return _judge_from_helpers(ctx, "the adapter provides no fit")
    epoch = epoch_steps(ctx, record)
    probe = record.training_passes()
    if any(all_gather(bool(probe) and probe[0].iterable)):
        return loader_schemes.judge_iterable(ctx, probe)
    if epoch is None:
        pytest.skip("fit(1) drew its batches through no DataLoader with a length (batches made by hand, e.g. "
                    "torch.randint, or an unsized iterable): there are no epochs or sample indices to judge")
    observed = shared_fit.observed_fit(ctx, epoch)  # at least one step into the next epoch: the judged ones are whole
    steps = observed.horizon
    passes = observed.record.training_passes()
    loader_schemes.read_through_wrappers(ctx, passes)
    started = min(all_gather(len(passes)))
    if not plan.whole_epochs(epoch):
        return _judge_first_steps(ctx, passes[:started], epoch, steps)
    if started < 3:
        pytest.skip(f"fit({steps}) did not finish 2 epochs of its training loader (it started {len(passes)} passes "
                    "over it): the order across epochs cannot be judged")
    # the last pass started may be cut short; a loader rebuilt mid-run (longer epochs, another dataset
    # or sampler) ends the epochs judged in full, and what the ranks drew from it is judged as started
    judged = _alike_from_the_first(passes[:min(started - 1, len(EPOCHS))])
    complete, later = passes[:judged], passes[judged:started]
    # the scheme is chosen from every rank's passes, so that all ranks make the same collectives
    indexed, replacement = (all(flags) for flags in zip(*all_gather((all(p.indexed for p in complete),
                                                                      _draws_with_replacement(complete[0]))),
                                                         strict=True))
    if not indexed:
        figures = _judge_unindexed(ctx, complete)
    elif replacement:
        figures = loader_schemes.judge_with_replacement(ctx, complete)
    else:
        size = complete[0].dataset_size
        assert size is not None  # a map-style dataset: it has indices
        drawn, size = _within_the_universe(ctx, complete, size)
        figures = _judge(ctx, drawn, size, _shuffles(ctx, complete),
                         Batching(complete[0].sampler, complete[0].tail, complete[0].share))
        figures.update(indices_from="the fit", scheme="partition")
        _cross_check(ctx, complete, figures)
    _judge_started(ctx, later, judged, figures)
    return figures


def _judge_first_steps(ctx: CheckContext, passes: list[Any], epoch: int, steps: int) -> dict[str, Any]:
    """An epoch longer than the shared fit trains whole (`plan.LONG_EPOCH_STEPS`): what the ranks drew
    in the steps it trained must not overlap; coverage and a new order each epoch are left unjudged, and the
    note says so, with what would judge them."""
    __tracebackhide__ = hide_on_verdict
    figures: dict[str, Any] = {"epoch_steps": epoch, "judged_steps": steps, "indices_from": "the fit",
                               "scheme": "the first steps of an epoch"}
    _universes(ctx, passes)  # ranks that each split the dataset their own way: named as such, as in whole epochs
    _judge_started(ctx, passes, 0, figures)
    ctx.note(f"an epoch of the training loader is {epoch} optimizer steps, longer than the "
             f"{plan.LONG_EPOCH_STEPS} the suite trains whole: the ranks' samples were judged disjoint over the "
             f"{steps} steps the shared fit trained; that they cover the dataset and are reshuffled each epoch is not "
             "judged (a SPEC or config with a smaller training set would have it judged)")
    figures["summary"] = f"disjoint over {steps} of {epoch} steps"
    return figures


def _within_the_universe(ctx: CheckContext, complete: list[Any], size: int) -> tuple[list[Any], int]:
    """This rank's batches, and the dataset size, as the partition is judged: where the loaders are
    over Subsets (each rank's own shard, or one stage's part of the data), over the union of what the
    ranks' Subsets hold, relabelled 0..len-1: that union is what the ranks must cover between them."""
    universes = _universes(ctx, complete)
    if all(u is None for u in universes):
        return [p.batches for p in complete], size
    batches = [p.base_batches() for p in complete]
    size = max(s for s in all_gather(complete[0].base_size or size) if s is not None)
    union = sorted(set().union(*(range(size) if u is None else u for u in universes)))
    position = {index: i for i, index in enumerate(union)}
    relabel = [[[position.get(i, -1) for i in batch] for batch in epoch] for epoch in batches]
    ctx.note(f"the loaders are over Subsets: the partition is judged over the {len(union)} samples of the "
             f"underlying dataset ({size}) that the ranks' Subsets hold")
    return relabel, len(union)


def _universes(ctx: CheckContext, passes: list[Any]) -> list[Any]:
    """Every rank's Subset indices of its first pass (None: no Subset), after failing where each rank's are its
    own split of one dataset (collective)."""
    universes = all_gather(passes[0].universe if passes else None)
    split = per_rank_split(universes) if any(u is not None for u in universes) else ""
    if split:
        raise ctx.fail(split, subsets_per_rank=[None if u is None else len(u) for u in universes])
    return universes


def _alike_from_the_first(passes: list[Any]) -> int:
    """How many of the passes, from the first, every rank drew alike: same dataset, sampler, scheme
    and dropped tail (a pass whose loader was rebuilt otherwise is judged as a started epoch)."""
    shapes = all_gather([_shape(p) for p in passes])
    count = min(map(len, shapes))
    return next((i for i in range(1, count) if any(shape[i] != shape[0] for shape in shapes)), count)


def _shape(p: Any) -> tuple[Any, ...]:
    universe = None if p.universe is None else (len(p.universe), hash(tuple(p.universe)))  # ints: no hash secret
    return p.dataset_size, p.sampler, p.indexed, p.tail, _draws_with_replacement(p), universe


def _judge_started(ctx: CheckContext, later: list[Any], first: int, figures: dict[str, Any]) -> None:
    """The passes after the complete ones (`later`, from epoch `first`), as far as the fit drew them:
    no two ranks may be fed the same samples there either, whatever loader the fit built for them."""
    __tracebackhide__ = hide_on_verdict
    mine = [(p.base_size or p.dataset_size, p.sampler, [i for b in p.base_batches() for i in b] if p.indexed else None,
             p.inputs, _draws_with_replacement(p), p.share) for p in later]
    everyone = all_gather(mine)
    judged = {key: value for key, value in figures.items() if key != "summary"}  # the complete epochs' summary
    for offset in range(min(map(len, everyone))):
        epoch = first + offset
        size, sampler, _, _, _, share = everyone[0][offset]
        drawn = [ranks[offset][2] for ranks in everyone]
        inputs = [ranks[offset][3] for ranks in everyone]
        replacement = any(ranks[offset][4] for ranks in everyone)
        if all(d is not None for d in drawn) and size is not None and not replacement:
            verdict = analyse_started_epoch(drawn, size, epoch, sampler, share)
            if not verdict.ok:
                raise ctx.fail(verdict.diagnosis, **{**judged, **verdict.figures})
        elif None not in (digest for fed in inputs for digest in fed):
            shared = loader_schemes.shared_batch(inputs)
            if shared:
                (one, other), position = shared
                raise ctx.fail(f"ranks {one} and {other} train on the same batch in epoch {epoch} (batch {position} "
                               f"of rank {other}, inputs identical; {sampler}): from epoch {epoch} the fit's batches "
                               "are not sharded by rank (a loader rebuilt mid-run without its DistributedSampler?)",
                               **judged)


def _draws_with_replacement(first: Any) -> bool:
    """As the sampler says (RandomSampler, WeightedRandomSampler); for one that cannot say (a
    hand-written batch sampler), whether one rank drew an index twice in its first epoch, which a
    share of a partition never does."""
    if first.replacement is not None:
        return bool(first.replacement)
    drawn = [i for batch in first.batches for i in batch]
    return len(set(drawn)) < len(drawn)


def _shuffles(ctx: CheckContext, passes: list[Any]) -> bool:
    """Whether the fit's loader shuffles: as its sampler says, else as the config asks."""
    return passes[0].shuffle if passes[0].shuffle is not None else ctx.config.data.shuffle


class Batching(NamedTuple):
    """How the ranks' loaders batch an epoch: what orders the samples (named in the advice), what each rank's
    share leaves out at its end (`tail`), and what a sharding that pads whole batches gives each rank (`share`)."""

    sampler: str = "DistributedSampler"
    tail: int = 0
    share: int | None = None


def _judge(ctx: CheckContext, mine: list[list[list[int]]], size: int, shuffle: bool,
           batching: Batching) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    gathered = all_gather(mine)
    epochs = [[gathered[r][e] for r in range(ctx.world_size)] for e in range(len(mine))]
    shares = {found for found in all_gather(batching.share) if found is not None}
    verdict = analyse(epochs, size, shuffle, batching.sampler, max(all_gather(batching.tail)),
                      max(shares) if shares else None)
    figures = dict(verdict.figures)
    if not shuffle:
        ctx.note("the loader does not shuffle: the order across epochs is not judged")
    elif len(mine) < 2:
        ctx.note("the fit's loader changes after its first epoch: the order across epochs is not judged")
    elif figures.get("order_changes") is None:
        ctx.note("too few samples per epoch to judge the order across epochs")
    if not verdict.ok:
        raise ctx.fail(verdict.diagnosis, **figures)
    overlap = figures.get("padding_duplicates", 0)
    figures["summary"] = f"disjoint, {overlap} padding dup" + ("" if overlap == 1 else "s")
    return figures


def _helper_epochs(ctx: CheckContext) -> list[list[list[int]]] | None:
    """This rank's batches of `make_loader` for each epoch, or None when the adapter has no helpers."""
    adapter = ctx.adapter()

    def epochs() -> list[list[list[int]]]:
        dataset = adapter.make_dataset()
        with ctx.training():
            return [[adapter.batch_indices(batch) for batch in
                     adapter.make_loader(dataset, rank=ctx.rank, world_size=ctx.world_size, epoch=epoch)]
                    for epoch in EPOCHS]

    try:
        return on_every_rank(epochs)  # a rank whose helper lacked would judge alone
    except NotProvided:
        return None


def _cross_check(ctx: CheckContext, complete: list[Any], figures: dict[str, Any]) -> None:
    """A helper that restates the loader must yield what the fit consumed, or every check built on it
    judges something that never runs. Over a Subset, the helper may name samples by the Subset's
    indices or by the underlying dataset's: either agrees."""
    __tracebackhide__ = hide_on_verdict
    helper = _helper_epochs(ctx)
    fit = [p.batches for p in complete]
    mismatch = None if helper is None else _first_difference(helper[:len(fit)], fit)
    if mismatch is not None and complete[0].index_map is not None:
        in_base = _first_difference(helper[:len(fit)], [p.base_batches() for p in complete])  # type: ignore[index]
        mismatch = None if in_base is None else mismatch
    mismatches = all_gather(mismatch)
    figures["helper_agrees"] = None if helper is None else not any(mismatches)
    wrong = [(rank, m) for rank, m in enumerate(mismatches) if m]
    if wrong:
        rank, (epoch, position, said, drew) = wrong[0]
        if not _has_adapter(ctx):
            raise ctx.fail(f"the train loader yields other samples each time it is built: on rank {rank}, epoch "
                           f"{epoch}, batch {position} of a probe fit's loader is {said} where the checked fit's own "
                           f"loader drew {drew} (its order depends on more than the seed and the epoch, so the "
                           "checks that read the loader outside the fit judge batches it never trains)", **figures)
        raise ctx.fail(f"make_loader yields samples the fit never consumed: on rank {rank}, epoch {epoch}, batch "
                       f"{position} of make_loader is {said} where the fit's own loader drew {drew} (the adapter "
                       "restates the loop differently from what the loop does)", **figures)


def _has_adapter(ctx: CheckContext) -> bool:
    """Whether the user wrote the trainer's adapter: a `lightning:` or `script:` SPEC is checked with
    none (the harness reads its loader itself), so no verdict may blame an adapter there."""
    return ctx.spec.kind not in NO_ADAPTER_KINDS


def _no_helpers(ctx: CheckContext) -> str:
    """Why no `make_loader`/`batch_indices` indices exist, as the trainer's shape says it."""
    if _has_adapter(ctx):
        return "the adapter provides no make_loader/batch_indices to read indices from"
    return "the trainer's loader cannot be read outside its fit for indices (no DataLoader over a map-style dataset)"


def _first_difference(helper: list[list[list[int]]],
                      fit: list[list[list[int]]]) -> tuple[int, int, list[int], list[int]] | None:
    for epoch, (said, drew) in enumerate(zip(helper, fit, strict=True)):
        for position in range(max(len(said), len(drew))):
            a = said[position] if position < len(said) else []
            b = drew[position] if position < len(drew) else []
            if a != b:
                return epoch, position, a[:8], b[:8]
    return None


def _judge_unindexed(ctx: CheckContext, complete: list[Any]) -> dict[str, Any]:
    """A fit whose batches are not lists of dataset indices: its own inputs, then `make_loader`'s
    partition where the adapter has one."""
    __tracebackhide__ = hide_on_verdict
    fed = loader_schemes.judge_inputs(ctx, complete, _shuffles(ctx, complete))
    why = f"the fit's loader batches without a BatchSampler ({complete[0].sampler})"
    helper = _helper_epochs(ctx)
    if helper is None and fed["indices_from"]:
        ctx.note(f"{why}: only the fit's inputs are judged (no batch fed to two ranks), not a partition of the "
                 f"dataset, since {_no_helpers(ctx)}")
        return fed
    figures = {**fed, **_judge_from_helpers(ctx, why, helper)}
    if fed["indices_from"]:
        ctx.note("the fit's inputs are judged too: no batch fed to two ranks, a new order each epoch")
        figures["indices_from"] = "make_loader, and the fit's inputs"
    return figures


def _judge_from_helpers(ctx: CheckContext, why: str, helper: Any = None) -> dict[str, Any]:
    """The fit cannot show its indices (`why`): judge the adapter's `make_loader` instead (its
    epochs, `helper`, when already read), and say so."""
    __tracebackhide__ = hide_on_verdict
    helper = helper if helper is not None else _helper_epochs(ctx)
    if helper is None:
        pytest.skip(f"{why}, and {_no_helpers(ctx)}")
    ctx.note(f"indices read from make_loader, not from the fit: {why}")
    size = len(ctx.adapter().make_dataset())  # type: ignore[arg-type]
    figures = _judge(ctx, helper, size, ctx.config.data.shuffle, Batching(tail=_helper_tail(ctx)))
    figures["indices_from"] = "make_loader"
    return figures


def _helper_tail(ctx: CheckContext) -> int:
    """What `make_loader`'s own DataLoader drops of this rank's share (`drop_last=True`), if it is one."""
    adapter = ctx.adapter()
    loader = adapter.make_loader(adapter.make_dataset(), rank=ctx.rank, world_size=ctx.world_size, epoch=0)
    return dropped_tail(getattr(loader, "batch_sampler", None))
