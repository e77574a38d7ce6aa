"""The conformance report: the terminal matrix in 120 columns with no figure cut, the verdicts in full
below it, the `--ddp-report` JSON against its schema, and figures on pytest-html's rows.

Rendering is tested on results recorded from a real run (`data/report_ws4.json`: both references
and two failing mutants at world size 4, 2-core machine); one cheap real run (two trainers, two quick
checks, world size 2) covers the same from end to end, JSON schema and HTML included.
"""

from __future__ import annotations

import copy
import html
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddp_conformance.checks import CHECK_IDS, FAILED, PASSED, RESULT_FIGURE, SKIPPED, CheckResult
from ddp_conformance.suite.report import MATRIX_WIDTH, matrix_lines, row_message, schema, unpack_result
from ddp_conformance.trainers.spec import trainer_labels

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads((Path(__file__).parent / "data" / "report_ws4.json").read_text())
MUTANT = ROOT / "fixtures" / "mutants" / "no_set_epoch.py"



def assert_fits_and_nothing_is_cut(doc: dict[str, Any], lines: list[str], width: int = MATRIX_WIDTH) -> None:
    """Every line within `width`; every figure of every cell whole on some line; every failure's
    verdict and skip's reason in full, in order, below the matrix."""
    assert lines and all(len(line) <= width for line in lines), max(lines, key=len)
    tokens = {token for line in lines for token in line.split()}
    for result in doc["results"]:
        summary = str(result["figures"].get("summary", "")) if result["outcome"] != "skipped" else ""
        missing = [token for token in summary.split() if token not in tokens]
        assert not missing, f"{result['trainer']} / {result['check']}: {missing} cut from the matrix"
    below = " ".join(line.strip() for line in lines)
    notes: dict[tuple[str, str, str], list[str]] = {}  # one note per trainer, outcome and message
    for result in doc["results"]:
        if result["outcome"] != "passed":
            notes.setdefault((result["trainer"], result["outcome"], result["message"]), []).append(result["check"])
    for n, ((trainer, outcome, message), checks) in enumerate(notes.items(), start=1):
        named = ", ".join(checks) if len(checks) <= 3 else f"{checks[0]} ... {checks[-1]} ({len(checks)} checks)"
        assert f"[{n}] {trainer} / {named} {outcome}: " + " ".join(message.split()) in below
    numbered = [line for line in lines if line.startswith("[")]
    assert len(numbered) == len(notes), "a note said twice for one trainer, or one left out"


def test_matrix_fits_120_columns_for_both_references_and_failing_mutants() -> None:
    trainers = {r["trainer"] for r in RECORDED["results"]}
    assert {"torch", "lightning"} <= trainers and any(r["outcome"] == "failed" for r in RECORDED["results"])
    lines = matrix_lines(RECORDED)
    assert_fits_and_nothing_is_cut(RECORDED, lines)
    assert lines[0].split()[0] == "trainer"
    header = lines[0].split()[1:] + lines[1].split()  # a check id too wide for its column goes on two lines
    for check in dict.fromkeys(r["check"] for r in RECORDED["results"]):  # the checks of that recorded run
        assert check in header or any(a + b == check for a in header for b in header), (check, header)
    assert any(line.startswith("summed_loss") and "FAIL [1]" in line for line in lines)
    # the figure the old matrix cut ("PASS max |d| 6e-08 @7 (ckpt...") is whole now
    assert any("max |d| 6e-08 @7" in line for line in lines) and any("(ckpt @3)" in line for line in lines)


def test_matrix_with_long_figures_and_labels_still_fits() -> None:
    doc = copy.deepcopy(RECORDED)
    for result in doc["results"]:
        result["trainer"] = result["trainer"].replace("summed_loss", "a_very_long_trainer_file_name_for_the_loss")
        if result["check"] == "bucket_view_memory":
            result["figures"]["summary"] = "saved 1609792 B = 100.1% of grads, 17.2% of the step's peak"
    assert_fits_and_nothing_is_cut(doc, matrix_lines(doc))


def _labels_in_matrix(replace: str) -> list[str]:
    doc = copy.deepcopy(RECORDED)
    for result in doc["results"]:
        result["trainer"] = result["trainer"].replace("summed_loss", replace)
    lines = matrix_lines(doc)
    assert_fits_and_nothing_is_cut(doc, lines)
    return [line.split()[0] for line in lines if line and not line.startswith((" ", "["))]


