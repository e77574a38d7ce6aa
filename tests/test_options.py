"""Options: the help group, ini mirrors, and one clear usage line for bad input (no spawn needed)."""

from __future__ import annotations

import pytest


def test_help_lists_the_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(["ddp-conformance (*", "*--ddp-world-size=N*", "*--ddp-backend=*",
                                 "*--ddp-timeout=SECONDS*"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--ddp-world-size", "0"], "--ddp-world-size: expected an integer >= 1, got 0"),
        (["--ddp-world-size", "-1"], "--ddp-world-size: expected an integer >= 1, got -1"),
        (["--ddp-world-size", "abc"], "--ddp-world-size: expected an integer >= 1, got 'abc'"),
        (["--ddp-backend", "mpi"], "--ddp-backend: expected one of auto, gloo, nccl, got 'mpi'"),
        (["--ddp-device", "gpu"], "--ddp-device: expected one of auto, cpu, cuda, got 'gpu'"),
        (["--ddp-device", "cpu", "--ddp-backend", "nccl"], "--ddp-device: cpu cannot run with --ddp-backend "
         "nccl, which runs on GPUs only; expected cuda or auto, or --ddp-backend gloo"),
        (["--ddp-timeout", "-3"], "--ddp-timeout: expected a number of seconds > 0, got '-3'"),
        (["--ddp-timeout", "soon"], "--ddp-timeout: expected a number of seconds > 0, got 'soon'"),
    ],
)
def test_bad_option_is_one_usage_line(pytester: pytest.Pytester, args: list[str], expected: str) -> None:
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.stderr.lines if line.strip()] == [f"ERROR: {expected}"]
    assert "Traceback" not in result.stderr.str()


def test_ini_mirror_and_bad_ini_value(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_world_size = two\n")
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option ddp_world_size: expected an integer >= 1, got 'two'"])


@pytest.mark.parametrize(("argument", "expected"), [
    ("world_size=[2, 0]", "*test_x*world_size=...) expects an int >= 1 or a list of them, got [[]2, 0[]]*"),
    ("preload=['torch.', 3]", "*test_x*preload=...) expects a module name or a list of them*got [[]'torch.', 3[]]*"),
    ("requires=5", "*test_x*requires=...) expects a module name or a list of them*got 5*"),
])
def test_bad_marker_argument_is_named(pytester: pytest.Pytester, argument: str, expected: str) -> None:
    pytester.makepyfile(
        f"""
        import pytest
        @pytest.mark.ddp({argument})
        def test_x(ddp):
            pass
        """
    )
    result = pytester.runpytest_subprocess()
    assert result.ret != 0
    result.stdout.fnmatch_lines([expected])


def test_marker_is_registered_for_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.ddp(world_size=1)
        def test_x():
            pass
        """
    )
    result = pytester.runpytest_subprocess("--strict-markers", "--collect-only", "-q")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*test_x*"])


def test_the_name_in_pytests_plugins_line_turns_the_plugin_off(pytester: pytest.Pytester) -> None:
    """`-p no:NAME` with NAME as pytest's `plugins:` line shows it (the distribution, less its version)."""
    pytester.makepyfile(
        """
        import os

        def test_plain(request):
            assert not request.config.pluginmanager.has_plugin("ddp-conformance")
            assert not hasattr(request.config.option, "ddp_world_size")
        """
    )
    on = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    shown = next(line for line in on.stdout.lines if line.startswith("plugins:"))
    name = next(entry.strip().rsplit("-", 1)[0] for entry in shown.removeprefix("plugins:").split(",")
                if entry.strip().startswith("ddp"))
    assert name == "ddp-conformance"
    on.assert_outcomes(failed=1)  # the plugin was on
    off = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", f"no:{name}")
    off.assert_outcomes(passed=1)
    assert "ddp-conformance" not in off.stdout.str()


def test_a_timeout_comes_from_the_closest_ddp_marker_that_gives_one(pytester: pytest.Pytester) -> None:
    """A case's own marker (the conformance suite gives compiled_model a longer one), else the function's, else the
    module's; a marker without a timeout does not hide an outer one's."""
    pytester.makeconftest("""
        from ddp_conformance.marker import ddp_test

        def pytest_collection_modifyitems(items):
            for item in items:
                print("TIMEOUT", item.name, ddp_test(item).timeout)
    """)
    pytester.makepyfile("""
        import pytest

        pytestmark = pytest.mark.ddp(timeout=7)

        @pytest.mark.ddp(world_size=1)
        def test_module_s(ddp):
            pass

        @pytest.mark.ddp(world_size=1, timeout=3)
        def test_own(ddp):
            pass

        @pytest.mark.ddp(world_size=1)
        @pytest.mark.parametrize("case", [1, pytest.param(2, marks=pytest.mark.ddp(timeout=50))])
        def test_case_s(ddp, case):
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q", "-s",
                                           "--ddp-timeout", "11")
    lines = sorted(line for line in result.stdout.lines if line.startswith("TIMEOUT"))
    assert lines == ["TIMEOUT test_case_s[1] 7.0", "TIMEOUT test_case_s[2] 50.0", "TIMEOUT test_module_s 7.0",
                     "TIMEOUT test_own 3.0"], result.stdout.str()
