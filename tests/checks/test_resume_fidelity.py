"""resume_fidelity's verdicts, from made-up states."""

from __future__ import annotations


def test_buffers_lost_only_off_rank_zero_are_named_as_rank_zero_s_buffers_restored_everywhere():
    from ddp_conformance.checks.resume_fidelity import BUFFERS_LOST, _cause, _rank_buffers

    assert _rank_buffers([[], [_cause(f"{BUFFERS_LOST}: after ...")]]).startswith(
        f"{BUFFERS_LOST} on rank 1, while rank 0's are: the ranks keep buffers of their own "
        "(forward_sync_buffers=False")
    every = [[_cause(f"{BUFFERS_LOST}: x")], [_cause(f"{BUFFERS_LOST}: y")]]
    assert _rank_buffers(every) == ""  # every rank: the checkpoint's fault
    assert _rank_buffers([[], []]) == ""
