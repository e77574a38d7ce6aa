"""`--ddp-max-steps` (ini `ddp_max_steps`): no fit of a check trains more optimizer steps than the cap; a
check whose plan needs more skips before that fit, naming the steps it needs. Counted, not timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONFIG = Path(__file__).with_name("suite.yaml")
PLANNED_SKIPS = "  --ddp-max-steps 24: sampler_disjointness, resume_fidelity skip where a fit needs more"


def run_suite(pytester: pytest.Pytester, *args: str, config: Path = CONFIG) -> dict[str, dict]:
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "--ddp-trainer", "torch",
        "--ddp-checks", "rank_participation,sampler_disjointness,resume_fidelity", f"--ddp-config={config}",
        "--ddp-timeout", "60", f"--ddp-report={report}", "-rs", *args)
    assert result.ret == 0, result.stdout.str()
    pytester.path.joinpath("stdout.txt").write_text(result.stdout.str())
    return {entry["check"]: entry for entry in json.loads(report.read_text())["results"]}


def test_a_check_whose_fit_needs_more_steps_than_the_cap_skips_naming_them(pytester: pytest.Pytester) -> None:
    """The torch reference's epoch is 8 steps at world size 2: the fit sampler_disjointness and resume_fidelity
    share trains 25 (three epochs and a step), rank_participation's 3."""
    pytester.makeini("[pytest]\nddp_max_steps = 24\n")
    results = run_suite(pytester)
    assert results["rank_participation"]["outcome"] == "passed"
    assert PLANNED_SKIPS in pytester.path.joinpath("stdout.txt").read_text()  # said in the plan, before the fits
    for check in ("sampler_disjointness", "resume_fidelity"):
        assert results[check]["outcome"] == "skipped"
        assert results[check]["message"].startswith(
            f"{check} needs a fit of 25 optimizer steps ('uninterrupted')"), results[check]["message"]
        assert "more than --ddp-max-steps 24 allows" in results[check]["message"]


@pytest.mark.slow  # the cap's skip is the default run's; that a cap the plan fits in changes nothing, the slow run's
def test_a_cap_the_plan_fits_in_changes_no_verdict(pytester: pytest.Pytester) -> None:
    results = run_suite(pytester, "--ddp-max-steps", "25")
    assert {check: entry["outcome"] for check, entry in results.items()} == dict.fromkeys(results, "passed")
    assert results["resume_fidelity"]["figures"]["final_step"] == 25


@pytest.mark.slow  # plan_steps is counted in the default run (test_shared_fit.py); the checks' own counts here
def test_the_steps_the_checks_train_do_not_grow_with_the_epoch(pytester: pytest.Pytester) -> None:
    """The torch reference at 100 and at 1,000 optimizer steps an epoch (800 and 8,000 samples at world size 2):
    every check observes as many steps at both, with the same verdicts; counted from the report's figures."""
    observed = {}
    for samples in (800, 8000):
        config = pytester.path / f"epoch_{samples}.yaml"
        config.write_text(CONFIG.read_text() + f"data:\n  size: {samples}\n")
        results = run_suite(pytester, config=config)
        assert results["resume_fidelity"]["figures"]["epoch_steps"] == samples // 8
        observed[samples] = {check: (entry["outcome"], entry["figures"]["observed_steps"])
                             for check, entry in results.items()}
    assert observed[800] == observed[8000]
    assert all(outcome == "passed" for outcome, _ in observed[800].values()), observed
