"""The plan the suite prints before its first fit (`ddp_conformance.plan`): what it declares, and that the checks
train what it declares (`assert_as_planned`, which every nested session of test_suite.py applies to its report)."""

from __future__ import annotations

from typing import Any

import pytest

from ddp_conformance import plan
from ddp_conformance.selection import CHECK_IDS, DEFAULT_CHECKS


def assert_as_planned(results: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Every fit each check ran (its figures' "fits": label to optimizer steps) is one its plan declares, of the
    steps it declares for the epoch the check planned from (its figures' "plan"), and no more of a label than
    declared."""
    for spec, by_check in results.items():
        for check, result in by_check.items():
            figures = result.get("figures") or {}
            horizon = figures.get("plan", {})
            for label, steps in figures.get("fits", {}).items():
                fit = plan.planned(check, label)
                assert fit is not None, f"{spec} {check}: fit {label!r} ({steps} steps) is not in its plan"
                expected = fit.steps if isinstance(fit.steps, int) else {
                    "k": horizon.get("k"), "n": horizon.get("n"),
                    "n-k": horizon.get("n", 0) - horizon.get("k", 0)}[fit.steps]
                assert steps == expected, f"{spec} {check}: fit {label!r} trained {steps} steps, planned {expected}"
            for fit in plan.CHECK_FITS[check]:
                ran = [label for label in figures.get("fits", {}) if fit.matches(label)]
                assert len(ran) <= fit.most, f"{spec} {check}: {len(ran)} fits {fit.label}, planned {fit.most}"


def test_every_check_has_a_plan_and_a_short_one_under_the_cap() -> None:
    assert set(plan.CHECK_FITS) == set(CHECK_IDS)
    assert plan.most_steps("initial_sync") == 1
    assert plan.most_steps("sampler_disjointness") == plan.longest_planned_fit() == 3 * plan.LONG_EPOCH_STEPS + 1
    assert plan.most_steps("resume_fidelity", "epoch") is None  # a fit to the first epoch's end grows with it


@pytest.mark.parametrize("cadence", [None, 1, 7, 25])
def test_the_longest_fit_does_not_grow_with_the_epoch(cadence: int | None) -> None:
    longest = plan.longest_planned_fit(cadence)
    assert longest is not None
    assert all(plan.plan_steps(epoch, cadence)[1] <= longest for epoch in (1, 10, 100, 10_000, 10**6))


def test_the_header_is_a_summary_and_under_v_each_check_s_fits() -> None:
    short = plan.header_lines(DEFAULT_CHECKS, 2, 4, None, verbose=False)
    assert short[0].startswith(f"ddp-conformance plan: {len(DEFAULT_CHECKS)} checks x 2 trainer(s) at world size 4")
    assert "(probe, steady, uninterrupted)" in short[0] and "at most 73 optimizer steps" in short[0]
    assert short[-1] == "  (-v lists each check's fits)"
    full = plan.header_lines(DEFAULT_CHECKS, 1, 2, 24, verbose=True)
    assert "  --ddp-max-steps 24: sampler_disjointness, resume_fidelity, elastic_resume skip where a fit needs more" \
        in full
    rows = {line.split()[0]: line for line in full if line.startswith("  ") and line.split()[0] in CHECK_IDS}
    assert list(rows) == list(DEFAULT_CHECKS)
    assert "probe 1 step, shared; uninterrupted n steps, shared" in rows["sampler_disjointness"]
    assert "bucket-cap-* 3 steps, up to 3 of them" in rows["bucket_cap_mb_invariance"]
    only_probe = plan.header_lines(("initial_sync",), 1, 2, 1, verbose=False)
    assert "(probe)" in only_probe[0] and "every fit of the plan fits" in only_probe[1]


def test_a_fit_the_plan_does_not_declare_or_of_other_steps_is_caught() -> None:
    ran = {"figures": {"plan": {"epoch_steps": 8, "k": 13, "n": 25},
                       "fits": {"probe": 1, "uninterrupted": 25, "resumed": 12}}}
    assert_as_planned({"torch": {"resume_fidelity": ran}})
    with pytest.raises(AssertionError, match="fit 'resumed' trained 11 steps, planned 12"):
        assert_as_planned({"torch": {"resume_fidelity": {"figures": {**ran["figures"], "fits": {"resumed": 11}}}}})
    with pytest.raises(AssertionError, match=r"fit 'extra' .* is not in its plan"):
        assert_as_planned({"torch": {"initial_sync": {"figures": {"fits": {"extra": 1}}}}})
    caps = {f"bucket-cap-{cap}": 3 for cap in (1, 2, 3, 4)}
    with pytest.raises(AssertionError, match="4 fits bucket-cap-\\*, planned 3"):
        assert_as_planned({"torch": {"bucket_cap_mb_invariance": {"figures": {"fits": caps}}}})
