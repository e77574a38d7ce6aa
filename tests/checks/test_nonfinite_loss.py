"""nonfinite_loss's judgement on made-up evidence: each verdict it gives, for every world size, and what
passes. A rank's evidence: where the poison struck, its micro-batch count, and its parameters (finite,
digest) as each micro-batch began and at the end."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_conformance.checks.nonfinite_loss import judge

FINE, NAN = (True, "a"), (False, "n")


def rank(states: list[tuple[bool, str]], struck: int | None = None, micro_batches: int = 3) -> dict[str, Any]:
    return {"struck": struck, "module": "Linear", "micro_batches": micro_batches, "optimizer_steps": 3,
            "states": states}


def world(size: int, states: list[tuple[bool, str]], last_states: list[tuple[bool, str]] | None = None,
          last_micro_batches: int = 3) -> list[dict[str, Any]]:
    """`size` ranks alike, the last one poisoned (at micro-batch 2), with its own evidence where given."""
    ranks = [rank(states) for _ in range(size)]
    ranks[-1] = rank(last_states or states, struck=2, micro_batches=last_micro_batches)
    return ranks


@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_rank_alike_and_finite_passes(size: int) -> None:
    assert judge(world(size, [FINE, FINE, FINE]), size - 1) == ""


@pytest.mark.parametrize("size", [2, 4])
def test_every_rank_ending_nan_stepped_on_it(size: int) -> None:
    verdict = judge(world(size, [FINE, NAN, NAN]), size - 1)
    assert "and every rank stepped on it" in verdict and f"DDP averaged rank {size - 1}'s NaN gradients" in verdict


def test_one_process_ending_nan_is_named_without_ddp() -> None:
    verdict = judge(world(1, [FINE, NAN, NAN]), 0)
    assert "and the loop stepped on it" in verdict and "DDP" not in verdict


def test_a_rank_that_ran_more_micro_batches_dropped_its_batch_alone() -> None:
    verdict = judge(world(4, [FINE] * 3, last_states=[FINE] * 4, last_micro_batches=4), 3)
    assert "rank 3 dropped that batch alone: it ran 4 micro-batches, ranks 0, 1, 2 3," in verdict


def test_ranks_whose_parameters_differ_but_stay_finite_went_apart() -> None:
    verdict = judge(world(2, [FINE, FINE, FINE], last_states=[FINE, (True, "b"), (True, "b")]), 1)
    assert "rank 1 goes on with other parameters than rank 0" in verdict


def test_a_nan_that_never_reached_the_model_s_output_is_a_skip_not_a_pass() -> None:
    ranks = world(2, [FINE, FINE, FINE])
    ranks[-1]["reached"] = False
    with pytest.raises(pytest.skip.Exception, match="did not reach the model's output"):
        judge(ranks, 1)
    ranks[-1]["reached"] = None  # no floating-point output to read (a training_step that returned None): judged
    assert judge(ranks, 1) == ""


def test_the_poison_never_striking_is_a_skip() -> None:
    with pytest.raises(pytest.skip.Exception, match="no loss could be made non-finite"):
        judge([rank([FINE]), rank([FINE])], 1)


@given(st.integers(2, 8).flatmap(lambda size: st.tuples(st.just(size), st.sets(st.integers(0, size - 1), min_size=1,
                                                                                max_size=size - 1))))
def test_finite_ranks_beside_nan_ranks_are_named_exactly(case: tuple[int, set[int]]) -> None:
    size, finite = case
    ranks = [rank([FINE, FINE if r in finite else NAN, FINE if r in finite else NAN], struck=2 if r == size - 1
                  else None) for r in range(size)]
    verdict = judge(ranks, size - 1)
    kept = sorted(finite)
    label = f"rank {kept[0]}" if len(kept) == 1 else f"ranks {', '.join(map(str, kept))}"
    assert f"the ranks acted on it apart: {label} kept finite parameters while" in verdict, verdict
