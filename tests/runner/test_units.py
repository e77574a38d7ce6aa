"""Pure decisions of the runner, tested without processes."""

from __future__ import annotations

from pathlib import Path

from ddp_conformance.messages import FAILED, PASSED, RankReply
from ddp_conformance.supervisor import PoolRun, RankEnd, RankPool
from ddp_conformance.verdict import diagnose_hang, judge

STACK_BARRIER = '''Current thread 0x01 (most recent call first):
  File "/usr/lib/site-packages/torch/distributed/distributed_c10d.py", line 5356 in barrier
  File "/usr/lib/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/repo/test_x.py", line 21 in test_hang
'''
STACK_ALL_REDUCE = STACK_BARRIER.replace("in barrier", "in all_reduce")
STACK_LOOP = '''Current thread 0x02 (most recent call first):
  File "/repo/test_x.py", line 7 in spin_forever
  File "/repo/test_x.py", line 20 in test_hang
'''


def test_group_timeout_never_undercuts_the_longest_test() -> None:
    pool = RankPool(2, "gloo", start_timeout=60, rank_threads=1, group_timeout=600)
    assert pool._environment(0, Path("/tmp/store"))["DDP_CONFORMANCE_PG_TIMEOUT"] == "600"
    short = RankPool(2, "gloo", start_timeout=60, rank_threads=1, group_timeout=5)
    assert short._environment(0, Path("/tmp/store"))["DDP_CONFORMANCE_PG_TIMEOUT"] == "60"


def test_hang_diagnosis() -> None:
    assert diagnose_hang({0: STACK_ALL_REDUCE, 1: STACK_BARRIER}) == (
        "mismatched collectives: rank 0 in all_reduce, rank 1 in barrier")
    assert diagnose_hang({0: STACK_BARRIER, 1: STACK_LOOP, 2: STACK_BARRIER}) == (
        "rank 1 never reached the collective (spin_forever at test_x.py:7) that ranks 0, 2 wait in (barrier)")
    assert diagnose_hang({0: STACK_BARRIER, 1: STACK_BARRIER}) == ""  # same collective: no claim
    assert diagnose_hang({0: STACK_LOOP}) == ""


def test_the_earliest_failure_heads_the_verdict_and_the_dead_come_first() -> None:
    run = PoolRun(arrival=[1, 0])
    run.replies = {0: RankReply(0, FAILED, message="RuntimeError: Connection closed by peer"),
                   1: RankReply(1, FAILED, message="RuntimeError: Timed out waiting")}
    assert judge(run, 2).headline == "2 of 2 ranks failed: ranks 0, 1 failed: RuntimeError: Timed out waiting"
    run = PoolRun(arrival=[0, 1])
    run.replies = {0: RankReply(0, FAILED, message="RuntimeError: Connection closed by peer")}
    run.ends = {1: RankEnd(1, "crashed", "exit code 7")}
    assert judge(run, 2).headline.startswith("2 of 2 ranks failed: rank 1 died (exit code 7); rank 0 failed")


def test_a_pool_out_of_step_is_poisoned() -> None:
    run = PoolRun()
    run.replies = {0: RankReply(0, PASSED, sequence=4), 1: RankReply(1, PASSED, sequence=5)}
    assert run.poisoned
    run.replies[1].sequence = 4
    assert not run.poisoned
    run.replies[1].group_healthy = False
    assert run.poisoned


def test_local_module_index_sees_new_modules_and_is_kept_otherwise(tmp_path: Path) -> None:
    """The per-test scan of sys.modules is cached; an import or a removal must still be seen."""
    import sys
    import types

    from ddp_conformance.session import _LocalModuleIndex

    index = _LocalModuleIndex()
    first = index(tmp_path)
    assert index(tmp_path) is first  # nothing changed: the same answer, no rescan
    module = types.ModuleType("ddp_probe_helpers")
    module.__file__ = str(tmp_path / "ddp_probe_helpers.py")
    sys.modules["ddp_probe_helpers"] = module
    try:
        assert index(tmp_path)["ddp_probe_helpers"] == (module.__file__, False)
    finally:
        del sys.modules["ddp_probe_helpers"]
    assert "ddp_probe_helpers" not in index(tmp_path)
