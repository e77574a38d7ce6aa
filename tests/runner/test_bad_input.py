"""Bad input: one line naming what is wrong, where it was given and what was expected, never a
traceback; nothing measured is lost, and nothing (no process, no directory) is left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("no_orphans")


@pytest.fixture
def session_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The TMPDIR of the sessions the test runs, asserted empty afterwards (pytester keeps pytest's
    own temporary directories elsewhere: --basetemp)."""
    path = Path(tempfile.mkdtemp(prefix="ddpt-", dir="/tmp" if os.path.isdir("/tmp") else None))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    left = sorted(entry.name for entry in path.iterdir())
    shutil.rmtree(path, ignore_errors=True)
    assert left == [], f"the session left {left} in its TMPDIR"


def run_usage_error(pytester: pytest.Pytester, *args: str) -> str:
    ran = pytester.path / "a-test-ran"
    pytester.makepyfile(f"def test_nothing():\n    open({str(ran)!r}, 'w').close()\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1, result.stderr.str()
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert not ran.exists(), "a test ran before the usage error"
    return errors[0]


@pytest.mark.usefixtures("session_tmpdir")
def test_report_path_the_filesystem_refuses(pytester: pytest.Pytester) -> None:
    line = run_usage_error(pytester, "--ddp-report=/proc/r.json")
    assert line.startswith("ERROR: --ddp-report: /proc/r.json: cannot create a file in /proc (")
    assert line.endswith("); expected a file path in a directory this user can write")


@pytest.mark.usefixtures("session_tmpdir")
def test_report_path_under_a_regular_file(pytester: pytest.Pytester) -> None:
    notes = pytester.makefile(".txt", notes="a regular file")
    line = run_usage_error(pytester, "--ddp-report=notes.txt/deeper/r.json")
    assert line == ("ERROR: --ddp-report: notes.txt/deeper/r.json: notes.txt is a file, not a directory; expected a "
                    "file path in a directory this user can write")
    assert notes.read_text() == "a regular file"


@pytest.mark.usefixtures("session_tmpdir")
def test_report_path_from_ini_is_checked_and_named_so(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_report = /proc/r.json\n")
    line = run_usage_error(pytester)
    assert line.startswith("ERROR: ini option ddp_report: /proc/r.json: cannot create a file in /proc (")


# conformance results as the suite reports them, without ranks: the report reads user properties
FAKE_RESULTS = """
import shutil

def test_check(record_property):
    record_property("conformance_trainer", "torch")
    record_property("conformance_check", "rank_participation")
    record_property("summary", "every rank stepped")

def test_the_report_directory_goes_away():
    shutil.rmtree("out")
    open("out", "w").close()  # a file where the report's directory was
"""


@pytest.mark.usefixtures("session_tmpdir")
def test_ini_report_is_relative_to_the_rootdir_and_its_place_is_printed(pytester: pytest.Pytester,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nddp_report = reports/r.json\n")
    pytester.makepyfile(FAKE_RESULTS.split("\ndef test_the_report")[0])
    sub = pytester.mkdir("sub")
    monkeypatch.chdir(sub)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", str(pytester.path))
    assert result.ret == pytest.ExitCode.OK
    report = pytester.path / "reports" / "r.json"
    assert [r["check"] for r in json.loads(report.read_text())["results"]] == ["rank_participation"]
    assert result.stdout.lines.count(f"ddp conformance report: {report}") == 1
    assert not (sub / "reports").exists()


@pytest.mark.usefixtures("session_tmpdir")
def test_a_report_that_fails_at_the_end_loses_nothing(pytester: pytest.Pytester) -> None:
    pytester.mkdir("out")
    pytester.makepyfile(FAKE_RESULTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-report=out/r.json")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "Traceback" not in output and "INTERNALERROR" not in output
    result.stdout.fnmatch_lines(["*ddp conformance (world size 2, auto)*", "trainer*rank_participation*",
                                 "torch*PASS*"])
    problems = [line for line in result.stdout.lines if "--ddp-report" in line]
    assert problems == [f"--ddp-report: out/r.json: could not write the report: {pytester.path / 'out'} is a file, "
                        "not a directory"]
    result.stdout.fnmatch_lines(["*= 2 passed in *"])


def test_trainer_that_does_not_import(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(broken_adapter="import not_a_module_anywhere\n")
    line = run_usage_error(pytester, "--ddp-trainer", "broken_adapter.py:Trainer")
    assert line.startswith("ERROR: --ddp-trainer: 'broken_adapter.py:Trainer': cannot import ")
    assert "No module named 'not_a_module_anywhere'" in line


RANKS_IMPORT = """
import pytest

@pytest.mark.ddp(world_size=2, requires={requires!r})
@pytest.mark.parametrize("case", range(3))
def test_distributed(ddp, case):
    import {module}
    open({ran!r} + str(ddp.rank) + str(case), "w").close()
"""


def run_unimportable(pytester: pytest.Pytester, requires: tuple[str, ...], module: str) -> tuple[str, Path]:
    """A session whose ranks cannot import a module they need: one usage line before any test."""
    ran = pytester.path / "ran"
    pytester.makepyfile(test_ranks=RANKS_IMPORT.format(requires=requires, module=module, ran=str(ran)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    errors = [line for line in result.stderr.lines if line.strip()]
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    assert len(errors) == 1, result.stderr.str()
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert not list(pytester.path.glob("ran*")), "a test ran before the usage error"
    return errors[0], ran


def test_a_module_tests_require_that_ranks_cannot_import_stops_the_session_in_one_line(
        pytester: pytest.Pytester) -> None:
    line, _ = run_unimportable(pytester, ("json", "not_a_module_anywhere"), "json")
    assert line.startswith("ERROR: ddp-conformance: the rank processes cannot import not_a_module_anywhere, "
                           "which 3 collected tests require: ModuleNotFoundError: No module named "
                           "'not_a_module_anywhere'; install it into the environment of "), line


def test_a_rank_without_torch_stops_the_session_in_one_line(pytester: pytest.Pytester,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' own imports (torch) are needed by every test, declared or not; pytest's process need
    not import torch, so a broken one is first seen in the ranks."""
    shadow = pytester.path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    line, _ = run_unimportable(pytester, (), "json")
    assert line.startswith("ERROR: ddp-conformance: the rank processes cannot import torch (and "
                           "torch.distributed), which every distributed test needs: ImportError: this torch is "
                           "broken; install it into the environment of "), line


@pytest.mark.slow  # every default run's suite session requires numpy and passes: this is the plain tests' control
def test_modules_tests_require_that_import_are_no_obstacle(pytester: pytest.Pytester) -> None:
    ran = pytester.path / "ran"
    pytester.makepyfile(test_ranks=RANKS_IMPORT.format(requires=("colorsys",), module="colorsys", ran=str(ran)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    assert len(list(pytester.path.glob("ran*"))) == 6


def test_trainer_spec_that_names_no_adapter(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(my_adapter="class Trainer:\n    pass\nVALUE = 3\n")
    line = run_usage_error(pytester, "--ddp-trainer", "my_adapter.py:VALUE")
    assert line.startswith("ERROR: --ddp-trainer: 'my_adapter.py:VALUE': ")


def test_unreadable_config(pytester: pytest.Pytester) -> None:
    line = run_usage_error(pytester, "--ddp-config", "missing.yaml")
    assert line == "ERROR: --ddp-config: missing.yaml: cannot read the file: No such file or directory"


def test_config_with_a_wrong_type_names_the_key_path(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", bad="trainer:\n  strategy:\n    bucket_cap_mb: big\n")
    line = run_usage_error(pytester, "--ddp-config", "bad.yaml")
    assert line == "ERROR: --ddp-config: bad.yaml: trainer.strategy.bucket_cap_mb: expected a number, got 'big'"


def test_config_from_ini_is_relative_to_rootdir(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_config = configs/nope.yaml\n")
    line = run_usage_error(pytester)
    assert line == (f"ERROR: ini option ddp_config: {pytester.path / 'configs' / 'nope.yaml'}: cannot read the file: "
                    "No such file or directory")


@pytest.mark.parametrize(("arguments", "expected"), [
    ("world_sizes=[2, 4]", "@pytest.mark.ddp got an unknown keyword (world_sizes=[2, 4]); expected world_size, "
                           "timeout, preload, requires"),
    ("world_size=0", "@pytest.mark.ddp(world_size=...) expects an int >= 1 or a list of them, got 0"),
    ("timeout='abc'", "@pytest.mark.ddp(timeout=...) expects a number of seconds > 0, got 'abc'"),
    ("2, 4", "@pytest.mark.ddp takes world_size as its only positional argument, got 2 positional (2, 4)"),
], ids=["unknown-keyword", "world-size-0", "timeout-abc", "two-positionals"])
@pytest.mark.usefixtures("session_tmpdir")
def test_bad_marker_is_one_collection_line(pytester: pytest.Pytester, arguments: str, expected: str) -> None:
    pytester.makepyfile(test_marked=f"""
        import pytest

        @pytest.mark.ddp({arguments})
        def test_distributed(ddp):
            pass
        """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error: nothing ran, no rank started
    assert "Traceback" not in output and "INTERNALERROR" not in output
    # no frames, pluggy's or ours (another plugin's warning may name its own file: pytest-benchmark's does)
    assert not re.search(r"\.py:\d+: in ", output) and "ddp_conformance/" not in output
    lines = result.stdout.lines
    start = lines.index(next(line for line in lines if "ERROR collecting test_marked.py" in line))
    end = lines.index(next(line for line in lines if "short test summary info" in line))
    assert lines[start + 1:end] == [f"test_marked.py::test_distributed: {expected}"]


def test_an_option_value_pytest_took_for_a_test_path_is_one_line(pytester: pytest.Pytester,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ddp-config ../x.yaml` (separate word): pytest picks its rootdir and ini file from the words
    that look like test paths before any plugin's options are known, so an existing path outside the
    repo hides the repo's ini file. No plugin hook runs that early; the line names the form that works."""
    repo = pytester.mkdir("repo")
    repo.joinpath("pytest.ini").write_text("[pytest]\n")
    pytester.path.joinpath("x.yaml").write_text("seed: 3\n")
    repo.joinpath("test_nothing.py").write_text("def test_nothing():\n    pass\n")
    monkeypatch.chdir(repo)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-config", "../x.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert [line for line in result.stderr.lines if line.strip()] == [
        f"ERROR: --ddp-config: ../x.yaml: pytest took this existing path for a test path when it chose its rootdir "
        f"(it does so before plugin options are known), so it ignored {repo / 'pytest.ini'}; write "
        "--ddp-config=../x.yaml"]
    joined = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-config=../x.yaml")
    assert joined.ret == pytest.ExitCode.OK
    assert "configfile: pytest.ini" in joined.stdout.str()


@pytest.mark.parametrize(("args", "ini", "prefix"), [
    (["--ddp-world-size=0"], "", "--ddp-world-size: "),
    (["--ddp-config=missing.yaml"], "", "--ddp-config: missing.yaml: "),
    (["--ddp-trainer=nowhere.py:Trainer"], "", "--ddp-trainer: 'nowhere.py:Trainer': "),
    (["--ddp-report=/proc/r.json"], "", "--ddp-report: /proc/r.json: "),
    (["--ddp-max-steps=0"], "", "--ddp-max-steps: expected an integer >= 1, got 0"),
    ([], "ddp_max_steps = many", "ini option ddp_max_steps: expected an integer >= 1, got 'many'"),
    ([], "ddp_world_size = 0", "ini option ddp_world_size: "),
    ([], "ddp_config = missing.yaml", "ini option ddp_config: "),
    ([], "ddp_trainers = nowhere.py:Trainer", "ini option ddp_trainers: 'nowhere.py:Trainer': "),
    ([], "ddp_report = /proc/r.json", "ini option ddp_report: /proc/r.json: "),
], ids=lambda value: value if isinstance(value, str) else None)
def test_every_usage_line_starts_with_the_option_as_given(pytester: pytest.Pytester, args: list[str], ini: str,
                                                          prefix: str) -> None:
    """One prefix throughout: the option as the user gave it (flag or ini name), then the value."""
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    assert run_usage_error(pytester, *args).startswith(f"ERROR: {prefix}")
