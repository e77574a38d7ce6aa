"""sync_batchnorm: with `sync_batchnorm` on, every BatchNorm layer normalises by the statistics of the
global batch (all ranks' micro-batches together), as one process would on that batch, and records
those statistics as its running mean and variance.

The guides call SyncBatchNorm "required for correct DDP"; the bug is that it silently is not there:
`sync_batchnorm: true` in a config that never reaches `convert_sync_batchnorm`, a model converted
before a head with its own BatchNorm was added, or a SyncBatchNorm that synchronises over a process
group smaller than the ranks (a per-node group of one GPU). Each rank then normalises by its own
micro-batch and nothing fails.

Evidence: the shared one-step probe fit (`shared_fit.probe`), whose recorder keeps, per BatchNorm
layer in training mode, per-channel sums of the first micro-batch's input and output and the running
statistics before and after it (`norm_watch.py`). From the ranks' sums the check computes what the
layer must give on the global batch: the running statistics updated by the global mean and unbiased
variance, and the output line `weight * (x - mean) / sqrt(var + eps) + bias` with the biased one.
Each rank's layer is compared with that, and with what its own micro-batch alone would give, so a
failure says which one it did. Deviations are measured in units of the channel's standard deviation
(scaled by the momentum for running statistics) and tolerated up to `tolerance(layer)`: 1e-3, or twice
the epsilon of the layer's coarsest dtype under autocast, whose output rounding limits the fitted line.
Measured on an H200 (gloo, two ranks on one GPU, both references, the guide's configs): fp32 6.5e-6,
16-mixed 5.3e-4 (fp16 epsilon 9.8e-4), bf16-mixed 2.5e-3 (bf16 epsilon 7.8e-3); a rank that normalised
alone deviates by 2.2.

Skips, each with its reason: a world of one, no BatchNorm layer, none in training mode, the layers
on the CPU (torch's SyncBatchNorm refuses CPU tensors, so on a CPU runner sync_batchnorm cannot be
exercised: run the suite with `--ddp-device cuda` on a GPU runner), plain BatchNorm where the config
does not ask for synchronisation, and ranks whose micro-batches have the same statistics (local and
global are then the same numbers, and no verdict could tell them apart).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pytest
import torch

from ...runner.ranks import ranks_label
from ..support import shared_fit
from ..support.check_context import CheckContext, all_gather, hide_on_verdict, rounded
from .norm_watch import NormLayer, NormWatch

#: what this check reads of the shared probe fit (`checks.PROBE_READERS`)
PROBE_WATCHER = NormWatch
#: the largest deviation (in channel standard deviations) that counts as the global batch's statistics in fp32
TOLERANCE = 1e-3
#: below this many tolerances between the rank's own and the global statistics, the two cannot be told apart
SEPARATION = 10


def tolerance(layer: NormLayer) -> float:
    """`TOLERANCE`, or twice the epsilon of the layer's coarsest dtype (bf16's 7.8e-3 under autocast)."""
    return max(TOLERANCE, 2 * layer.resolution)


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    if ctx.world_size == 1:
        pytest.skip("world size 1: one rank's BatchNorm statistics are the global batch's, there is nothing "
                    "to synchronise")
    record = shared_fit.probe(ctx)
    # gathered before any decision, so that every rank decides alike even where ranks built different models
    watch = record.watched(NormWatch)
    gathered = all_gather((watch.names, watch.layers) if watch is not None else ([], []))
    world = [rank_layers for _, rank_layers in gathered]
    names = max((rank_names for rank_names, _ in gathered), key=len)
    layers = max(world, key=len)
    if not names:
        pytest.skip("the model the fit trains has no BatchNorm layer, so there are no statistics to synchronise")
    if not layers:
        pytest.skip(f"none of its {len(names)} BatchNorm layer(s) ran in training mode in the fit's first "
                    "micro-batch (frozen statistics): nothing is synchronised while it trains")
    figures: dict[str, Any] = {"batchnorm_layers": len(names), "synced_layers": sum(layer.synced for layer in layers)}
    devices = sorted({layer.device for rank_layers in world for layer in rank_layers})
    if devices != ["cuda"]:
        pytest.skip(f"its BatchNorm layers ran on {', '.join(devices)}: torch's SyncBatchNorm runs on GPU modules "
                    "only ('SyncBatchNorm expected input tensor to be on GPU'), so synchronisation is not "
                    "exercised here; run with --ddp-device cuda on a GPU runner")
    plain = list(dict.fromkeys(layer.name for rank_layers in world for layer in rank_layers if not layer.synced))
    if plain:
        if not ctx.config.trainer.sync_batchnorm and len(plain) == len(layers):
            pytest.skip(f"its {len(plain)} BatchNorm layer(s) normalise per rank, as configured "
                        "(trainer.sync_batchnorm is false and no layer is a SyncBatchNorm)")
        raise ctx.fail(unconverted(plain, layers, ctx.config.trainer.sync_batchnorm), **figures)
    verdict = judge(world, figures)
    if verdict is None:
        pytest.skip("not judged: every rank's micro-batch has the same per-channel statistics at every "
                    "BatchNorm layer, so its own and the global batch's give the same numbers")
    if verdict:
        raise ctx.fail(verdict, **figures)
    return figures


def unconverted(plain: list[str], layers: list[NormLayer], asked: bool) -> str:
    """The verdict for BatchNorm layers that are not SyncBatchNorm where synchronisation is asked for."""
    why = "trainer.sync_batchnorm is true" if asked else "the model's other BatchNorm layers are SyncBatchNorm"
    kinds = sorted({layer.kind for layer in layers if not layer.synced})
    shown = ", ".join(repr(name) for name in plain[:4]) + (", ..." if len(plain) > 4 else "")
    return (f"BatchNorm is not synchronised: {why}, but {len(plain)} of the {len(layers)} BatchNorm layers the fit "
            f"trains are plain {'/'.join(kinds)} ({shown}), so each rank normalises by its own micro-batch, not "
            "the global batch: convert_sync_batchnorm never reached them (convert the whole model before wrapping "
            "it in DDP)")


def judge(world: list[list[NormLayer]], figures: dict[str, Any]) -> str | None:
    """"" when every rank's every layer gave the global batch's statistics, the failure's verdict when
    one did not, None when no layer could tell its own micro-batch's from the global batch's."""
    worst, distinguishable = 0.0, False
    for index, layer in enumerate(world[0]):
        per_rank = [rank[index] for rank in world if index < len(rank) and rank[index].name == layer.name]
        if len(per_rank) != len(world):
            continue
        total = _Moments.pooled(per_rank)
        for rank, mine in enumerate(per_rank):
            own, seen = _Moments.pooled([mine]), _observed(mine)
            want_global, want_own = _expected(mine, total), _expected(mine, own)
            allowed = tolerance(mine)
            figures["tolerance"] = max(figures.get("tolerance", 0.0), allowed)
            distinguishable |= _distance(want_own, want_global, mine, total) > SEPARATION * allowed
            deviation = _distance(seen, want_global, mine, total)
            worst = max(worst, deviation)
            if deviation > allowed:
                figures["max_deviation"] = deviation
                return _verdict(mine, rank, len(world), _distance(seen, want_own, mine, total), deviation)
    figures["max_deviation"] = worst
    return "" if distinguishable else None


class _Moments:
    """Per-channel count, mean and variance (biased and unbiased) of a batch pooled over ranks."""

    def __init__(self, count: int, mean: Any, biased: Any) -> None:
        self.count, self.mean, self.biased = count, mean, biased.clamp_min(0)
        self.unbiased = self.biased * count / max(count - 1, 1)

    @classmethod
    def pooled(cls, layers: list[NormLayer]) -> _Moments:
        count = sum(layer.count for layer in layers)
        mean = sum(layer.sums for layer in layers) / count
        return cls(count, mean, sum(layer.squares for layer in layers) / count - mean * mean)


class _Outcome(NamedTuple):
    """A layer's running statistics after the forward (None: it tracks none) and its output line."""

    mean: Any | None
    var: Any | None
    slope: Any
    offset: Any


