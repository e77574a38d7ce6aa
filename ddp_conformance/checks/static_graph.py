"""static_graph: where the config turns `static_graph` on, the fit's DDP has it and trains as without
it; where the config leaves it off, whether the trainer's model could take it.

The guides turn `static_graph: true` on "if the model structure is fixed", for speed: DDP records the
first iteration's graph (which parameters get gradients) and relies on it from the second iteration
on. What breaks it, measured on torch 2.13 (docs/checks/static_graph.md): a parameter used in some iterations and
not in others ("Your training graph has changed", or "Expected to have finished reduction" one
iteration later), and `no_sync` in the first iteration, as stock Lightning's DDPStrategy does with
`accumulate_grad_batches > 1` (an INTERNAL ASSERT in DDP's reducer, pytorch#143580). All of these
raise; none was seen to train on silently. What does go silently wrong is a `static_graph: true`
that never reaches DDP: a strategy or wrap that lists the DDP kwargs by hand.

Runs: the dropout-free fit other checks share (`shared_fit.steady`, `STEPS` optimizer steps with the
config's setting) and the same fit with the setting flipped. The fit without a static graph runs with
`find_unused_parameters=True`, DDP's mode for any graph, so that a model whose parameters are
consistently unused (which a static graph handles) trains there too. The two final states
(parameters and buffers) are compared per tensor, relative to each tensor's largest value, within
`TOLERANCE` (an all-reduce per micro-batch against one per accumulation window sums in another
order; measured: docs/checks/static_graph.md). The static fit's DDP must report the flag.

The setting judged is the trainer's own: its config after its own `setup` (the `--ddp-config` file,
or what the trainer made of it).

Where the config leaves it off, the flipped fit runs only under `--ddp-advise` (it is advice, not a
verdict, and costs a fit); without it the check skips saying so.

Verdicts: where the config sets `static_graph: true`, a fit that raises with it while the fit without
it trains, or that ends elsewhere, fails, naming the cause (the error's first line; `no_sync` in the
first iteration where the recorder saw it); a flag that never reaches DDP fails. Where the config
leaves it off, the same findings are a skip that says whether it could be turned on. A fit that
raises either way is the trainer's error, not this check's verdict. A comparison fit that cannot run
is not the trainer's failure: where the config sets `static_graph: true`, the static fit trains and the
fit without it raises (a model that needs the setting: a block run twice under reentrant activation
checkpointing marks its parameters ready twice without a static graph), the check judges what it
can, that the flag reaches DDP and the fit trains, and notes that nothing was compared. Skips, with the reason: a world
of one (no DDP reducer to rely on a graph), a trainer that runs its own command line (the harness
cannot set its flag), a fit through no DDP, a trainer whose DDP ignores the config's flag when the
config sets none.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..adapter import TrainState
from .support import shared_fit
from .support.adapter_errors import AdapterError
from .support.check_context import CheckContext, all_gather, hide_on_verdict, rounded
from .support.first_steps import final_floats, own_config, with_strategy
from .support.fit_record import FitRecord
from .support.gradients import max_delta
from .support.progress import PeerFitFailed, guarded_fit
from .support.reproducible import require_reproducible

#: optimizer steps of each fit: DDP records the graph in the first iteration and relies on it from the second
STEPS = shared_fit.STEADY_STEPS
#: the largest relative difference per tensor between the two fits that counts as summation order: measured on
#: CPU (gloo) up to 4.6e-7 on the references, every config, and 6.2e-6 on Lightning's demo transformer at world
#: size 3, 2.6e-7 on an H100 (docs/checks/static_graph.md); no model was seen to train differently with a static graph
#: without raising
TOLERANCE = 1e-4
ISSUE_143580 = "https://github.com/pytorch/pytorch/issues/143580"
ADVICE = "--ddp-advise runs the fit with static_graph=True too, to say whether the model could take it"


class _Fit:
    """One side of the comparison: its final state (None: it raised) and its record."""

    def __init__(self, state: TrainState | None, record: FitRecord | None,
                 error: AdapterError | PeerFitFailed | None) -> None:
        self.state, self.record, self.error = state, record, error

    @property
    def static(self) -> bool | None:
        """What the fit's DDP reports (None: the fit ran through no DDP)."""
        if self.record is None or self.record.ddp is None:
            return None
        return bool(self.record.ddp.get("static_graph"))


def run(ctx: CheckContext) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    if ctx.world_size == 1:
        pytest.skip("world size 1: no gradient is all-reduced, so DDP's reducer has no graph to rely on")
    config = shared_fit.steady_config(ctx)
    own = own_config(ctx, config)
    configured = bool(own.trainer.strategy.static_graph)
    if not ctx.takes_config:
        pytest.skip(f"trainer {ctx.spec.label} runs its own command line, not the harness's config: the harness "
                    "cannot set its static_graph")
    if not configured and not ctx.advise:
        pytest.skip(f"static_graph is off in the config: nothing to judge ({ADVICE})")
    steady = _steady(ctx)
    flipped = with_strategy(config, static_graph=not configured,
                            **({} if not configured else {"find_unused_parameters": True}))
    other = _fit(ctx, "static-graph-flipped", ctx.adapter(flipped))
    static, dynamic = (steady, other) if configured else (other, steady)
    if dynamic.error is not None and (static.error is not None or not configured):
        raise static.error if configured else dynamic.error  # the trainer's own setting raised: its own error
    if dynamic.error is not None:
        return _needs_static_graph(ctx, static, dynamic)
    if None in all_gather(dynamic.static):
        pytest.skip("the fit's micro-batches run through no DistributedDataParallel, so there is no static_graph "
                    "(rank_participation judges the wrapping)")
    figures: dict[str, Any] = {"steps": STEPS, "configured": configured}
    if any(all_gather(dynamic.static)):  # asked for False, its DDP still has it: nothing to compare with
        ctx.note("the trainer's DDP keeps static_graph on when the config turns it off: the fit is not compared with "
                 "one without it")
        figures.update(static_fit="trained", summary="static graph: reaches DDP, trained")
        return figures
    if static.error is None and not all(all_gather(static.static)):
        if configured:
            raise ctx.fail("static_graph: true never reaches DDP: the DistributedDataParallel the fit builds reports "
                           "static_graph=False (does the fit build its DDP, or a Lightning strategy's, from kwargs "
                           "listed by hand?)", **figures)
        pytest.skip("the trainer's DDP does not take static_graph from the config (asked for True, its DDP reports "
                    "False): there is nothing to compare")
    problem = _raised(static) if static.error is not None else _compare(ctx, static, dynamic, figures)
    return _conclude(ctx, configured, problem, figures)