def test_a_trainer_name_is_broken_between_its_parts_never_inside_a_word() -> None:
    labels = _labels_in_matrix("conformance_adapter.MyTrainer")
    assert labels[labels.index("conformance_adapter."):][:2] == ["conformance_adapter.", "MyTrainer"], labels
    labels = _labels_in_matrix("averyveryverylongtrainerfilenamewithoutanybreak.Trainer")
    assert "averyveryverylongtrainerfilenamewithoutanybreak." in labels, labels  # wider than the column: whole


def test_two_specs_that_would_share_a_name_keep_their_specs_as_names() -> None:
    labels = trainer_labels(["a/conformance_adapter.py:MyTrainer", "b/conformance_adapter.py:MyTrainer", "torch"])
    assert labels == {"a/conformance_adapter.py:MyTrainer": "a/conformance_adapter.py:MyTrainer",
                      "b/conformance_adapter.py:MyTrainer": "b/conformance_adapter.py:MyTrainer", "torch": "torch"}


def test_narrower_widths_fit_and_too_narrow_becomes_a_list() -> None:
    assert_fits_and_nothing_is_cut(RECORDED, matrix_lines(RECORDED, width=80), width=80)
    lines = matrix_lines(RECORDED, width=50)
    assert_fits_and_nothing_is_cut(RECORDED, lines, width=50)
    assert "  resume_fidelity: PASS max |d| 6e-08 @7 (ckpt @3)" in lines


def test_identical_skip_reasons_are_said_once_for_the_checks_they_cover() -> None:
    """A trainer that cannot be built fails its first check and skips every other with one reason."""
    reason = "trainer broken could not be built: see test_conformance[broken-rank_participation]"
    results = [{"trainer": "broken", "spec": "broken", "check": CHECK_IDS[0], "outcome": "failed",
                "figures": {}, "message": "could not be built: ImportError: no module named nope"}]
    results += [{"trainer": "broken", "spec": "broken", "check": check, "outcome": "skipped", "figures": {},
                 "message": reason} for check in CHECK_IDS[1:]]
    results += [{"trainer": "torch", "spec": "torch", "check": check, "outcome": "skipped", "figures": {},
                 "message": reason} for check in CHECK_IDS[1:3]]  # the same words for another trainer: its own note
    doc = {"world_size": 2, "backend": "gloo", "results": results}
    lines = matrix_lines(doc)
    below = " ".join(line.strip() for line in lines)
    assert below.count(reason) == 2, lines
    assert f"[2] broken / {CHECK_IDS[1]} ... {CHECK_IDS[-1]} ({len(CHECK_IDS) - 1} checks) skipped: {reason}" in below
    assert f"[3] torch / {CHECK_IDS[1]}, {CHECK_IDS[2]} skipped: {reason}" in below
    assert any("skip [2]" in line for line in lines) and not any("[4]" in line for line in lines)


def test_the_schema_is_valid_and_names_every_check() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a dev extra")
    jsonschema.Draft202012Validator.check_schema(schema())
    assert schema()["$defs"]["result"]["properties"]["check"]["enum"] == list(CHECK_IDS)
    assert schema()["properties"]["schema_version"]["const"] == RECORDED["schema_version"] == 3


def test_the_recorded_report_validates_and_broken_ones_do_not() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a dev extra")
    validator = jsonschema.Draft202012Validator(schema())
    assert not list(validator.iter_errors(RECORDED))
    for breakage in (lambda d: d.pop("schema_version"), lambda d: d["results"][0].update(outcome="green"),
                     lambda d: d["results"][0]["figures"].update(notes="not a list"),
                     lambda d: d["results"][0].update(extra=1)):
        broken = copy.deepcopy(RECORDED)
        breakage(broken)
        assert list(validator.iter_errors(broken)), "the schema accepted a broken report"