def _expected(layer: NormLayer, moments: _Moments) -> _Outcome:
    """What the layer gives with these statistics: running statistics moved towards the mean and the
    unbiased variance by the momentum, and the output line `weight * (x - mean) / sqrt(biased + eps) + bias`."""
    weight = layer.weight if layer.weight is not None else torch.ones_like(moments.mean)
    bias = layer.bias if layer.bias is not None else torch.zeros_like(moments.mean)
    slope = weight / (moments.biased + layer.eps).sqrt()
    offset = bias - slope * moments.mean
    factor = _factor(layer)
    if layer.mean_before is None or layer.var_before is None:
        return _Outcome(None, None, slope, offset)
    return _Outcome((1 - factor) * layer.mean_before + factor * moments.mean,
                    (1 - factor) * layer.var_before + factor * moments.unbiased, slope, offset)


def _observed(layer: NormLayer) -> _Outcome:
    """What the layer gave: its running statistics, and the per-channel least-squares line through
    (input, output) of this rank's micro-batch (NaN for a channel whose input was constant)."""
    n = layer.count
    mean_x, mean_y = layer.sums / n, layer.out_sums / n
    var_x = layer.squares / n - mean_x * mean_x
    slope = (layer.cross / n - mean_x * mean_y) / var_x.where(var_x > 0, torch.full_like(var_x, math.nan))
    return _Outcome(layer.mean_after, layer.var_after, slope, mean_y - slope * mean_x)


def _distance(got: _Outcome, want: _Outcome, layer: NormLayer, scale: _Moments) -> float:
    """The largest per-channel difference, in the channel's standard deviations: running statistics
    divided by the momentum too (they moved by that fraction), the slope relative to itself."""
    std = (scale.unbiased + layer.eps).sqrt()
    slope = want.slope.abs().clamp_min(1e-12)
    parts = [(got.slope - want.slope).abs() / slope, (got.offset - want.offset).abs() / (slope * std)]
    factor = _factor(layer)
    if got.mean is not None and want.mean is not None and factor:
        parts += [(got.mean - want.mean).abs() / (factor * std), (got.var - want.var).abs() / (factor * std * std)]
    return max(float(part.nan_to_num(0.0).max()) for part in parts)


def _factor(layer: NormLayer) -> float:
    """The weight the first forward's statistics got in the running ones (`momentum`, or the
    cumulative average's 1 / batches tracked when momentum is None)."""
    if layer.momentum is not None:
        return float(layer.momentum)
    return 1.0 / layer.tracked_after if layer.tracked_after else 0.0


def _verdict(layer: NormLayer, rank: int, world_size: int, from_own: float, from_global: float) -> str:
    allowed = tolerance(layer)
    where = f"SyncBatchNorm layer {layer.name!r} on {ranks_label([rank])}"
    group = (f" (its process group has {layer.group_size} of the {world_size} ranks)"
             if layer.group_size is not None and layer.group_size < world_size else "")
    if from_own <= allowed:
        return (f"BatchNorm is not synchronised over the {world_size} ranks: {where} normalised by its own "
                f"micro-batch's statistics, not the global batch's{group}")
    return (f"BatchNorm statistics are wrong: {where} normalised by statistics that are neither the global batch's "
            f"nor its own micro-batch's (deviation {rounded(from_global)} standard deviations, tolerance "
            f"{rounded(allowed)}){group}")