def _needs_static_graph(ctx: CheckContext, static: _Fit, dynamic: _Fit) -> dict[str, Any]:
    """The configured static fit trained and the fit without a static graph raised: the model needs the setting
    (reentrant activation checkpointing of a block used twice, say), so there is no fit to compare with. What is
    judged: the flag reaches DDP and the fit trains."""
    __tracebackhide__ = hide_on_verdict
    figures: dict[str, Any] = {"steps": STEPS, "configured": True, "static_fit": "trained",
                               "dynamic_fit": "raised"}
    reported = all_gather(static.static)
    if None in reported:
        pytest.skip("the fit's micro-batches run through no DistributedDataParallel, so there is no static_graph "
                    "(rank_participation judges the wrapping)")
    if not all(reported):
        raise ctx.fail("static_graph: true never reaches DDP: the DistributedDataParallel the fit builds reports "
                       "static_graph=False", **figures)
    ctx.note(f"the same fit with static_graph=False (find_unused_parameters=True) raised "
             f"({_first_line(dynamic.error)}): this model trains only with a static graph (reentrant activation "
             "checkpointing, say), so its fit is not compared with one without it")
    figures["summary"] = "static graph: reaches DDP, trained (needed)"
    return figures


def _first_line(error: BaseException | None) -> str:
    """An error's cause (a fit's `AdapterError` chains the trainer's own), as its type and first line."""
    cause = error.__cause__ if error is not None and error.__cause__ else error
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0][:200] if text else ''}".rstrip(": ")


def _steady(ctx: CheckContext) -> _Fit:
    try:
        steady = shared_fit.steady(ctx)
    except (AdapterError, PeerFitFailed) as exc:  # the latter: another rank's fit raised, this one's ended
        return _Fit(None, ctx.recordings.get("steady"), exc)
    return _Fit(steady.state, steady.record, None)


def _fit(ctx: CheckContext, label: str, adapter: Any) -> _Fit:
    try:
        state, _ = guarded_fit(ctx, label, STEPS, lambda observer: adapter.fit(STEPS, observer=observer))
    except (AdapterError, PeerFitFailed) as exc:  # the latter: another rank's fit raised, this one's ended
        return _Fit(None, ctx.recordings.get(label), exc)
    return _Fit(state, ctx.recordings[label], None)


def _compare(ctx: CheckContext, static: _Fit, dynamic: _Fit, figures: dict[str, Any]) -> str:
    assert static.state is not None and dynamic.state is not None
    name, delta, scale = max_delta(final_floats(static.state), final_floats(dynamic.state))
    relative = max(all_gather(delta / scale if scale else 0.0))
    figures.update(max_rel_delta=relative, worst_tensor=name, static_fit="trained")
    if relative <= TOLERANCE:
        return ""
    require_reproducible(ctx, "static_graph", TOLERANCE)  # collective: `relative` is every rank's
    return (f"with static_graph=True the fit ends elsewhere after {STEPS} steps ({name} differs by "
            f"{rounded(relative)} of its largest value from the fit without it, summation order allows "
            f"{rounded(TOLERANCE)})")


def _raised(static: _Fit) -> str:
    """The cause of the static fit's error, in words: no_sync in the first iteration, or a graph that changes."""
    record = static.record
    raised = _first_line(static.error)
    if record is not None and record.optimizer_steps == 0 and record.synced and not record.synced[0]:
        return ("its first micro-batch runs under no_sync(), and a fresh static-graph DDP cannot start an "
                f"accumulation window under no_sync (pytorch#143580, {ISSUE_143580}; stock Lightning's DDPStrategy "
                "does this with accumulate_grad_batches > 1): sync every micro-batch while static_graph is on. "
                f"DDP raised in the first iteration: {raised}")
    return ("the model's graph is not the same every iteration (a parameter used in some iterations and not in "
            f"others). DDP raised during the fit: {raised}")


def _conclude(ctx: CheckContext, configured: bool, problem: str, figures: dict[str, Any]) -> dict[str, Any]:
    __tracebackhide__ = hide_on_verdict
    problems = [p for p in all_gather(problem) if p]
    figures.setdefault("static_fit", "raised")
    if problems and configured:
        raise ctx.fail(f"static_graph: true does not hold for this model: {problems[0]}", **figures)
    ctx.figures.update(figures)
    if problems:
        pytest.skip(f"static_graph is off in the config, and this model cannot take it: {problems[0]}")
    if not configured:
        pytest.skip(f"static_graph is off in the config; the model can take it: with static_graph=True its fit "
                    f"ends where it ends without it after {STEPS} steps (max relative difference "
                    f"{rounded(figures['max_rel_delta'])})")
    figures["summary"] = f"static graph: same {STEPS} steps"
    return figures
