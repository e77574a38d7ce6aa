"""Used from another repo, as a CI gate: examples/ci_gate (its own loop, one adapter, one line of
pytest config) driven end to end; and faulty trainers that must give one clear line each while the
session goes on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ["--pyargs", "ddp_conformance.suite", "--ddp-world-size", "2", "-p", "no:cacheprovider"]


def results(path: Path) -> dict[str, dict]:
    return {entry["check"]: entry for entry in json.loads(path.read_text())["results"]}


def test_example_repo_is_gated_by_the_suite(pytester: pytest.Pytester) -> None:
    repo = pytester.path / "repo"
    shutil.copytree(ROOT / "examples" / "ci_gate", repo)

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", *SUITE, *extra], cwd=repo, capture_output=True,
                              text=True, timeout=240)

    ok = run("--ddp-report", "report.json", "--junitxml", "junit.xml")
    assert ok.returncode == 0, ok.stdout[-3000:]
    found = results(repo / "report.json")
    assert [found[c]["outcome"] for c in ("rank_participation", "sampler_disjointness", "data_consistency",
                                         "gradient_equivalence", "resume_fidelity")] == ["passed"] * 5
    # the example's model (712 B of gradients) ignores the config's model section: too small to measure, and said
    bucket = found["bucket_view_memory"]
    assert bucket["outcome"] == "skipped" and "too small to measure" in bucket["message"], bucket
    assert "<property " in (repo / "junit.xml").read_text()  # the figures reach the CI's JUnit view

    # the repo's loop loses its set_epoch call: the gate goes red (pytest's exit code 1)
    train = repo / "train.py"
    train.write_text(train.read_text().replace("    sampler.set_epoch(epoch)\n", ""))
    red = run("-k", "sampler_disjointness", "--ddp-report", "red.json")
    assert red.returncode == 1, red.stdout[-3000:]
    verdict = results(repo / "red.json")["sampler_disjointness"]
    assert verdict["outcome"] == "failed" and "set_epoch" in verdict["message"]


@pytest.mark.slow  # a whole session; tests/checks/test_failure_reports.py reports an unbuildable trainer once
def test_faulty_trainers_get_one_clear_line_and_the_session_goes_on(pytester: pytest.Pytester) -> None:
    faulty = ROOT / "fixtures" / "faulty"
    result = pytester.runpytest_subprocess(
        *SUITE, "--ddp-trainer", f"{faulty / 'truncated_checkpoint.py'}:Trainer",
        "--ddp-trainer", f"{faulty / 'raising_adapter.py'}:Trainer",
        "-k", "resume_fidelity or gradient_equivalence", "--ddp-report", "report.json",
    )
    result.assert_outcomes(passed=1, failed=3)  # truncated's gradient check passes after the failures
    out = result.stdout.str()
    # the thing at fault is named: the trainer, the call, the checkpoint file
    result.stdout.fnmatch_lines(
        ["2 of 2 ranks failed: ranks 0, 1 failed: AdapterError: trainer truncated_checkpoint: resume raised *"])
    assert any("AdapterError" in line and "(called as resume(" in line and ".pt, 25)" in line
               for line in result.stdout.lines), out
    result.stdout.fnmatch_lines(
        ["2 of 2 ranks failed: ranks 0, 1 failed: AdapterError: trainer raising_adapter: * raised KeyError: "
         "*model.hidden_sizes is missing*"]
    )
    assert out.count("Traceback (most recent call last)") == 0


@pytest.mark.slow  # two whole sessions; test_example_repo_is_gated_by_the_suite runs the command once
def test_the_same_command_runs_twice_with_paths_relative_to_where_it_was_typed(pytester: pytest.Pytester) -> None:
    """A repo without a pytest ini file, a file SPEC and a report outside the repo: once the report
    exists, pytest (which picks its rootdir before it knows plugin options) takes `../logs/r.json` for
    a test path and moves the rootdir up; every path the user typed must still mean the same file.
    Collection is where a SPEC is resolved (and where it failed), so `--collect-only` proves it."""
    repo = pytester.path / "repo"
    shutil.copytree(ROOT / "examples" / "ci_gate", repo)
    (repo / "pytest.ini").unlink(missing_ok=True)
    (pytester.path / "logs").mkdir()
    report = pytester.path / "logs" / "r.json"
    command = [sys.executable, "-m", "pytest", "--pyargs", "ddp_conformance.suite", "-p", "no:cacheprovider",
               "--ddp-world-size", "1", "-k", "rank_participation", "--collect-only", "-q",
               "--ddp-trainer", "conformance_adapter.py:MyTrainer", "--ddp-report", "../logs/r.json"]
    for attempt in ("first", "second"):
        run = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{attempt} run: {run.stdout[-2000:]}{run.stderr[-2000:]}"
        assert "test_conformance[conformance_adapter.MyTrainer-rank_participation]" in run.stdout, run.stdout
        assert json.loads(report.read_text())["results"] == [], attempt  # written where it was typed
        report.write_text(json.dumps({"stale": attempt}))


def test_a_report_path_that_would_hide_the_repos_ini_file_is_one_usage_line(pytester: pytest.Pytester) -> None:
    """With the repo's pytest.ini naming its adapter, `--ddp-report ../logs/r.json` (separate word)
    makes pytest, once that file exists, choose a rootdir above the repo and ignore the ini file:
    the run would quietly check the references instead. It stops with one line saying what to write."""
    repo = pytester.path / "repo"
    shutil.copytree(ROOT / "examples" / "ci_gate", repo)
    (pytester.path / "logs").mkdir()
    (pytester.path / "logs" / "r.json").write_text("{}")
    base = [sys.executable, "-m", "pytest", "--pyargs", "ddp_conformance.suite", "-p", "no:cacheprovider",
            "--collect-only", "-q"]
    separate = subprocess.run([*base, "--ddp-report", "../logs/r.json"], cwd=repo, capture_output=True, text=True,
                              timeout=120)
    assert separate.returncode == 4
    assert separate.stderr.strip().splitlines() == [
        "ERROR: --ddp-report: ../logs/r.json: pytest took this existing path for a test path when it chose its "
        f"rootdir (it does so before plugin options are known), so it ignored {repo / 'pytest.ini'}; write "
        "--ddp-report=../logs/r.json"]
    joined = subprocess.run([*base, "--ddp-report=../logs/r.json"], cwd=repo, capture_output=True, text=True,
                            timeout=120)
    assert joined.returncode == 0 and "conformance_adapter.MyTrainer-rank_participation" in joined.stdout, joined.stdout
