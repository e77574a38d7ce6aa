"""Crashes and hangs: the failing rank is named with its exit code, signal or stack, the ranks are
killed, the pool is rebuilt and the next distributed test in the same session passes."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("no_orphans")

NEXT_TEST = """
@pytest.mark.ddp(world_size=2)
def test_zz_next_one_passes(ddp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


def test_crashes_name_the_rank_and_how_it_died(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        textwrap.dedent("""
        import os, signal
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.ddp(world_size=2)
        def test_exit(ddp):
            if ddp.rank == 1:
                os._exit(7)
            dist.barrier()

        @pytest.mark.ddp(world_size=2)
        def test_segv(ddp):
            if ddp.rank == 0:
                os.kill(os.getpid(), signal.SIGSEGV)
            dist.barrier()
        """)
        + NEXT_TEST
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-backend", "gloo")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*test_exit*", "*2 of 2 ranks failed: rank 1 died (exit code 7); rank 0 failed*"])
    result.stdout.fnmatch_lines(["*test_segv*", "*rank 0 died (killed by SIGSEGV (11))*"])
    # the dead rank's own last words are kept, prefixed
    result.stdout.fnmatch_lines(["*[[]rank 0[]] Fatal Python error: Segmentation fault*"])


def test_hang_reports_every_rank_stack_and_session_goes_on(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        textwrap.dedent("""
        import time
        import pytest
        import torch
        import torch.distributed as dist

        def spin_forever():
            while True:
                pass

        @pytest.mark.ddp(world_size=2, timeout=4)
        def test_hangs(ddp):
            if ddp.rank == 1:
                spin_forever()
            dist.barrier()

        @pytest.mark.ddp(world_size=2)
        def test_one_sided_failure_does_not_wait_for_timeout(ddp):
            if ddp.rank == 0:
                raise RuntimeError("rank 0 gave up")
            dist.barrier()
        """)
        + NEXT_TEST
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-timeout", "30",
                                           "--ddp-backend", "gloo")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        ["*2 of 2 ranks failed: ranks 0, 1 timed out*", "*rank 0 timed out after 4 s*",
         "*Python stack at the time:*", "*in barrier*"]
    )
    result.stdout.fnmatch_lines(["*rank 1 timed out after 4 s*", "*in spin_forever*"])
    result.stdout.fnmatch_lines(
        ["*2 of 2 ranks failed: rank 0 failed: RuntimeError: rank 0 gave up; rank 1 stuck after another rank failed*"]
    )
    assert "Traceback (most recent call last)" not in out
