"""The verdict's pure decisions (parent/verdict.py), tested without processes."""

from __future__ import annotations

from ddp_conformance.runner.parent.verdict import diagnose_hang, judge
from ddp_conformance.runner.wire import FAILED, PoolRun, RankEnd, RankReply

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
    assert judge(run, 2).headline == ("2 of 2 ranks failed: rank 1 failed: RuntimeError: Timed out waiting; "
                                      "rank 0 failed after it (below)")
    run = PoolRun(arrival=[0, 1])
    run.replies = {0: RankReply(0, FAILED, message="RuntimeError: Connection closed by peer")}
    run.ends = {1: RankEnd(1, "crashed", "exit code 7")}
    assert judge(run, 2).headline.startswith("2 of 2 ranks failed: rank 1 died (exit code 7); rank 0 failed")


def test_an_error_signature_ignores_what_differs_between_ranks() -> None:
    import tempfile

    from ddp_conformance.runner.parent.verdict import cap_output, error_signature

    tmp = tempfile.gettempdir()
    one = f"rank 0 (pid 4121): <Obj at 0x7f3a2c> value 0.1234 in {tmp}/shard0-abc12/x.pt, line 12"
    two = f"rank 1 (pid 4187): <Obj at 0x7f9e10> value -2.5e-07 in {tmp}/shard1-zz9/x.pt, line 12"
    assert error_signature(one) == error_signature(two)
    assert error_signature("KeyError: 'rank 0'") != error_signature("ValueError: rank 0")
    assert cap_output("a\nb") == ["a", "b"]
    capped = cap_output("\n".join(map(str, range(1000))))
    assert capped[49:52] == ["49", "... 800 lines cut ...", "850"] and len(capped) == 201
    assert cap_output("x" * 2500) == ["x" * 2000 + "... (500 characters cut)"]


def test_ranks_with_the_same_error_merge_under_one_representative() -> None:
    run = PoolRun(arrival=[0, 1, 2])
    run.replies = {r: RankReply(r, FAILED, message=f"NameError: x (rank={r})", longrepr=f"E  NameError at rank={r}")
                   for r in (0, 1)}
    run.replies[2] = RankReply(2, FAILED, message="KeyError: 'y'", longrepr="E  KeyError: 'y'")
    body = judge(run, 3).body
    assert "_ ranks 0, 1 _" in body and "rank 1's" not in body and "_ rank 2 _" in body
    assert "(rank 0's shown; rank 1 differs only in numbers, addresses or temp paths)" in body
    assert "rank=0" in body and "rank=1" not in body
