"""Evidence of a shared fit is reused only where it is the same fit: the same trainer, configuration,
plan and group, in the same rank processes, with no fit that raised or hung and no check error since
(`checks/support/shared_fit.py`, kept by `checks/support/session_evidence.py`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_conformance import plan
from ddp_conformance.checks.support import session_evidence, shared_fit
from ddp_conformance.config import RunConfig
from ddp_conformance.trainers.spec import TrainerSpec


def context(text: str = "torch", base: str = ".", world_size: int = 2, backend: str = "gloo",
            device: str = "cpu") -> Any:
    """What `evidence_key` and `held_or_run` read of a CheckContext."""
    return SimpleNamespace(spec=TrainerSpec.parse(text, Path(base)), check_id="sampler_disjointness", figures={},
                           rank_ctx=SimpleNamespace(world_size=world_size, backend=backend, device_type=device))


def test_the_key_tells_apart_every_trainer_configuration_plan_and_group() -> None:
    config = RunConfig()
    other = dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.3))
    base = shared_fit.evidence_key(context(), config, "uninterrupted", 8, None)
    variants = [
        shared_fit.evidence_key(context("lightning"), config, "uninterrupted", 8, None),
        shared_fit.evidence_key(context(base="/elsewhere"), config, "uninterrupted", 8, None),
        shared_fit.evidence_key(context(), other, "uninterrupted", 8, None),
        shared_fit.evidence_key(context(), config, "probe", 8, None),
        shared_fit.evidence_key(context(), config, "uninterrupted", 9, None),
        shared_fit.evidence_key(context(), config, "uninterrupted", 8, "epoch"),
        shared_fit.evidence_key(context(world_size=4), config, "uninterrupted", 8, None),
        shared_fit.evidence_key(context(backend="nccl"), config, "uninterrupted", 8, None),
        shared_fit.evidence_key(context(device="cuda"), config, "uninterrupted", 8, None),
    ]
    assert base == shared_fit.evidence_key(context(), RunConfig(), "uninterrupted", 8, None)
    assert len({base, *variants}) == len(variants) + 1


def test_held_evidence_is_reused_by_key_and_dropped_when_forgotten() -> None:
    session_evidence.forget()
    runs: list[str] = []

    def run(name: str) -> Any:
        return lambda: runs.append(name) or SimpleNamespace(ran_in=name)

    first, again, other = context(), context(), context("lightning")
    assert shared_fit.held_or_run(first, "fit", ("a",), run("first")).ran_in == "first"
    assert shared_fit.held_or_run(again, "fit", ("a",), run("again")).ran_in == "first"
    assert shared_fit.held_or_run(other, "fit", ("b",), run("other")).ran_in == "other"
    assert runs == ["first", "other"]
    assert (first.figures["shared_fits"], again.figures["shared_fits"]) == ({"fit": "ran here"},
                                                                           {"fit": "reused from first"})
    session_evidence.forget()
    assert shared_fit.held_or_run(context(), "fit", ("a",), run("after")).ran_in == "after"
    session_evidence.forget()


TESTS = """
import pytest
from hypothesis import given
from hypothesis import strategies as st
from types import SimpleNamespace
from ddp_conformance.checks.support import session_evidence
from ddp_conformance.checks.support import shared_fit

def context(ddp):
    rank_ctx = SimpleNamespace(world_size=ddp.world_size, backend=ddp.backend, device_type="cpu")
    return SimpleNamespace(figures={}, check_id="a check", rank_ctx=rank_ctx)

def said(ddp, name):
    ctx = context(ddp)
    shared_fit.held_or_run(ctx, "fit", ("key",), lambda: SimpleNamespace(ran_in=name))
    return ctx.figures["shared_fits"]["fit"]

@pytest.mark.ddp(world_size=2)
def test_1_runs(ddp):
    assert said(ddp, "1") == "ran here"

@pytest.mark.ddp(world_size=2)
def test_2_same_pool_reuses(ddp):
    assert said(ddp, "2") == "reused from 1"
    ddp.mark_group_unusable("this test asks for a new pool")

@pytest.mark.ddp(world_size=2)
def test_3_rebuilt_pool_runs_again(ddp):
    assert said(ddp, "3") == "ran here"

@pytest.mark.ddp(world_size=2)
def test_4_a_rank_that_lost_it_makes_every_rank_run_again(ddp):
    if ddp.rank == 1:
        session_evidence.forget()
    assert said(ddp, "4") == "ran here"
