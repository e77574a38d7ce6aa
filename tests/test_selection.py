"""`--ddp-checks` (ini `ddp_checks`): which checks the suite collects, and one usage line for a word it does
not know. Collection only: no rank starts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_conformance.selection import CHECK_IDS, DEFAULT_CHECKS, OPT_IN, parse_checks


def collected(pytester: pytest.Pytester, *args: str) -> list[str]:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q", "--pyargs",
                                           "ddp_conformance.suite", "--ddp-trainer", "torch", *args)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    return [line.split("[torch-", 1)[1].rstrip("]") for line in result.stdout.lines if "[torch-" in line]


def test_the_default_set_leaves_the_opt_in_checks_out(pytester: pytest.Pytester) -> None:
    assert OPT_IN and not set(OPT_IN) & set(DEFAULT_CHECKS)
    assert collected(pytester) == list(DEFAULT_CHECKS)


@pytest.mark.parametrize(("value", "expected"), [
    ("nonfinite_loss", ["nonfinite_loss"]),
    ("default,nonfinite_loss", [*DEFAULT_CHECKS, "nonfinite_loss"]),
    ("compiled_model,default,nonfinite_loss", list(CHECK_IDS)),
    ("all", list(CHECK_IDS)),
    (" resume_fidelity , rank_participation ", ["rank_participation", "resume_fidelity"]),
])
def test_the_option_selects_checks_in_suite_order(pytester: pytest.Pytester, value: str, expected: list[str]) -> None:
    assert collected(pytester, "--ddp-checks", value) == expected


def test_the_ini_mirror_selects_and_the_command_line_wins(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_checks = nonfinite_loss,initial_sync\n")
    assert collected(pytester) == ["initial_sync", "nonfinite_loss"]
    assert collected(pytester, "--ddp-checks", "default") == list(DEFAULT_CHECKS)


@pytest.mark.parametrize(("where", "expected"), [
    ("--ddp-checks", "--ddp-checks: unknown check 'nonfinite'; expected default, all or one of rank_participation, "),
    ("ini", "ini option ddp_checks: unknown check 'nonfinite'; expected default, all or one of rank_participation, "),
])
def test_an_unknown_check_is_one_usage_line(pytester: pytest.Pytester, where: str, expected: str) -> None:
    args = ["--ddp-checks", "default,nonfinite"] if where != "ini" else []
    if where == "ini":
        pytester.makeini("[pytest]\nddp_checks = default,nonfinite\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ERROR: {expected}"), lines
    assert "Traceback" not in result.stderr.str()


@given(st.lists(st.sampled_from([*CHECK_IDS, "default", "all"]), min_size=1))
def test_the_selection_is_the_union_of_its_words_in_suite_order(words: list[str]) -> None:
    chosen = parse_checks(",".join(words))
    expected = set().union(*({"default": set(DEFAULT_CHECKS), "all": set(CHECK_IDS)}.get(w, {w}) for w in words))
    assert chosen == tuple(check for check in CHECK_IDS if check in expected)


def test_an_empty_selection_is_refused() -> None:
    with pytest.raises(ValueError, match="expected check ids or default, all"):
        parse_checks(" , ")


def test_a_check_that_compiles_gets_its_least_timeout_and_the_others_the_session_s(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(timeout_probe="""
        from ddp_conformance.marker import ddp_test

        def pytest_collection_modifyitems(items):
            for item in items:
                test = ddp_test(item)
                print("TIMEOUT", item.callspec.params["check"], test.timeout, test.preload)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "timeout_probe", "--collect-only", "-q",
                                           "-s", "--pyargs", "ddp_conformance.suite", "--ddp-trainer", "torch",
                                           "--ddp-timeout", "20", "--ddp-checks", "rank_participation,compiled_model")
    lines = [line.split()[1:] for line in result.stdout.lines if line.startswith("TIMEOUT")]
    assert [words[:2] for words in lines] == [["rank_participation", "20.0"], ["compiled_model", "120.0"]], lines
    assert lines[0][2:] == lines[1][2:] and "torch._dynamo" in " ".join(lines[0][2:]), lines  # the preload kept
