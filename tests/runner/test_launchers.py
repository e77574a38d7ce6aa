"""Other launchers: pytest under torchrun (ranks someone else started) and pytest-xdist workers."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.usefixtures("no_orphans")

DISTRIBUTED_TESTS = """
import pytest
import torch
import torch.distributed as dist

@pytest.mark.ddp
def test_sum(ddp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ddp.world_size

@pytest.mark.ddp
def test_rank1_fails(ddp):
    assert ddp.rank != 1, "rank 1 disagrees"

@pytest.mark.ddp(world_size=[2, 3])
def test_sizes(ddp):
    assert ddp.world_size == 2

def test_plain():
    pass

@pytest.fixture
def data_on_this_node():
    import os
    if os.environ["RANK"] == "1":
        raise FileNotFoundError("data.bin missing on this node")

@pytest.mark.ddp
def test_setup_fails_on_rank1_only(ddp, data_on_this_node):
    pass

@pytest.mark.ddp
def test_zz_after_divergent_setup(ddp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ddp.world_size
"""


def test_under_torchrun_ranks_agree_and_rank0_reports(pytester: pytest.Pytester) -> None:
    """The CI smoke test of torchrun mode: two processes, nothing spawned by the plugin."""
    pytester.makepyfile(DISTRIBUTED_TESTS)
    result = pytester.run(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "pytest", "-p", "no:cacheprovider", "-rs", "--junitxml", "out.xml", str(pytester.path),
        timeout=120,
    )
    assert result.ret != 0  # a red test fails the launcher, hence the job
    out = result.stdout.str()
    # one report (rank 0's), in which the failure on rank 1 is named
    assert out.count("short test summary info") == 1, out
    result.stdout.fnmatch_lines(["*test_rank1_fails*", "rank 1 failed", "*_ rank 1 _*", "*rank 1 disagrees*"])
    # a setup that failed on one rank only fails the test everywhere, and the next test is still
    # compared with itself (agreement is keyed by test, not by count)
    result.stdout.fnmatch_lines(["*test_setup_fails_on_rank1_only*", "rank 1 failed", "*_ rank 1 _*",
                                 "error in setup:*", "*data.bin missing on this node*"])
    result.stdout.fnmatch_lines(["*the launcher started 2 ranks; this test needs 3*",
                                 "*2 failed, 4 passed, 1 skipped*"])
    assert "ddp_conformance.runner.rank" not in out
    assert (pytester.path / "out.xml").exists()


@pytest.mark.slow
def test_xdist_workers_each_run_their_own_pool(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.parametrize("n", range(6))
        @pytest.mark.ddp
        def test_many(ddp, n, tmp_path):
            assert ddp.world_size == 4
            t = torch.tensor([float(n)])
            dist.all_reduce(t)
            assert t.item() == 4 * n
            print("worker", os.environ["PYTEST_XDIST_WORKER"], "pool", os.environ["DDP_CONFORMANCE_STORE"])
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "-rP", "-p", "no:cacheprovider", "--ddp-world-size", "4")
    result.assert_outcomes(passed=6)
    pools = {}
    for line in result.stdout.lines:
        if "[rank 0] worker gw" in line:
            worker, pool = line.split("worker ", 1)[1].split(" pool ")
            pools.setdefault(worker, set()).add(pool)
    # both workers ran tests, each on its own pool: their rendezvous never met
    assert len(pools) == 2, result.stdout.str()
    assert not set.intersection(*pools.values())


@pytest.mark.slow
def test_under_torchrun_a_hang_is_ended_with_every_thread_stack(pytester: pytest.Pytester) -> None:
    """No supervisor under a launcher: past the test's limit the rank dumps its stacks and ends, and the
    launcher ends the others, instead of holding the CI job."""
    pytester.makepyfile(
        """
        import time
        import pytest

        def wait_for_data_that_never_comes():
            time.sleep(120)

        @pytest.mark.ddp(timeout=3)
        def test_hangs_on_rank1(ddp):
            if ddp.rank == 1:
                wait_for_data_that_never_comes()
        """
    )
    result = pytester.run(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "pytest", "-p", "no:cacheprovider", str(pytester.path), timeout=90,
    )
    assert result.ret != 0
    output = result.stdout.str() + result.stderr.str()
    assert "Timeout (0:00:03)!" in output
    assert "in wait_for_data_that_never_comes" in output
