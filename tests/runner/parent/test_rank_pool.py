"""The supervisor's pure decisions (parent/rank_pool.py), tested without processes."""

from __future__ import annotations

from pathlib import Path

from ddp_conformance.runner.parent.rank_pool import RankDevices, RankPool


def test_group_timeout_never_undercuts_the_longest_test() -> None:
    pool = RankPool(2, "gloo", start_timeout=60, devices=RankDevices(rank_threads=1), group_timeout=600)
    assert pool._environment(0, Path("/tmp/store"))["DDP_CONFORMANCE_PG_TIMEOUT"] == "600"
    short = RankPool(2, "gloo", start_timeout=60, devices=RankDevices(rank_threads=1), group_timeout=5)
    assert short._environment(0, Path("/tmp/store"))["DDP_CONFORMANCE_PG_TIMEOUT"] == "60"
