"""The replica state outside the gradients: training flags and parameters without gradient, as the recorder sees them
in one process, and the verdicts on made-up trails of several ranks."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ddp_conformance.checks.initial_sync import judge
from ddp_conformance.checks.initial_sync.start_watch import PARAMETER, StartState, TensorState
from ddp_conformance.checks.support.observe import FitRecorder
from ddp_conformance.checks.support.replica_watch import (
    FrozenChange,
    ModeChange,
    ReplicaTrail,
    frozen_changers,
    modes_apart,
    modes_resumed,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 0, 1])).backward()
    optimizer.step()
    optimizer.zero_grad()


def _evaluate(model: nn.Module) -> None:
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 4))


def test_a_model_left_in_eval_mode_still_trains_its_micro_batches_and_the_change_is_named() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder() as recorder:
        _step(model, optimizer)
        _step(model, optimizer)
        _evaluate(model)  # and no model.train()
        model(torch.randn(4, 4))  # an evaluation that forgets no_grad: never backpropagated, never a micro-batch
        _step(model, optimizer)
        _step(model, optimizer)
    record = recorder.record
    assert record.micro_batches == 4 and record.optimizer_steps == 4
    trail = record.replicas
    assert trail.eval_micro_batches == 2
    assert [(c.step, c.eval_count) for c in trail.modes] == [(1, 0), (3, 5)]
    change = trail.modes[1]
    assert change.eval_modules[:2] == ("1 (BatchNorm1d)", "2 (Dropout)") and change.modules == 5
    assert change.eval_call is not None and change.eval_call.startswith("test_replica_watch.py:")
    assert change.eval_call.endswith(" in _evaluate")


def test_a_model_that_returns_to_training_mode_records_no_change() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder() as recorder:
        _step(model, optimizer)
        _evaluate(model)
        model.train()
        _step(model, optimizer)
    assert [(c.step, c.eval_count) for c in recorder.record.replicas.modes] == [(1, 0)]
    assert recorder.record.replicas.eval_micro_batches == 0


class _WithTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(4, 2)
        self.teacher = nn.Linear(4, 2).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x) + self.teacher(x)


def test_parameters_that_change_with_no_gradient_are_seen_with_the_step() -> None:
    model = _WithTeacher()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder() as recorder:
        for _ in range(3):
            _step(model, optimizer)
            with torch.no_grad():
                model.teacher.weight.data.mul_(0.5)  # an EMA update through .data: no version bump
    trail = recorder.record.replicas
    assert trail.frozen_names == ["teacher.weight", "teacher.bias"]
    assert [(c.step, c.names) for c in trail.frozen] == [(1, ("teacher.weight",)), (2, ("teacher.weight",))]


def _trail(*changes: tuple[int, tuple[str, ...]], call: str | None = "train.py:9 in evaluate") -> ReplicaTrail:
    return ReplicaTrail(modes=[ModeChange(step, step - 1, named, len(named), 4, call if named else None)
                               for step, named in changes])


def test_ranks_in_different_modes_are_named_with_the_rank_the_modules_and_the_step() -> None:
    alike = _trail((1, ()))
    odd = _trail((1, ()), (9, ("layers.1 (Dropout)", "layers.0 (BatchNorm1d)")))
    assert modes_apart([alike, alike]) is None
    step, verdict = modes_apart([odd, alike])
    assert step == 9
    assert verdict.startswith("rank 0 trains with layers.1 (Dropout), layers.0 (BatchNorm1d) in eval mode from step 9 "
                              "(after model.eval() at train.py:9 in evaluate, and no model.train() after it), rank 1 "
                              "in training mode")


def test_a_resume_that_trains_in_another_mode_names_the_flag_as_state_no_checkpoint_holds() -> None:
    full = _trail((1, ()), (5, ("layers.1 (Dropout)",)))
    assert modes_resumed(full, _trail((1, ("layers.1 (Dropout)",))), 7, 13) == ""
    verdict = modes_resumed(full, _trail((1, ())), 7, 13)
    assert "the uninterrupted fit trains with layers.1 (Dropout) in eval mode from step 5" in verdict
    assert "the resumed fit at step 8 in training mode" in verdict and "state no checkpoint holds" in verdict


def test_parameters_without_gradient_name_the_ranks_that_change_them() -> None:
    changed = ReplicaTrail(frozen=[FrozenChange(1, ("teacher.w",), 1)], frozen_names=["teacher.w"])
    kept = ReplicaTrail(frozen_names=["teacher.w"])
    assert frozen_changers([changed, kept], {"student.w"}) == ""
    verdict = frozen_changers([changed, kept], {"teacher.w"})
    assert verdict == ("teacher.w (requires_grad=False) change with no gradient on rank 0 from step 1, while rank 1 "
                       "leaves them as built")


def test_initial_sync_names_a_parameter_without_gradient_changed_on_one_rank() -> None:
    def state(after: str) -> StartState:
        return StartState(True, None, {"teacher.w": TensorState(PARAMETER, "a", True, False, False, gradient=False)},
                          {"teacher.w": after})

    verdict = judge([state("b"), state("a")])
    assert "differs after the first optimizer step (rank 1 against rank 0)" in verdict
    assert "changes with no gradient on rank 0 and stays as it started on rank 1" in verdict
    trained = replace(state("b").start["teacher.w"], gradient=True)
    assert "gradients are not all-reduced" in judge([StartState(True, None, {"teacher.w": trained}, {"teacher.w": "b"}),
                                                     state("a")])
