"""initial_sync: every rank starts training from the same model, and its first step keeps it so.

DDP makes the ranks' models equal in two places: when it is built it broadcasts rank 0's parameters
and (unless `broadcast_buffers=False`, or `init_sync=False` for both) its buffers, the tensors the
module holds then; before every forward it broadcasts the buffers again (`broadcast_buffers`;
`forward_sync_buffers` from torch 2.13), re-read by name, but only if the module held a buffer when
DDP was built. The bugs are silent: per-rank init seeds with `broadcast_buffers=False` leave a random
buffer (a fixed projection, a positional table) different on every rank; a buffer registered after
wrapping a module that had none (in Lightning's `on_train_start`, after the strategy wrapped it) is
never broadcast; weights re-initialised or loaded per rank after wrapping stay apart forever, since
DDP only keeps their *updates* equal.

Evidence: the shared one-step probe fit (`shared_fit.probe`), whose recorder digests every parameter
and buffer at the first forward of the module DDP wraps (after DDP's forward-time broadcast: what
the first step computes with) and when the fit has ended (`start_watch.StartWatch`); its DDP constructor
wrapper notes which tensors the DDP took over and how it broadcasts. Judged, per tensor by name:
- at the first forward, every parameter and buffer is identical on every rank;
- after the first step, every parameter, and every buffer that DDP does not broadcast again before
  the next forward (a running statistic with the forward broadcast on is each rank's own until then,
  by design) is identical on every rank.
Tensors DDP was told to ignore (`_ddp_params_and_buffers_to_ignore`) are rank-local by design and
not compared. The verdict names the first differing tensor, the ranks, and the cause the wrap shows.
"""

from __future__ import annotations

from typing import Any

import pytest

from ...runner.ranks import ranks_label
from ..support import shared_fit
from ..support.check_context import CheckContext, all_gather, hide_on_verdict
from .start_watch import PARAMETER, StartState, StartWatch, TensorState, WrapTime

SEED_ADVICE = "seed every rank alike before building the model"
#: what this check reads of the shared probe fit (`checks.PROBE_READERS`)
PROBE_WATCHER = StartWatch
UNWRAPPED = ("the fit's micro-batches do not run through a DistributedDataParallel (the model is not wrapped, or its "
             "forward bypasses the wrapper as model.module(x))")


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    if ctx.world_size == 1:
        pytest.skip("world size 1: there is no other rank whose model could differ")
    record = shared_fit.probe(ctx)
    watch = record.watched(StartWatch)
    states = all_gather(watch.state if watch is not None else None)
    silent = [rank for rank, state in enumerate(states) if state is None]
    if silent:
        pytest.skip(f"{ranks_label(silent)} ran no training forward in the fit, so there is no model to compare at "
                    "the start of training (rank_participation judges a rank that never trains)")
    figures = _figures(states[0])
    verdict = judge(states)
    if verdict:
        raise ctx.fail(verdict, **figures)
    figures["summary"] = f"{figures['tensors_compared']} tensors equal at start"
    return figures


def _figures(state: StartState) -> dict[str, Any]:
    wrap = state.wrap
    return {"tensors_compared": sum(1 for t in state.start.values() if not t.ignored),
            "parameters": sum(1 for t in state.start.values() if t.kind == PARAMETER),
            "buffers": sum(1 for t in state.start.values() if t.kind != PARAMETER),
            "ddp_wrapped": state.wrapped,
            "ddp_broadcasts_buffers_at_forward": wrap.forward_buffers if wrap is not None else None,
            "ddp_broadcast_buffers_when_built": wrap.init_buffers if wrap is not None else None}


def judge(states: list[StartState]) -> str:
    """The verdict on every rank's start state, "" when the ranks agree."""
    return _structure(states) or _at_start(states) or _after_first_step(states)


def _structure(states: list[StartState]) -> str:
    names = set(states[0].start)
    for rank, state in enumerate(states[1:], start=1):
        extra, missing = sorted(set(state.start) - names), sorted(names - set(state.start))
        if extra or missing:
            which = f"has {extra[0]!r}, which rank 0's lacks" if extra else f"lacks rank 0's {missing[0]!r}"
            return (f"the ranks build different models: rank {rank}'s {which} (model construction depends on the "
                    "rank, so DDP cannot keep the replicas equal)")
    return ""


def _first_apart(states: list[StartState], names: list[str],
                 digest_of: Any) -> tuple[str, str, list[int], str] | None:
    """The first tensor of `names`, parameters before buffers, whose digest on some rank is not rank 0's:
    (kind, name, those ranks, how many more of its kind differ), or None when they all agree."""
    start = states[0].start
    for kind in (PARAMETER, "buffer"):
        apart = {}
        for name in (n for n in names if start[n].kind == kind):
            first = digest_of(states[0], name)
            ranks = [rank for rank, state in enumerate(states) if rank and digest_of(state, name) != first]
            if ranks:
                apart[name] = ranks
        if apart:
            name, ranks = next(iter(apart.items()))
            return kind, name, ranks, f" ({len(apart)} {kind}s in all)" if len(apart) > 1 else ""
    return None


