"""What a distributed test reports: pass, the failing ranks named, merged tracebacks, skips and
xfails from ranks, parametrized world sizes, fixtures reaching the ranks, output by rank."""

from __future__ import annotations

import re

import pytest

from tests.helpers import failure_report

pytestmark = pytest.mark.usefixtures("no_orphans")


def test_passes_only_when_every_rank_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.ddp(world_size=2)
        def test_all_pass(ddp):
            assert dist.is_initialized() and dist.get_world_size() == ddp.world_size == 2
            assert dist.get_rank() == ddp.rank == int(os.environ["RANK"])
            assert ddp.local_rank == ddp.rank and ddp.backend == "gloo"
            assert ddp.device == torch.device("cpu")
            t = torch.tensor([float(ddp.rank)])
            dist.all_reduce(t)
            assert t.item() == 1.0

        @pytest.mark.ddp(world_size=2)
        def test_one_rank_fails(ddp):
            assert [1, 2, ddp.rank + 3] == [1, 2, 3]

        @pytest.mark.ddp(world_size=3)
        def test_same_failure_merged(ddp):
            if ddp.rank >= 1:
                raise ValueError("rank too high")

        def test_unmarked_runs_in_pytest():
            assert "RANK" not in __import__("os").environ
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*1 of 2 ranks failed: rank 1 failed: AssertionError: assert [[]1, 2, 4[]] == [[]1, 2, 3[]]*",
            "*_ rank 1 _*",
            "*At index 2 diff: 4 != 3*",
        ]
    )
    result.stdout.fnmatch_lines(["*2 of 3 ranks failed: ranks 1, 2 failed: ValueError: rank too high*",
                                 "*_ ranks 1, 2 _*"])
    assert "_ rank 0 _" not in result.stdout.str()


def test_world_sizes_parametrize_into_node_ids(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ddp(world_size=[1, 3])
        def test_sizes(ddp):
            assert ddp.world_size in (1, 3)

        @pytest.mark.ddp(world_size=[1, 2])
        def test_without_fixture():
            import torch.distributed as dist
            assert dist.get_world_size() in (1, 2)

        @pytest.mark.ddp
        def test_default(ddp):
            assert ddp.world_size == 3
        """
    )
    result = pytester.runpytest_subprocess("-v", "--ddp-world-size", "3", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        ["*test_sizes[[]ws1[]] PASSED*", "*test_sizes[[]ws3[]] PASSED*",
         "*test_without_fixture[[]ws1[]] PASSED*", "*test_without_fixture[[]ws2[]] PASSED*",
         "*test_default PASSED*"]
    )


def test_skip_and_xfail_inside_ranks_propagate(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ddp(world_size=2)
        def test_skips(ddp):
            pytest.skip("no data on this machine")

        @pytest.mark.ddp(world_size=2)
        def test_xfails(ddp):
            pytest.xfail("known bug 12")

        @pytest.mark.xfail(reason="marked", strict=True)
        @pytest.mark.ddp(world_size=2)
        def test_marked_xfail(ddp):
            assert ddp.rank == 0
        """
    )
    result = pytester.runpytest_subprocess("-rsx", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1, xfailed=2)
    result.stdout.fnmatch_lines(["*SKIPPED*no data on this machine*", "*XFAIL*known bug 12*"])
    # reported at the test, as a plain test's skip is, not at the plugin's line that re-raises it
    result.stdout.fnmatch_lines(
        ["SKIPPED * test_skip_and_xfail_inside_ranks_propagate.py:*: no data on this machine"])


def test_fixtures_reach_ranks_and_output_is_prefixed(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(params=[3])
        def numbers(request):
            return list(range(request.param))
        """
    )
    pytester.makepyfile(
        """
        import threading
        import pytest
        import torch.distributed as dist

        @pytest.mark.ddp(world_size=2)
        def test_shared_tmp_path(ddp, tmp_path, numbers):
            assert numbers == [0, 1, 2]
            (tmp_path / f"from-rank{ddp.rank}").write_text("x")
            dist.barrier()
            assert sorted(p.name for p in tmp_path.iterdir()) == ["from-rank0", "from-rank1"]
            print(f"hello from {ddp.rank}")
            ddp.figures["answer"] = 42

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.ddp(world_size=2)
        def test_unpicklable(ddp, lock):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-rP", "-p", "no:cacheprovider", "--junitxml=out.xml")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*[[]rank 0[]] hello from 0*", "*[[]rank 1[]] hello from 1*"])
    result.stdout.fnmatch_lines(
        ["*fixture 'lock' cannot be sent to the ranks: its lock value does not pickle*"]
    )
    assert "During handling" not in result.stdout.str()
    xml = (pytester.path / "out.xml").read_text()
    assert '<property name="answer" value="42"' in xml


