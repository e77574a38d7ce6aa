"""static_graph's cause for a static fit that raised, from what the recorder saw before the error.

The errors are DDP's own first lines on torch 2.13 (measured: docs/checks/static_graph.md); the
fixtures in fixtures/mutants/ raise the no_sync one for real (lightning_static_graph_accumulates).
"""

from __future__ import annotations

import pytest

from ddp_conformance.checks.static_graph import ISSUE_143580, _Fit, _raised
from ddp_conformance.checks.support.adapter_errors import AdapterError
from ddp_conformance.checks.support.fit_record import FitRecord

ASSERT = ('expect_autograd_hooks_ INTERNAL ASSERT FAILED at "torch/csrc/distributed/c10d/reducer.cpp":1732, '
          "please report a bug to PyTorch.")
CHANGED = ("Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, "
           "but then got used in the second iteration. this is not compatible with static_graph set to True.")
UNFINISHED = ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
              "indicates that your training graph has changed in this iteration.\nmore lines")


def raised(message: str, synced: list[bool], steps: int) -> str:
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as exc:
            raise AdapterError("trainer t: fit raised RuntimeError") from exc
    except AdapterError as error:
        return _raised(_Fit(None, FitRecord(synced=synced, optimizer_steps=steps), error))


def test_a_first_micro_batch_under_no_sync_names_the_torch_issue_and_the_remedy():
    cause = raised(ASSERT, [False], 0)
    assert "first micro-batch runs under no_sync()" in cause and ISSUE_143580 in cause, cause
    assert "sync every micro-batch while static_graph is on" in cause and "INTERNAL ASSERT FAILED" in cause


@pytest.mark.parametrize(("message", "synced", "steps"), [(CHANGED, [True, True], 1), (UNFINISHED, [True] * 3, 2),
                                                           (ASSERT, [True, False], 1)])
def test_any_other_error_of_the_static_fit_is_a_graph_that_changes(message, synced, steps):
    cause = raised(message, synced, steps)
    assert "the model's graph is not the same every iteration" in cause and "no_sync" not in cause, cause
    assert message.splitlines()[0][:60] in cause and "\n" not in cause