def _at_start(states: list[StartState]) -> str:
    start = states[0].start
    found = _first_apart(states, [n for n, t in start.items() if not t.ignored], lambda s, n: s.start[n].digest)
    if found is None:
        return ""
    kind, name, ranks, more = found
    return (f"{kind} {name!r} differs between ranks at the first forward ({ranks_label(ranks)} against rank "
            f"0){more}: {_start_cause(states[0], start[name])}")


def _start_cause(state: StartState, tensor: TensorState) -> str:
    wrap: WrapTime | None = state.wrap
    noun = tensor.kind + "s"
    if not state.wrapped or wrap is None:
        return (f"{UNWRAPPED}, so nothing broadcasts rank 0's {noun}, and the ranks initialise them differently: "
                f"{SEED_ADVICE}")
    if wrap.seen and not tensor.at_wrap and tensor.kind == PARAMETER:
        return ("it was created after DDP wrapped the model, and DDP broadcasts only the parameters the module holds "
                "when it is built (nor does it all-reduce this one's gradients): create it before wrapping")
    if wrap.seen and not tensor.at_wrap and not tensor.forward_synced:
        return ("it was registered after DDP wrapped the model, and DDP broadcasts only the buffers the module held "
                "when it was built; it re-reads them before each forward only when the module held a buffer then "
                f"({'it held none' if wrap.forward_buffers else 'and forward_sync_buffers/broadcast_buffers is off'}): "
                "register it before wrapping, or make it the same on every rank")
    if tensor.kind == PARAMETER:
        if not wrap.init_sync:
            return (f"DDP was built with init_sync=False, so it never broadcast rank 0's parameters, and the ranks "
                    f"initialise them differently: {SEED_ADVICE}, or let DDP sync them")
        return ("DDP broadcast rank 0's parameters when it wrapped the model, so they were changed per rank after "
                "wrapping (re-initialised or loaded on some ranks only?)")
    if not wrap.init_buffers and not wrap.forward_buffers:
        return (f"DDP was built with broadcast_buffers=False, so it copies no buffer from rank 0, neither when built "
                f"nor before a forward, and the ranks initialise them differently: {SEED_ADVICE}")
    if not wrap.forward_buffers:
        return ("DDP broadcast it when it wrapped the model, and it was changed per rank afterwards; with "
                "forward_sync_buffers=False nothing broadcasts it again")
    return "it was changed per rank after DDP wrapped the model"


def _after_first_step(states: list[StartState]) -> str:
    start = states[0].start
    judged = [n for n, t in start.items() if not t.ignored and not t.forward_synced and n in states[0].after]
    found = _first_apart(states, judged, lambda s, n: s.after.get(n))
    if found is None:
        return ""
    kind, name, ranks, more = found
    cause = _no_gradient_cause(states, name) if not start[name].gradient else _after_cause(states[0], start[name])
    return (f"{kind} {name!r} is identical on every rank at the first forward and differs after the first optimizer "
            f"step ({ranks_label(ranks)} against rank 0){more}: {cause}")


def _no_gradient_cause(states: list[StartState], name: str) -> str:
    """Why a parameter that gets no gradient (requires_grad=False) parts the ranks in the first step."""
    changed = [rank for rank, state in enumerate(states) if state.after.get(name) != state.start[name].digest]
    kept = [rank for rank in range(len(states)) if rank not in changed]
    how = (f"it changes with no gradient on {ranks_label(changed)} and stays as it started on {ranks_label(kept)}"
           if kept else "it changes with no gradient on every rank, differently")
    return (f"a parameter that gets no gradient (requires_grad=False): {how}; DDP all-reduces gradients and never "
            "touches parameters that get none after it is built, so an EMA or teacher copy updated on one rank only "
            "(under `if rank == 0`?) parts the ranks' models: update it on every rank alike")


def _after_cause(state: StartState, tensor: TensorState) -> str:
    if tensor.kind == PARAMETER:
        if not state.wrapped:
            return f"{UNWRAPPED}, so nothing averages the ranks' gradients (rank_participation names it)"
        return ("the step's update differs per rank: its gradients are not all-reduced (rank_participation names "
                "why) or the optimizer is set up per rank")
    wrap = state.wrap
    why = ("it was registered after DDP wrapped the model, which then held no buffer" if wrap is not None
           and wrap.seen and not tensor.at_wrap and wrap.forward_buffers
           else "DDP does not broadcast buffers before a forward (broadcast_buffers/forward_sync_buffers=False)"
           if state.wrapped else UNWRAPPED)
    return (f"each rank updates it from its own micro-batch and nothing broadcasts it ({why}), so the ranks' "
            "models drift apart and a checkpoint holds rank 0's only")
