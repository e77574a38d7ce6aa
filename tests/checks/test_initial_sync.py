"""initial_sync's judgement on made-up start states: each cause it names, and what it must leave alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddp_conformance.checks.initial_sync import judge
from ddp_conformance.checks.initial_sync.start_watch import BUFFER, PARAMETER, StartState, TensorState, WrapTime

DEFAULT_WRAP = WrapTime(frozenset(), frozenset(), init_sync=True, init_buffers=True, forward_buffers=True,
                        had_buffers=True)
NO_INIT_SYNC = replace(DEFAULT_WRAP, init_sync=False)
NO_BUFFERS_AT_WRAP = replace(DEFAULT_WRAP, had_buffers=False)


def state(params: dict[str, str], buffers: dict[str, str] | None = None, *, after: dict[str, str] | None = None,
          wrap: WrapTime | None = DEFAULT_WRAP, late: tuple[str, ...] = (), ignored: tuple[str, ...] = (),
          wrapped: bool = True) -> StartState:
    """A rank's state: digests by name; `late` tensors were added after DDP was built."""
    start = {}
    for kind, tensors in ((PARAMETER, params), (BUFFER, buffers or {})):
        for name, digest in tensors.items():
            synced = kind == BUFFER and wrap is not None and wrap.forward_buffers and wrap.had_buffers
            start[name] = TensorState(kind, digest, name not in late, name in ignored, synced and name not in ignored)
    return StartState(wrapped, wrap, start, after if after is not None else {n: t.digest for n, t in start.items()})


def test_identical_ranks_pass() -> None:
    assert judge([state({"w": "a"}, {"b": "x"}), state({"w": "a"}, {"b": "x"})]) == ""


def test_a_model_built_differently_names_the_tensor_one_rank_lacks() -> None:
    verdict = judge([state({"w": "a", "head": "h"}), state({"w": "a"})])
    assert "the ranks build different models" in verdict and "lacks rank 0's 'head'" in verdict


@pytest.mark.parametrize(("wrap", "late", "words"), [
    (DEFAULT_WRAP, ("w",), "created after DDP wrapped the model"),
    (NO_INIT_SYNC, (), "init_sync=False"),
    (DEFAULT_WRAP, (), "changed per rank after wrapping"),
])
def test_a_parameter_that_differs_at_the_start_names_why(wrap: WrapTime, late: tuple[str, ...], words: str) -> None:
    verdict = judge([state({"w": "a"}, wrap=wrap, late=late), state({"w": "b"}, wrap=wrap, late=late)])
    assert verdict.startswith("parameter 'w' differs between ranks at the first forward (rank 1 against rank 0)")
    assert words in verdict


def test_a_buffer_with_broadcast_buffers_off_is_blamed_on_the_flag() -> None:
    off = replace(DEFAULT_WRAP, init_buffers=False, forward_buffers=False)
    verdict = judge([state({"w": "a"}, {"proj": "p0"}, wrap=off), state({"w": "a"}, {"proj": "p1"}, wrap=off)])
    assert "buffer 'proj' differs" in verdict and "broadcast_buffers=False" in verdict


def test_a_buffer_registered_after_wrapping_a_module_without_buffers_is_named_so() -> None:
    """DDP re-reads the module's buffers before each forward only if it held one when DDP was built."""
    ranks = [state({"w": "a"}, {"stats": f"s{r}"}, late=("stats",), wrap=NO_BUFFERS_AT_WRAP) for r in range(2)]
    verdict = judge(ranks)
    assert "registered after DDP wrapped the model" in verdict and "it held none" in verdict


def test_an_unwrapped_model_is_named_as_such() -> None:
    verdict = judge([state({"w": "a"}, wrap=None, wrapped=False), state({"w": "b"}, wrap=None, wrapped=False)])
    assert "do not run through a DistributedDataParallel" in verdict


def test_a_running_statistic_ddp_broadcasts_before_the_next_forward_may_differ_after_the_step() -> None:
    """BatchNorm's running mean with the forward broadcast on: each rank's own until DDP copies rank 0's."""
    ranks = [state({"w": "a"}, {"bn.running_mean": "m"}, after={"w": "a2", "bn.running_mean": f"m{r}"})
             for r in range(2)]
    assert judge(ranks) == ""


def test_a_running_statistic_nothing_broadcasts_fails_after_the_step() -> None:
    off = replace(DEFAULT_WRAP, forward_buffers=False)
    ranks = [state({"w": "a"}, {"norm.mean": "m"}, after={"w": "a2", "norm.mean": f"m{r}"}, wrap=off)
             for r in range(2)]
    verdict = judge(ranks)
    assert "buffer 'norm.mean' is identical on every rank at the first forward and differs after" in verdict
    assert "forward_sync_buffers=False" in verdict


def test_parameters_that_part_in_the_first_step_point_at_rank_participation() -> None:
    ranks = [state({"w": "a"}, after={"w": f"a{r}"}) for r in range(3)]
    verdict = judge(ranks)
    assert "ranks 1, 2" in verdict or "ranks 1 and 2" in verdict, verdict
    assert "rank_participation" in verdict


def test_tensors_ddp_ignores_are_rank_local_by_design() -> None:
    ranks = [state({"w": "a", "local": f"l{r}"}, ignored=("local",), after={"w": "a", "local": f"l{r}x"})
             for r in range(2)]
    assert judge(ranks) == ""