"""


def test_evidence_lives_in_the_rank_processes_and_every_rank_must_hold_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--basetemp={pytester.path / 'tmp'}")
    result.assert_outcomes(passed=4)


def test_a_failed_verdict_keeps_the_evidence_for_the_next_check(pytester: pytest.Pytester) -> None:
    """A check that fails from fits that ended normally leaves the process as a passing one does: the
    next check reads the same probe instead of fitting it again."""
    mutant = Path(__file__).resolve().parents[3] / "fixtures" / "mutants" / "ckpt_no_rng.py"
    pytester.runpytest_subprocess(
        "--pyargs", "ddp_conformance.suite", "--ddp-world-size", "2", "-p", "no:cacheprovider",
        "--ddp-trainer", f"{mutant}:Trainer", "--ddp-checks", "resume_fidelity,initial_sync",
        "--ddp-report", "report.json")
    results = {r["check"]: r for r in json.loads((pytester.path / "report.json").read_text())["results"]}
    assert results["resume_fidelity"]["outcome"] == "failed", results["resume_fidelity"]
    assert results["initial_sync"]["figures"]["shared_fits"] == {"probe": "reused from resume_fidelity"}, results


@pytest.mark.parametrize(("config", "shared"), [(None, True), pytest.param("tiny.yaml", False, marks=pytest.mark.slow)])
def test_rank_participation_s_fit_is_the_dropout_free_fit_where_the_config_has_no_dropout(
        pytester: pytest.Pytester, config: str | None, shared: bool) -> None:
    """With no dropout in the config the configured fit is the dropout-free one: one fit serves
    rank_participation and the checks that read the steady fit; with dropout (tiny.yaml) they are two."""
    options = ["--ddp-config", str(Path(__file__).resolve().parents[3] / "fixtures" / "configs" / config)] \
        if config else []
    pytester.runpytest_subprocess(
        "--pyargs", "ddp_conformance.suite", "--ddp-world-size", "2", "-p", "no:cacheprovider", "--ddp-trainer",
        "torch", "--ddp-checks", "rank_participation,bucket_cap_mb_invariance", "--ddp-report", "report.json",
        *options)
    results = {r["check"]: r for r in json.loads((pytester.path / "report.json").read_text())["results"]}
    assert results["rank_participation"]["outcome"] == "passed", results["rank_participation"]
    participation = results["rank_participation"]["figures"].get("shared_fits", {})
    steady = results["bucket_cap_mb_invariance"]["figures"]["shared_fits"]["steady"]
    if shared:
        assert participation.get("steady") == "ran here" and steady == "reused from rank_participation", results
    else:
        assert "steady" not in participation and steady == "ran here", results
    # and it watches, for hangs, the long fit the checks after it read
    assert participation["uninterrupted"] == "ran here", results


@given(epoch=st.integers(1, 10**6), cadence=st.one_of(st.none(), st.just("epoch"), st.integers(1, 50)))
def test_the_shared_fit_s_steps_stop_following_the_epoch_past_the_longest_trained_whole(
        epoch: int, cadence: int | str | None) -> None:
    """Counted, not timed: past LONG_EPOCH_STEPS the plan trains at most a constant number of steps (a trainer
    that checkpoints only at epoch ends needs the first one), the checkpoint past LONG_EPOCH_STEPS and the
    resume RESUMED_STEPS long; up to it, three whole epochs and a step, the checkpoint past the first epoch
    and the resume across an epoch end: two steps without a cadence, at least an epoch with one."""
    k, n = plan.plan_steps(epoch, cadence)
    long = plan.LONG_EPOCH_STEPS
    assert 0 < k < n
    if plan.whole_epochs(epoch):
        assert epoch <= long and n >= plan.WHOLE_EPOCHS * epoch + 1 and epoch < k
        assert n - k == 2 and k + 1 == plan.WHOLE_EPOCHS * epoch if cadence is None else n - k >= epoch
        return
    assert n - k == plan.RESUMED_STEPS
    if cadence == "epoch":
        assert k == epoch
    else:
        assert long < k <= long + (cadence if isinstance(cadence, int) else 1)
        assert n <= long + plan.RESUMED_STEPS + (cadence if isinstance(cadence, int) else 1)


def test_the_longest_epoch_trained_whole_costs_what_any_longer_one_costs_at_most() -> None:
    """The step where the plan changes: an epoch of LONG_EPOCH_STEPS + 1 trains fewer steps than one of
    LONG_EPOCH_STEPS, so that the cost is bounded by the longest epoch trained whole."""
    long = plan.LONG_EPOCH_STEPS
    assert plan.plan_steps(long + 1, None)[1] <= plan.plan_steps(long, None)[1]
    assert plan.plan_steps(long + 1, None) == plan.plan_steps(100 * long, None)
