"""Where the ranks' collective sequences part (`collectives.first_parting`) and where each rank waits
(`collectives.where`), from records as torch's flight recorder leaves them; the dump itself is exercised by the hang
tests of test_failure_reports.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ddp_conformance.checks.support.collectives import Collective, first_parting, where


def call(seq: int, op: str = "all_reduce", shape: int = 10, ddp: bool = False, done: bool = True,
         site: str = "train.py:63 (train)", group: str = "default_pg", harness: bool = False) -> Collective:
    return Collective(group, seq, op, [[shape]], done, ddp, harness, site)


def test_a_collective_one_rank_ran_and_the_other_never_did_is_named_with_both_sides() -> None:
    rank0 = [call(1, ddp=True), call(2, "broadcast", 1, done=False, site="train.py:88 (evaluate)")]
    rank1 = [call(1, ddp=True)]
    parting = first_parting([rank0, rank1])
    assert parting == ("rank 0 ran broadcast #2 of group default_pg (1; train.py:88 (evaluate)), which rank 1 never "
                       "ran (rank 1 is in no collective)")


def test_the_same_slot_with_another_operation_shape_or_launcher_parts_and_a_call_site_alone_does_not() -> None:
    explicit, ddp = call(7, site="train.py:88 (evaluate)", done=False), call(7, ddp=True, done=False)
    assert first_parting([[explicit], [ddp]]).startswith(
        "the ranks part at #7 of group default_pg: rank 0 all_reduce #7 of group default_pg (10; train.py:88 "
        "(evaluate)); rank 1 DDP's gradient all-reduce #7 of group default_pg (10; backward at train.py:63 (train))")
    assert "rank 1 all_reduce #7 of group default_pg (12;" in first_parting([[explicit], [call(7, shape=12)]])
    # ranks that send from different lines (`if rank == 0: ... else: ...`) run the same collective
    assert first_parting([[call(7, site="a.py:1 (f)")], [call(7, site="a.py:2 (f)")]]) == ""


def test_records_that_rolled_over_are_compared_where_every_rank_still_has_them() -> None:
    rank0 = [call(seq) for seq in range(40, 50)]
    rank1 = [call(seq, shape=1 if seq < 35 else 10) for seq in range(30, 50)]  # apart before rank 0's record starts
    assert first_parting([rank0, rank1]) == ""
    rank1[15] = call(45, shape=1)
    assert first_parting([rank0, rank1]).startswith("the ranks part at #45 of group default_pg")


def test_where_each_rank_waits_names_the_micro_batch_of_ddp_s_all_reduce_and_the_suite_s_own() -> None:
    rank0 = [call(3, "barrier", 1, done=False, harness=True, site="check_context.py:40 (all_gather)")]
    rank1 = [call(3, ddp=True, done=False)]
    assert where([rank0, rank1, None], [4, 7, None]) == (
        "rank 0 waits in the suite's own barrier #3 of group default_pg (1; check_context.py:40 (all_gather)); "
        "rank 1 waits in DDP's gradient all-reduce #3 of group default_pg (10; backward of micro-batch 7 at "
        "train.py:63 (train))")


@given(st.lists(st.sampled_from(["all_reduce", "broadcast", "all_gather"]), min_size=1, max_size=30),
       st.data())
def test_one_extra_collective_on_one_rank_is_the_first_parting(ops: list[str], data: st.DataObject) -> None:
    """Ranks that ran the same sequence do not part; a collective inserted on rank 1 alone parts them at its slot,
    or, where it is the last, as one rank 0 never ran."""
    same = [call(seq, op) for seq, op in enumerate(ops, start=1)]
    assert first_parting([same, same]) == ""
    at = data.draw(st.integers(0, len(ops)))
    extra = [*ops[:at], "barrier", *ops[at:]]
    other = [call(seq, op, shape=0 if op == "barrier" else 10) for seq, op in enumerate(extra, start=1)]
    parting = first_parting([same, other])
    if at == len(ops):
        assert parting.startswith(f"rank 1 ran barrier #{at + 1} of group default_pg"), parting
    else:
        assert parting.startswith(f"the ranks part at #{at + 1} of group default_pg"), parting
