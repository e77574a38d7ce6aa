"""A check's watchers hear the fit at the moments they override, each fit its own, and the recorder knows none."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from ddp_conformance.checks.support.fit_watch import HOOKS, FitPlan, FitWatcher, overridden

SUPPORT = Path(__file__).resolve().parents[3] / "ddp_conformance" / "checks" / "support"


class Heard(FitWatcher):
    """Every hook, as (hook, what it was told)."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, Any]] = []

    def on_model(self, model: Any, record: Any) -> None:
        self.heard.append(("model", (model is record.model, record.micro_batches)))

    def on_forward(self, module: Any, depth: int, record: Any) -> None:
        self.heard.append(("forward", (type(module).__name__, depth, record.micro_batches)))

    def on_forward_end(self, module: Any, args: Any, output: Any, record: Any) -> None:
        self.heard.append(("forward_end", (type(module).__name__, tuple(output.shape))))

    def on_wrap(self, ddp: Any, module: Any, arguments: Any) -> None:
        self.heard.append(("wrap", (ddp.module is module, arguments.arguments["bucket_cap_mb"])))

    def on_step(self, record: Any) -> None:
        self.heard.append(("step", (record.optimizer_steps, record.iterations)))

    def on_end(self, record: Any) -> None:
        self.heard.append(("end", record.micro_batches))


class StepsOnly(FitWatcher):
    def __init__(self) -> None:
        self.steps = 0

    def on_step(self, record: Any) -> None:
        self.steps += 1


def _fit(plan: FitPlan, steps: int = 2) -> Any:
    import torch
    from torch import nn

    from ddp_conformance.checks.support.observe import FitRecorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder(plan=plan) as recorder:
        for _ in range(steps):
            model(torch.randn(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return recorder.record


def test_a_watcher_hears_each_moment_of_the_fit_in_order():
    record = _fit(FitPlan(watchers=(Heard,)))
    watcher = record.watched(Heard)
    assert watcher is not None and record.watched(StepsOnly) is None
    first_micro_batch = [("model", (True, 0)), ("forward", ("Sequential", 0, 1)), ("forward", ("Linear", 1, 1)),
                         ("forward_end", ("Linear", (2, 4))), ("forward", ("ReLU", 1, 1)),
                         ("forward_end", ("ReLU", (2, 4))), ("forward_end", ("Sequential", (2, 4))),
                         ("step", (1, 1))]
    assert watcher.heard[:len(first_micro_batch)] == first_micro_batch
    assert [h for h in watcher.heard if h[0] in ("model", "step", "end")] == [
        ("model", (True, 0)), ("step", (1, 1)), ("step", (2, 2)), ("end", 2)]


def test_each_fit_gets_watchers_of_its_own_and_a_plan_without_any_keeps_none():
    plan = FitPlan(watchers=(StepsOnly,))
    first, second = _fit(plan, steps=3), _fit(plan, steps=2)
    assert (first.watched(StepsOnly).steps, second.watched(StepsOnly).steps) == (3, 2)
    assert first.watched(StepsOnly) is not second.watched(StepsOnly)
    assert _fit(FitPlan()).watchers == []
    assert plan.watching(Heard).watchers == (StepsOnly, Heard) and plan.watchers == (StepsOnly,)


def test_a_watcher_is_called_only_at_the_hooks_it_overrides():
    assert [hook for hook in HOOKS if overridden(StepsOnly(), hook)] == ["on_step"]
    assert [hook for hook in HOOKS if overridden(Heard(), hook)] == list(HOOKS)


@pytest.mark.ddp(world_size=2)
def test_a_watcher_hears_each_ddp_built_in_the_fit_with_its_arguments(ddp):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_conformance.checks.support.observe import FitRecorder

    with FitRecorder(plan=FitPlan(watchers=(Heard,))) as recorder:
        model = DDP(nn.Linear(3, 1), bucket_cap_mb=5)
        model(torch.randn(2, 3)).sum().backward()
    heard = recorder.record.watched(Heard).heard
    assert heard[0] == ("wrap", (True, 5)) and heard[1] == ("model", (True, 0))


def test_the_recorder_and_its_record_know_no_check():
    """A check's needs reach the recorder only as watchers: no module of the recorder imports a check."""
    for name in ("observe.py", "fit_record.py", "fit_watch.py", "digests.py"):
        tree = ast.parse((SUPPORT / name).read_text())
        imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert [node.module for node in imports if _reaches_a_check(node)] == [], name
    told = {line: _reaches_a_check(ast.parse(line).body[0]) for line in (  # type: ignore[arg-type]
        "from ..sync_batchnorm.norm_watch import NormWatch", "from ...checks.initial_sync import x",
        "from ddp_conformance.checks.resume_fidelity import x", "from ..support.fit_watch import x",
        "from .fit_watch import x", "from ...adapter import x", "from ddp_conformance.checks.support import x")}
    assert list(told.values()) == [True, True, True, False, False, False, False]


def _reaches_a_check(node: ast.ImportFrom) -> bool:
    """Whether an import in `checks/support/` names a check: `..x` (a sibling of support), or the same through the
    package root or by its absolute name."""
    module = node.module or ""
    if node.level == 2:
        return not module.startswith("support")
    inside_checks = module.removeprefix("ddp_conformance.") if node.level == 0 else module
    if node.level == 1 or not inside_checks.startswith("checks"):
        return False
    return not inside_checks.startswith("checks.support")


def test_the_recorder_takes_a_listener_a_rank_and_one_plan():
    from ddp_conformance.checks.support.observe import FitRecorder
    from ddp_conformance.checks.support.progress import guarded_fit

    assert list(inspect.signature(FitRecorder).parameters) == ["listener", "rank", "plan"]
    assert list(inspect.signature(guarded_fit).parameters) == ["ctx", "label", "steps", "call", "plan", "inner"]


@pytest.mark.parametrize(("readers", "declared"), [("PROBE_READERS", "PROBE_WATCHER"),
                                                   ("LONG_FIT_READERS", "LONG_FIT_WATCHERS")])
def test_every_check_that_reads_a_shared_fit_through_a_watcher_is_among_its_readers(readers: str, declared: str):
    """The shared fits carry their readers' watchers: a check with a `PROBE_WATCHER` (or `LONG_FIT_WATCHERS`) left
    out of `checks.PROBE_READERS` (`LONG_FIT_READERS`) would find nothing in a fit another check ran first."""
    import ddp_conformance.checks as checks
    from ddp_conformance.selection import CHECK_IDS

    watching = [check_id for check_id in CHECK_IDS
                if hasattr(importlib.import_module(f"ddp_conformance.checks.{check_id}"), declared)]
    assert sorted(watching) == sorted(getattr(checks, readers))
    assert all(FitWatcher in type(make()).__mro__ for make in checks.probe_watchers())
    planned = [make() for plan in checks.long_fit_watchers() for make in plan(10, 20, 10)]
    assert [type(w).__name__ for w in planned] == ["StepDigests", "SnapshotAt", "ParamsAt"]
    assert [type(w).__name__ for plan in checks.long_fit_watchers() for w in (m() for m in plan(10, 11, None))] == [
        "StepDigests"]  # no checkpoint on the way; k + parting.STEPS past n