@pytest.fixture(scope="module")  # --dist loadfile: one worker runs the whole module
def real_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The suite on the torch reference and a mutant that fails the sampler check, two quick checks,
    world size 2, with --ddp-report (and --html when pytest-html is installed)."""
    workdir = tmp_path_factory.mktemp("report")
    report, page = workdir / "report.json", workdir / "report.html"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "ddp_conformance.suite",
               "--ddp-world-size", "2", "--ddp-report", str(report), "--ddp-trainer", "torch",
               "--ddp-trainer", f"{MUTANT}:Trainer", "-k", "sampler_disjointness or gradient_equivalence", "-rA"]
    has_html = _has_pytest_html()
    if has_html:
        command += [f"--html={page}", "--self-contained-html"]
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=240)
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"proc": proc, "doc": json.loads(report.read_text()), "html": page.read_text() if has_html else None}


def _has_pytest_html() -> bool:
    try:
        import pytest_html  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow  # one whole suite session; test_suite.py checks its own session's report and matrix
def test_a_real_run_writes_a_report_its_schema_accepts(real_run: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a dev extra")
    doc = real_run["doc"]
    jsonschema.validate(doc, schema(), cls=jsonschema.Draft202012Validator)
    assert doc["schema_version"] == 3 and (doc["world_size"], doc["backend"]) == (2, "gloo")
    outcomes = {(r["trainer"], r["check"]): r["outcome"] for r in doc["results"]}
    assert outcomes == {("torch", "sampler_disjointness"): "passed", ("torch", "gradient_equivalence"): "passed",
                        ("no_set_epoch", "sampler_disjointness"): "failed",
                        ("no_set_epoch", "gradient_equivalence"): "passed"}
    # one name everywhere: the JSON's trainer is the test id's, and the SPEC is kept beside it
    for result in doc["results"]:
        assert f"test_conformance[{result['trainer']}-{result['check']}]" in real_run["proc"].stdout
    assert {r["spec"] for r in doc["results"]} == {"torch", f"{MUTANT}:Trainer"}


@pytest.mark.slow  # one whole suite session; test_suite.py checks its own session's report and matrix
def test_a_real_run_prints_a_matrix_that_fits(real_run: dict[str, Any]) -> None:
    out = real_run["proc"].stdout.splitlines()
    start = next(i for i, line in enumerate(out) if "ddp conformance (world size 2, gloo)" in line)
    end = next(i for i, line in enumerate(out) if i > start and line.startswith("====="))
    assert_fits_and_nothing_is_cut(real_run["doc"], out[start + 1:end])
    assert "set_epoch" in " ".join(out[start + 1:end])  # the mutant's verdict, below the matrix


@pytest.mark.skipif(not _has_pytest_html(), reason="pytest-html is not installed (a dev extra)")
@pytest.mark.slow  # one whole suite session; test_suite.py checks its own session's report and matrix
def test_pytest_html_rows_carry_the_figures_and_the_verdict(real_run: dict[str, Any]) -> None:
    blob = re.search(r'data-jsonblob="([^"]*)"', real_run["html"])
    assert blob, "pytest-html's data blob not found: its page layout changed"
    tests = json.loads(html.unescape(blob.group(1)))["tests"]
    failing = doc_result(real_run["doc"], "no_set_epoch", "sampler_disjointness")
    rows = {test_id: entries for test_id, entries in tests.items() if "test_conformance[" in test_id}
    assert len(rows) == 4
    (mutant_row,) = [entries for test_id, entries in rows.items() if "no_set_epoch-sampler_disjointness" in test_id]
    contents = " ".join(str(extra.get("content", "")) for entry in mutant_row for extra in entry.get("extras", []))
    assert html.escape(failing["message"]) in contents
    assert "<td>summary</td>" in contents and html.escape(json.dumps(failing["figures"]["summary"])) in contents
    formats = {extra["format_type"] for entry in mutant_row for extra in entry.get("extras", [])}
    assert formats == {"html", "json"}


def doc_result(doc: dict[str, Any], label: str, check: str) -> dict[str, Any]:
    return next(r for r in doc["results"] if r["trainer"] == label and r["check"] == check)


def _session(checks: tuple[str, ...]) -> list[dict]:
    results = [{"trainer": t, "check": c, "outcome": "passed", "figures": {"summary": "ok"}, "message": ""}
               for t in ("torch", "x") for c in checks]
    grads = checks.index("gradient_equivalence")
    results[len(checks) + grads] = {"trainer": "x", "check": checks[grads], "outcome": "failed", "figures": {},
                                    "message": "gradients are exactly 1/2 of the single-process gradients: ..."}
    return results


MATRIX_CHECKS = CHECK_IDS[:6]  # a session that selects some checks (-k): their matrix fits 120 columns


def test_matrix_has_a_row_per_trainer_and_lists_failures_with_their_verdict():
    lines = matrix_lines({"world_size": 2, "backend": "gloo", "results": _session(MATRIX_CHECKS)})
    # a check id too wide for its column goes on as many lines as it needs, broken after its underscores
    header = lines[:lines.index("")]
    starts = [m.start() for m in re.finditer(r"\S+", header[0])]
    assert header[0].split()[0] == "trainer"
    names = ["".join(line[start:].split(maxsplit=1)[0] if line[start:start + 1].strip() else "" for line in header)
             for start in starts[1:]]
    assert names == list(MATRIX_CHECKS), header
    torch_row = lines.index(next(line for line in lines if line.startswith("torch")))
    n = len(MATRIX_CHECKS)
    assert lines[torch_row].count("PASS") == n and lines[torch_row + 1].split() == ["ok"] * n
    x_row = next(line for line in lines if line.startswith("x "))
    expected = [w for c in MATRIX_CHECKS for w in (["FAIL", "[1]"] if c == "gradient_equivalence" else ["PASS"])]
    assert x_row.split() == ["x", *expected]
    assert lines[-1] == ("[1] x / gradient_equivalence failed: "
                         "gradients are exactly 1/2 of the single-process gradients: ...")


def test_checks_too_many_to_stand_side_by_side_become_the_rows():
    lines = matrix_lines({"world_size": 2, "backend": "gloo", "results": _session(CHECK_IDS)})
    assert lines[0].split() == ["check", "torch", "x"] and all(len(line) <= 120 for line in lines)
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:] if line and not line.startswith((" ", "["))}
    assert list(rows) == list(CHECK_IDS)
    assert all(cells == (["PASS", "FAIL", "[1]"] if check == "gradient_equivalence" else ["PASS", "PASS"])
               for check, cells in rows.items()), rows
    assert lines[-1] == ("[1] x / gradient_equivalence failed: "
                         "gradients are exactly 1/2 of the single-process gradients: ...")


def test_a_session_too_wide_either_way_is_listed_a_line_per_trainer_and_check():
    trainers = [f"LightningTransformerNumber{n}" for n in range(8)]  # no place to break a name
    results = [{"trainer": t, "check": c, "outcome": "passed", "figures": {"summary": "ok"}, "message": ""}
               for t in trainers for c in CHECK_IDS]
    lines = matrix_lines({"world_size": 2, "backend": "gloo", "results": results})
    assert lines[0] == trainers[0] and f"  {CHECK_IDS[-1]}: PASS ok" in lines
    assert len(lines) == len(trainers) * (1 + len(CHECK_IDS))


@pytest.mark.parametrize(("outcome", "sent", "message"), [
    ("failed", CheckResult(FAILED, "gradients are 1/2", {"worst": 0.5}), "gradients are 1/2"),
    ("skipped", CheckResult(SKIPPED, "the trainer has no checkpoint", {"worst": 0.5}),
     "the trainer has no checkpoint"),
    ("passed", CheckResult(PASSED, "", {"worst": 0.5}), ""),
    # rank 0's check passed, another rank's failed: the test's outcome stands, with pytest's own message
    ("failed", CheckResult(PASSED, "", {"worst": 0.5}), "rank 1 failed: RuntimeError: boom"),
])
def test_the_row_takes_the_verdict_and_figures_from_the_checks_one_value(
        outcome: str, sent: CheckResult, message: str) -> None:
    longrepr = "rank 1 failed: RuntimeError: boom" if outcome == "failed" else (
        ("x.py", 1, "Skipped: pytest's own reason") if outcome == "skipped" else None)
    report = pytest.TestReport("t.py::test_conformance[t-c]", ("t.py", 1, "test_conformance"), {}, outcome,
                               longrepr, "call", user_properties=[(RESULT_FIGURE, sent.as_figure())])
    unpack_result(report)
    assert report.user_properties == [("worst", 0.5)]
    assert row_message(report) == message
    unpack_result(report)  # once per report: the figures are not unpacked twice
    assert report.user_properties == [("worst", 0.5)]
