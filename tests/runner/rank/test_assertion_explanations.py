"""A failing assert in a rank explains itself exactly as the same assert does in a plain test, on
whatever pytest is installed: pytest's own comparisons and a conftest's `pytest_assertrepr_compare`."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.usefixtures("no_orphans")

MONEY = """
class Money:
    def __init__(self, cents):
        self.cents = cents

    def __eq__(self, other):
        return self.cents == other.cents
"""
CONFTEST = """
from money import Money

def pytest_assertrepr_compare(config, op, left, right):
    if isinstance(left, Money) and isinstance(right, Money) and op == "==":
        return ["Money differs:", f"   cents: {left.cents} != {right.cents}"]
"""

# each comparison once as a plain test and once on the ranks; only rank 1 fails, so the rank
# report is a single rank's, not a merge
COMPARISONS = {
    "list": "[1, 2, 3] == [1, 2, 4]",
    "dict": "{'a': 1, 'b': 2, 'c': 3} == {'a': 1, 'b': 5, 'd': 3}",
    "text": "'first line\\nsecond line\\nthird' == 'first line\\nsecond LINE\\nthird'",
    "approx": "[0.1 + 0.2, 1.0] == pytest.approx([0.3, 1.1])",
    "set": "{1, 2, 3} == {2, 3, 4}",
    "hook": "Money(5) == Money(7)",
}


# a conftest below the rootdir, loaded by pytest only when collecting its directory, and a sibling
# directory whose conftest hook must not apply to it
SUB_CONFTEST = """
def pytest_assertrepr_compare(config, op, left, right):
    if isinstance(left, tuple) and isinstance(right, tuple) and len(left) == 3:
        return ["points differ (sub conftest)"]
"""
OTHER_CONFTEST = """
def pytest_assertrepr_compare(config, op, left, right):
    return ["the other directory's hook must not apply"]
"""
SUB_COMPARISONS = {"subhook": "(1, 2, 3) == (1, 2, 4)", "subdefault": "'abc' == 'abd'"}


def _test_module(comparisons: dict[str, str]) -> str:
    lines = ["import pytest", "from money import Money", ""]
    for name, comparison in comparisons.items():
        lines += [f"def test_plain_{name}():", f"    assert {comparison}", ""]
        lines += ["@pytest.mark.ddp(world_size=2)", f"def test_ranks_{name}(ddp):",
                  "    if ddp.rank == 1:", f"        assert {comparison}", ""]
    return "\n".join(lines)


def _explanations(output: str, name: str) -> list[str]:
    """The `E` lines of a test's failure section, without the `E` prefix."""
    section = re.search(rf"_{{3,}} {name} _{{3,}}\n(.*?)(?=\n_{{3,}} test_\w+ _{{3,}}|\n={{3,}})", output, re.S)
    assert section, f"no failure section for {name}"
    return [line[1:].strip() for line in section.group(1).splitlines() if line.startswith("E ")]


@pytest.mark.parametrize("verbosity", [[], pytest.param(["-vv"], marks=pytest.mark.slow)], ids=["default", "vv"])
def test_rank_explains_asserts_as_a_plain_test_does(pytester: pytest.Pytester, verbosity: list[str]) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(money=MONEY, test_compare=_test_module(COMPARISONS))
    for directory, conftest in (("sub", SUB_CONFTEST), ("other", OTHER_CONFTEST)):
        pytester.mkdir(directory).joinpath("conftest.py").write_text(conftest)
    pytester.path.joinpath("sub", "test_sub.py").write_text(_test_module(SUB_COMPARISONS))
    pytester.path.joinpath("other", "test_other.py").write_text("def test_other():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *verbosity)
    output = result.stdout.str()
    result.assert_outcomes(failed=2 * (len(COMPARISONS) + len(SUB_COMPARISONS)), passed=1)
    assert "explanations are unavailable" not in output
    assert "must not apply" not in output
    assert _explanations(output, "test_ranks_subhook") == ["assert points differ (sub conftest)"]
    for name in [*COMPARISONS, *SUB_COMPARISONS]:
        plain = _explanations(output, f"test_plain_{name}")
        ranks = _explanations(output, f"test_ranks_{name}")
        assert plain, f"{name}: no explanation in the plain test"
        assert ranks == plain, f"{name}: rank 1 explains\n{ranks}\nwhere a plain test explains\n{plain}"
    assert "Money differs:" in output and "cents: 5 != 7" in output


def test_a_change_in_pytests_private_hook_is_reported_not_hidden(pytester: pytest.Pytester) -> None:
    """The one private entry point (`_pytest.assertion.pytest_runtest_protocol`) replaced as a new
    pytest might: the rank's failure says the explanations are missing, and why."""
    pytester.makeconftest(
        """
        import _pytest.assertion
        _pytest.assertion.pytest_runtest_protocol = lambda item: None
        """
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ddp(world_size=2)
        def test_fails(ddp):
            assert [1, 2] == [1, 3]
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*pytest's assertion explanations are unavailable in ranks: "
                                 "ExplanationsUnavailable: pytest *no longer a wrapper*"])


# every plugin's options, whatever plugins the ranks load: the cache provider's (which ranks leave
# out), xdist's and pytest-html's (entry points), and a conftest's own
PLUGIN_OPTIONS = {
    "lf": ["--lf"],
    "sw": ["--sw"],
    "ff": ["--ff"],
    "nf": ["--nf"],
    "xdist": ["-n", "1"],
    "html": ["--html=report.html"],
    "conftest": ["--team-flag=on"],
}
OPTION_CONFTEST = """
def pytest_addoption(parser):
    parser.addoption("--team-flag", default="off")
"""
FAST_OPTIONS = ("lf",)  # the others cost ~4 s each in the slow run


@pytest.mark.parametrize("options", [
    pytest.param(args, id=name, marks=() if name in FAST_OPTIONS else pytest.mark.slow)
    for name, args in PLUGIN_OPTIONS.items()])
def test_rank_explains_asserts_whatever_plugin_options_the_parent_was_given(pytester: pytest.Pytester,
                                                                            options: list[str]) -> None:
    if options[0] == "-n":
        pytest.importorskip("xdist", reason="pytest-xdist's option needs pytest-xdist")
    if options[0].startswith("--html"):
        pytest.importorskip("pytest_html", reason="pytest-html's option needs pytest-html")
    pytester.makeconftest(OPTION_CONFTEST)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ddp(world_size=2)
        def test_ranks(ddp):
            if ddp.rank == 1:
                assert [1, 2, 3] == [1, 2, 4]
        """
    )
    result = pytester.runpytest_subprocess(*options)
    output = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "explanations are unavailable" not in output, output
    explained = _explanations(output, "test_ranks")
    assert explained[:3] == ["assert [1, 2, 3] == [1, 2, 4]", "", "At index 2 diff: 3 != 4"], output
    # then pytest's hint, or the full diff where pytest sees a CI (the CI or BUILD_NUMBER variable), as in a plain test
    full_diff = any(line.startswith("Full diff:") for line in explained)  # pytest 8.0 writes it without a legend
    assert explained[3:4] == ["Use -v to get more diff"] or full_diff, output
