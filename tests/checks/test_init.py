"""`ddp_conformance.checks` itself: the stall window the pytest process gives a check's fits."""

from __future__ import annotations

from ddp_conformance.checks import stall_seconds


def test_stall_threshold_follows_the_timeout_within_bounds():
    assert stall_seconds(120) == 12.0
    assert stall_seconds(10) == 2.0
    assert stall_seconds(1000) == 15.0


