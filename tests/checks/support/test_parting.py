"""StopOnceParted: the answer that ends a diagnostic fit early, decided once, from inputs and weights alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from ddp_conformance.checks.support.parting import StopOnceParted


class Model(torch.nn.Module):
    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__()
        for name, value in params.items():
            self.register_parameter(name, torch.nn.Parameter(value.clone()))


@dataclass
class Record:
    fed: list[str] | None = field(default_factory=list)
    params: dict[str, Any] | None = None
    micro_batches: int = 0
    iterations: int = 0

    @property
    def model(self) -> Any:
        return None if self.params is None else Model(self.params)


REFERENCE_INPUTS = ["a", "b", "c", "d"]
REFERENCE = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
OTHER = {"w": torch.tensor([1.0, -2.1]), "b": torch.tensor([0.5])}
LAST_BITS = {"w": torch.tensor([1.0, -2.0 + 2e-7]), "b": torch.tensor([0.5])}


def observer(record: Record, others: list[bool] | None = None, calls: list[bool] | None = None,
             inputs: list[str] | None = REFERENCE_INPUTS, rtol: float = 0.0) -> StopOnceParted:
    def gather(mine: bool) -> list[bool]:
        if calls is not None:
            calls.append(mine)
        return [mine, *(others or [])]

    return StopOnceParted(lambda: record, inputs, REFERENCE, rtol, lambda r: r.fed, gather)


def ran(fed: list[str] | None, params: dict[str, Any]) -> Record:
    return Record(fed, params, micro_batches=2, iterations=2)


def test_it_stops_only_where_both_the_inputs_and_the_weights_have_parted() -> None:
    assert observer(ran(["x", "b"], OTHER)).stop_requested()
    assert not observer(ran(["a", "b"], OTHER)).stop_requested()  # alike inputs: a cause of its own
    assert not observer(ran(["x", "b"], REFERENCE)).stop_requested()  # a field the model never reads
    assert not observer(ran(None, OTHER)).stop_requested()  # inputs it cannot digest
    assert not observer(ran(["x", "b"], OTHER), inputs=None).stop_requested()  # nor the reference's
    assert not observer(ran(["x"] * 5, OTHER)).stop_requested()  # fed past what the reference digested


def test_the_weights_are_compared_within_the_check_s_tolerance() -> None:
    assert observer(ran(["x", "b"], LAST_BITS)).stop_requested()  # bitwise
    assert not observer(ran(["x", "b"], LAST_BITS), rtol=5e-5).stop_requested()  # 3+ ranks on gloo
    assert observer(ran(["x", "b"], OTHER), rtol=5e-5).stop_requested()


def test_it_waits_for_the_second_iteration_then_decides_once_for_every_rank() -> None:
    record, calls = Record(["x"], OTHER, micro_batches=1, iterations=1), []
    watching = observer(record, others=[False], calls=calls)
    assert not watching.stop_requested() and calls == []
    record.fed, record.micro_batches, record.iterations = ["x", "y"], 2, 2
    assert watching.stop_requested() and calls == [True] and watching.at_micro_batch == 2
    record.fed = ["a", "b"]  # decided: asked again (every micro-batch's end), no second collective
    assert watching.stop_requested() and calls == [True]


@given(st.lists(st.booleans(), min_size=1, max_size=7))
def test_any_rank_that_parted_ends_the_run_on_every_rank(others: list[bool]) -> None:
    assert observer(ran(["a", "b"], REFERENCE), others=others).stop_requested() == any(others)
