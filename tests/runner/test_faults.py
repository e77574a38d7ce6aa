"""The fault matrix: every fault names the rank and the cause, ends within the timeout + 10 s, leaves
no process behind, and the next distributed test in the same session passes."""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("no_orphans")

HEADER = """
import os, signal, subprocess, time
import pytest
import torch
import torch.distributed as dist
"""

NEXT_TEST = """
@pytest.mark.ddp(world_size=2)
def test_zz_next_one_passes(ddp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


def run_matrix(pytester: pytest.Pytester, body: str, *args: str) -> tuple[pytest.RunResult, dict[str, float]]:
    pytester.makepyfile(HEADER + textwrap.dedent(body) + NEXT_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-backend", "gloo",
                                           "--junitxml", "faults.xml", *args)
    times = {case.get("name", ""): float(case.get("time", "0"))
             for case in ET.parse(Path(pytester.path, "faults.xml")).iter("testcase")}
    return result, times


def test_crashes_name_the_rank_and_how_it_died(pytester: pytest.Pytester) -> None:
    result, times = run_matrix(
        pytester,
        """
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

        @pytest.mark.ddp(world_size=2)
        def test_sigkill_from_outside(ddp):
            if ddp.rank == 1:
                subprocess.run(["kill", "-9", str(os.getpid())])
            dist.barrier()

        @pytest.mark.ddp(world_size=2)
        def test_raise_on_one_rank(ddp):
            if ddp.rank == 0:
                raise RuntimeError("rank 0 gave up")
            dist.barrier()
        """,
        "--ddp-timeout", "20",
    )
    result.assert_outcomes(passed=1, failed=4)
    result.stdout.fnmatch_lines(["*2 of 2 ranks failed: rank 1 died (exit code 7); rank 0 failed*"])
    result.stdout.fnmatch_lines(["*2 of 2 ranks failed: rank 0 died (killed by SIGSEGV (11))*"])
    result.stdout.fnmatch_lines(["*[[]rank 0[]] Fatal Python error: Segmentation fault*"])  # last words kept
    result.stdout.fnmatch_lines(["*2 of 2 ranks failed: rank 1 died (killed by SIGKILL (9))*"])
    result.stdout.fnmatch_lines(
        ["*rank 0 failed: RuntimeError: rank 0 gave up; rank 1 stuck after another rank failed*",
         "*rank 1 no answer 5 s after another rank failed (stuck), waiting in barrier*",
         "  File *, line * in test_raise_on_one_rank"]
    )
    for name in ("test_exit", "test_segv", "test_sigkill_from_outside", "test_raise_on_one_rank"):
        assert times[name] <= 20 + 10, (name, times[name])


def test_hangs_are_diagnosed_from_every_rank_stack(pytester: pytest.Pytester) -> None:
    """Also after a test reset the signal handlers, as Lightning's Trainer does at the end of every
    fit (each signal back to what Python's `signal` module saw: SIG_DFL for faulthandler's, which
    sit beneath Python): the stack request then killed the rank ("died (killed by SIGUSR1)") and a
    segfault lost its last words. Ranks install them again after every test; within the test that
    reset them, a hang says why it has no stack instead of killing the rank."""
    result, times = run_matrix(
        pytester,
        """
        @pytest.mark.ddp(world_size=2)
        def test_0_pool_is_up(ddp):  # the pool's start off the timed tests' clocks (it can take seconds when busy)
            pass

        def spin_forever():
            while True:
                pass

        def reset_like_lightning():
            for signum in (signal.SIGUSR1, signal.SIGSEGV):
                signal.signal(signum, signal.getsignal(signum))

        @pytest.mark.ddp(world_size=2)
        def test_infinite_loop(ddp):
            if ddp.rank == 1:
                spin_forever()
            dist.barrier()

        @pytest.mark.ddp(world_size=2)
        def test_pool_is_up_again(ddp):  # the rebuilt pool's ranks import this file again, off the next test's clock
            pass

        @pytest.mark.ddp(world_size=2)
        def test_mismatched_collectives(ddp):
            if ddp.rank == 0:
                dist.all_reduce(torch.ones(4))
            else:
                dist.barrier()
            dist.barrier()

        @pytest.mark.ddp(world_size=2)
        def test_resets_handlers(ddp):
            reset_like_lightning()

        @pytest.mark.ddp(world_size=2)
        def test_then_hangs(ddp):
            if ddp.rank == 1:
                time.sleep(60)
            dist.barrier()

        @pytest.mark.ddp(world_size=2)
        def test_resets_handlers_again(ddp):
            reset_like_lightning()

        @pytest.mark.ddp(world_size=2)
        def test_then_segfaults(ddp):
            if ddp.rank == 0:
                os.kill(os.getpid(), signal.SIGSEGV)
            dist.barrier()

        @pytest.mark.ddp(world_size=2)
        def test_pool_is_up_once_more(ddp):
            pass

        @pytest.mark.ddp(world_size=2)
        def test_resets_handlers_and_hangs(ddp):
            reset_like_lightning()
            if ddp.rank == 1:
                time.sleep(60)
            dist.barrier()
        """,
        "--ddp-timeout", "4",
    )
    result.assert_outcomes(passed=6, failed=5)
    result.stdout.fnmatch_lines(
        ["*2 of 2 ranks failed: rank 1 never reached the collective (spin_forever at *.py:*) that rank 0 waits in "
         "(barrier); ranks 0, 1 timed out*",
         "*rank 0 timed out after 4 s, waiting in barrier*", "*rank 1 timed out after 4 s*", "*in spin_forever*"]
    )
    result.stdout.fnmatch_lines(
        ["*2 of 2 ranks failed: mismatched collectives: rank 0 in all_reduce, rank 1 in barrier*"]
    )
    result.stdout.fnmatch_lines(["*_ test_then_hangs _*", "*rank 0 timed out after 4 s, waiting in barrier*",
                                 "*rank 1 timed out after 4 s*", "*in test_then_hangs*"])
    result.stdout.fnmatch_lines(["*_ test_then_segfaults _*", "*rank 0 died (killed by SIGSEGV (11))*",
                                 "*[[]rank 0[]] Fatal Python error: Segmentation fault*"])
    result.stdout.fnmatch_lines(["*_ test_resets_handlers_and_hangs _*", "*timed out after 4 s*",
                                 "*no stack: the rank had no handler for SIGUSR1*"])
    result.stdout.no_fnmatch_line("*killed by SIGUSR1*")
    for name in ("test_infinite_loop", "test_mismatched_collectives", "test_then_hangs", "test_then_segfaults",
                 "test_resets_handlers_and_hangs"):
        assert times[name] <= 4 + 10, (name, times[name])


@pytest.mark.slow
def test_rendezvous_that_never_completes(pytester: pytest.Pytester) -> None:
    # the first pool's rank 1 is sent to another store, so the two ranks can never meet
    pytester.makeconftest(
        """
        import ddp_conformance.runner.parent.rank_pool as rank_pool

        original = rank_pool.RankPool._environment
        pools = []

        def split_rendezvous(self, rank, store):
            env = original(self, rank, store)
            if rank == 0:
                pools.append(self)
            if len(pools) == 1 and rank == 1:
                env["DDP_CONFORMANCE_STORE"] = str(store) + "-elsewhere"
            return env

        rank_pool.RankPool._environment = split_rendezvous
        """
    )
    result, times = run_matrix(
        pytester,
        """
        @pytest.mark.ddp(world_size=2)
        def test_a_needs_the_group(ddp):
            pass
        """,
        # 5 s is too short on a loaded machine: the fork server's torch import can run past it
        "--ddp-start-timeout", "10",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*could not start 2 gloo ranks: rank 0: no rendezvous within 10 s*", "*rank 0 stack:*",
         "*in init_process_group*"]
    )
    assert times["test_a_needs_the_group"] <= 10 + 10


@pytest.mark.slow
def test_a_failed_allocation_does_not_leak_into_the_next_test(pytester: pytest.Pytester) -> None:
    result, _ = run_matrix(
        pytester,
        """
        BASELINE = {}

        def rss_mb():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024

        @pytest.mark.ddp(world_size=2)
        def test_1_baseline(ddp):
            BASELINE["rss"] = rss_mb()

        @pytest.mark.ddp(world_size=2)
        def test_2_allocates_and_fails(ddp):
            big = torch.ones(64 * 1024 * 1024)  # 256 MB, held by the failing frame
            assert big.sum() < 0

        @pytest.mark.ddp(world_size=2)
        def test_3_memory_is_back(ddp):
            assert rss_mb() - BASELINE["rss"] < 100, "the failed test's tensor is still alive"
        """,
    )
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_2_allocates_and_fails*"])