def test_the_same_error_with_rank_specific_values_is_merged_and_output_is_capped(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        import tempfile
        import pytest
        import torch

        def load(rank):
            return undefined_loader(rank)

        @pytest.mark.ddp(world_size=2)
        def test_name_error_in_a_call_naming_the_rank(ddp):
            try:
                load(ddp.rank)
            except NameError as exc:
                raise RuntimeError(f"load(rank={ddp.rank}, cache={object()!r}) raised NameError: {exc}") from exc

        @pytest.mark.ddp(world_size=2)
        def test_value_error_with_rank_pid_value_and_temp_path(ddp):
            path = tempfile.mkdtemp(prefix=f"shard{ddp.rank}-")
            raise ValueError(f"rank {ddp.rank} (pid {os.getpid()}): bad shard {torch.rand(1).item():.4f} in {path}")

        @pytest.mark.ddp(world_size=2)
        def test_different_errors_stay_apart(ddp):
            raise (KeyError if ddp.rank == 0 else ValueError)(f"rank {ddp.rank}")

        @pytest.mark.ddp(world_size=2)
        def test_prints_ten_thousand_lines(ddp):
            for i in range(10_000):
                print(f"line {i} from rank {ddp.rank}")
            assert False
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=4)
    out = result.stdout.str()
    parts = re.split(r"\n_{3,} (test_\w+) _{3,}\n", out.split("= FAILURES =", 1)[1])
    failures = dict(zip(parts[1::2], parts[2::2], strict=True))
    for name in ("test_name_error_in_a_call_naming_the_rank", "test_value_error_with_rank_pid_value_and_temp_path"):
        block = failures[name]
        assert "_ ranks 0, 1 _" in block and "_ rank 0 _" not in block and "_ rank 1 _" not in block, block
        assert "(rank 0's shown; rank 1 differs only in numbers, addresses or temp paths)" in block
    assert failures["test_value_error_with_rank_pid_value_and_temp_path"].count("ValueError: rank 0") == 2  # +headline
    different = failures["test_different_errors_stay_apart"]
    assert "_ rank 0 _" in different and "_ rank 1 _" in different and "KeyError" in different
    # 10 000 lines per rank: the first 50 and the last 150 are kept, the lines between counted
    printed = failures["test_prints_ten_thousand_lines"]
    for rank in (0, 1):
        kept = [int(m) for m in re.findall(rf"\[rank {rank}\] line (\d+) from rank {rank}\n", printed)]
        assert kept == [*range(50), *range(9850, 10_000)], kept[:3]
    assert printed.count("... 9800 lines cut ...") == 2
    assert len(out.splitlines()) < 1000


ONE_ASSERT_AT_WORLD_SIZE_4 = """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.ddp(world_size=4)
    def test_rank1_asserts(ddp):
        x = torch.ones(1)
        assert ddp.rank != 1
        dist.all_reduce(x)
    """


@pytest.mark.parametrize(("style", "most_lines"), [pytest.param("long", 16, marks=pytest.mark.slow),
                                                   pytest.param("short", 11, marks=pytest.mark.slow), ("line", 1)])
def test_one_assert_on_one_rank_reads_at_a_glance(pytester: pytest.Pytester, style: str, most_lines: int) -> None:
    """One assert failing on rank 1 at world size 4 (the others stuck in all_reduce): the verdict
    first, rank 1's assertion, then ONE section for the three stuck ranks, which wait in the same
    line of the test: the harness's frames never show, and `--tb` is honoured. (It was 63 lines with
    three 14-line stacks of the runner's own frames, and 65 with --tb=line.)"""
    path = pytester.makepyfile(ONE_ASSERT_AT_WORLD_SIZE_4)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--tb={style}")
    result.assert_outcomes(failed=1)
    report = failure_report(result.outlines)
    headline = ("4 of 4 ranks failed: rank 1 failed: AssertionError: assert 1 != 1; "
                "ranks 0, 2, 3 stuck after another rank failed")
    text = "\n".join(report)
    assert "ddp_conformance" not in text and "Python stack" not in text and "runpy" not in text, text
    if style == "line":  # pytest's own face for --tb=line: path:line: message, one line per failure
        assert report == [f"{path}:8: {headline}"], text
        return
    assert report[1] == headline, text
    assert len(report) <= most_lines, text
    assert [line for line in report if line.startswith("_")] == [
        report[0], "_" * 20 + " rank 1 " + "_" * 20, "_" * 20 + " ranks 0, 2, 3 " + "_" * 20], text
    assert "ranks 0, 2, 3 no answer 5 s after another rank failed (stuck), waiting in all_reduce" in report, text
    assert f'  File "{path}", line 9 in test_rank1_asserts' in report, text


def test_warnings_of_the_harness_stay_out_of_the_ranks_output(pytester: pytest.Pytester) -> None:
    """A warning attributed to a line of the plugin (torch's warning about a call the harness made)
    is not the user's output; the user's own warnings still show, by rank."""
    pytester.makepyfile(
        """
        import warnings
        import pytest
        import ddp_conformance.runner.parent.verdict as harness

        @pytest.mark.ddp(world_size=2)
        def test_warns(ddp):
            warnings.warn_explicit("the harness's own warning", UserWarning, harness.__file__, 10)
            warnings.warn("the user's own warning")
            assert False  # the ranks' output is shown with a failure
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    output = [line for line in result.outlines if line.startswith("[rank ")]
    warned = [(line[:len("[rank 0]")], line.rsplit(": ", 1)[-1]) for line in output if "UserWarning" in line]
    assert warned == [("[rank 0]", "the user's own warning"), ("[rank 1]", "the user's own warning")], output
