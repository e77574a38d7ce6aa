"""The conformance report: a trainer x check matrix at the end of the session, and `--ddp-report` JSON.

Conformance results are recognised by two user properties the suite puts on each of its tests in
the pytest process (`conformance_trainer`, `conformance_check`). Rank 0's check sends its one result
(`ddp_conformance.checks.CheckResult`: outcome, verdict, figures) as a single `ddp.figures` value,
which the runner makes a user property; it is unpacked here once per report: its verdict onto the
report, its figures as one user property each (so JUnit XML shows every figure). Reports, not items,
are read (`pytest_runtest_logreport`), so results from pytest-xdist workers reach the controller,
which alone prints the matrix and writes the JSON. No torch imported here.

JSON shape: {"schema_version": 3, "world_size": N, "backend": "...", "results": [{"trainer", "spec",
"check", "outcome": "passed|failed|skipped", "figures": {...}, "message": "..."}]} (`trainer` is the name
the test id and the matrix use, `spec` the SPEC as given), described field by field by the JSON
Schema `report.schema.json` beside this module (`schema()`). `message` is the check's full verdict
on failure (the headline pytest shows is clipped), the reason on skip, "" on pass.

With pytest-html installed and `--html` given, each conformance test's row carries its figures and
verdict (`pytest_html.extras`); without it nothing here touches pytest-html.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Callable
from html import escape
from pathlib import Path
from typing import Any

import pytest

from ..checks import CHECK_IDS, RESULT_FIGURE, CheckResult
from ..options import settings_of, unwritable_reason, where_given

# the trainer's one name (the test id's), its SPEC as given, and the check id
TRAINER_PROPERTY, SPEC_PROPERTY, CHECK_PROPERTY = "conformance_trainer", "conformance_spec", "conformance_check"
VERDICT_ATTRIBUTE = "ddp_verdict"  # on a failed or skipped check's TestReport (an extra attribute: it crosses xdist)
SCHEMA_VERSION = 3  # of report.schema.json: raised when a field is removed, renamed or changes meaning
MATRIX_WIDTH = 120  # the terminal matrix fits this many columns, whatever the terminal (CI logs have none)
TRAINER_WIDTH = 24  # longer trainer labels wrap inside their column
GAPS = (2, 1)  # between columns: two spaces, or one where two leave no room for the matrix
MIN_COLUMN = 10  # a column is at least this wide (and its longest word); if they cannot fit: a list


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def unpack_result(report: pytest.TestReport) -> None:
    """The check's result, sent as one user property, as the report carries it: its verdict (a
    failure's or a skip's, where the test ended as the check did) as `VERDICT_ATTRIBUTE`, its figures
    as one user property each, in its place. Once per report (a report already unpacked has no result property)."""
    properties = report.user_properties
    at = next((i for i, (key, _) in enumerate(properties) if key == RESULT_FIGURE), None)
    if at is None:
        return
    result = CheckResult.from_figure(properties[at][1])
    figures = list(result.figures.items()) if result is not None else []
    report.user_properties = [*properties[:at], *figures, *properties[at + 1:]]
    if result is not None and result.outcome == report.outcome and result.verdict:
        setattr(report, VERDICT_ATTRIBUTE, result.verdict)


def _is_result(report: pytest.TestReport) -> bool:
    """The report that holds a check's outcome: its call, or a setup that did not pass."""
    return report.when == "call" or (report.when == "setup" and not report.passed)


def row_message(report: pytest.TestReport) -> str:
    """The row's message: the check's verdict where the test ended as the check did, else pytest's own (a rank
    that failed while rank 0's check passed, a harness error, a test killed)."""
    if report.passed:
        return ""
    verdict = getattr(report, VERDICT_ATTRIBUTE, None)
    if verdict:
        return str(verdict)
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, lineno, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    text = str(longrepr or "").strip()
    return text.splitlines()[0] if text else ""


class ConformanceReport:
    """One session's conformance results: collected from reports, shown and written at the end.
    A plugin object per pytest config, so nested in-process sessions (pytester) keep their own."""

    def __init__(self, config: pytest.Config, html: Any = None) -> None:
        self.config = config
        self.html = html  # pytest_html, when it is installed and writing a page
        self.results: list[dict[str, Any]] = []
        self.report_line = ""  # where --ddp-report went, or why it could not be written
        self.report_origin = where_given(config, "ddp_report")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """A failed check's verdict onto its report (read back in `pytest_runtest_logreport`, in
        the xdist controller too); with pytest-html, the verdict and figures on the test's row
        through pytest-html's documented `report.extras`."""
        report = yield
        unpack_result(report)
        properties = dict(report.user_properties)
        if CHECK_PROPERTY not in properties or not _is_result(report):
            return report
        verdict = getattr(report, VERDICT_ATTRIBUTE, None)
        if self.html is not None:
            trainer, check = properties.pop(TRAINER_PROPERTY), properties.pop(CHECK_PROPERTY)
            properties.pop(SPEC_PROPERTY, None)
            extras = self.html.extras
            figures = _jsonable(properties)
            row = _html_figures(trainer, check, figures, verdict)
            report.extras = [*getattr(report, "extras", []), extras.html(row), extras.json(figures, name="figures")]
        return report

    @pytest.hookimpl(tryfirst=True)  # before junitxml writes the properties
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        unpack_result(report)  # where a launcher added the figures after makereport
        properties = dict(report.user_properties)
        if CHECK_PROPERTY not in properties or not _is_result(report):
            return
        trainer, check = str(properties.pop(TRAINER_PROPERTY)), str(properties.pop(CHECK_PROPERTY))
        spec = str(properties.pop(SPEC_PROPERTY, trainer))
        figures = _jsonable(properties)
        self.results.append({"trainer": trainer, "spec": spec, "check": check, "outcome": report.outcome,
                             "figures": figures, "message": row_message(report)})

    def document(self) -> dict[str, Any]:
        """The JSON report. World size and backend come from the results' figures (what the ranks
        saw), else from the options."""
        settings = settings_of(self.config)
        trainers = list(settings.trainers)

        def order(result: dict[str, Any]) -> tuple[int, int]:  # xdist finishes tests in any order
            t, c = result["spec"], result["check"]
            return (trainers.index(t) if t in trainers else len(trainers),
                    CHECK_IDS.index(c) if c in CHECK_IDS else len(CHECK_IDS))

        results = sorted(self.results, key=order)
        shaped = next((r["figures"] for r in results if "world_size" in r["figures"]), {})
        return {"schema_version": SCHEMA_VERSION, "world_size": shaped.get("world_size", settings.world_size),
                "backend": shaped.get("backend", settings.backend), "results": results}

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write `--ddp-report`. Its path was checked before the tests; if writing fails anyway, the
        session still ends with its matrix and summary, one line says why, and the exit status is
        pytest's usage error (unless tests failed): a run that asked for a report and has none fails."""
        path = settings_of(self.config).report_path
        if not path or hasattr(self.config, "workerinput"):  # under xdist the controller writes it
            return
        target = Path(path).absolute()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(self.document(), indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            reason = unwritable_reason(target) or exc.strerror or str(exc)  # "File exists" would not say which
            self.report_line = f"{self.report_origin}: {path}: could not write the report: {reason}"
            if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                session.exitstatus = pytest.ExitCode.USAGE_ERROR
        else:
            self.report_line = f"ddp conformance report: {target}"

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        doc = self.document()
        if doc["results"]:
            terminalreporter.write_sep("=", f"ddp conformance (world size {doc['world_size']}, {doc['backend']})")
            for line in matrix_lines(doc):
                terminalreporter.write_line(line)
        if self.report_line:
            terminalreporter.write_line(self.report_line)


def pytest_configure(config: pytest.Config) -> None:
    html = _pytest_html() if config.getoption("htmlpath", None) else None
    config.pluginmanager.register(ConformanceReport(config, html), "ddp-conformance-report")


def schema() -> dict[str, Any]:
    """The JSON Schema of the `--ddp-report` document (shipped with the package), its check ids the
    registry's (`CHECK_IDS`): one list of checks."""
    document = json.loads((Path(__file__).with_name("report.schema.json")).read_text(encoding="utf-8"))
    document["$defs"]["result"]["properties"]["check"]["enum"] = list(CHECK_IDS)
    return document


def _pytest_html() -> Any:
    try:
        import pytest_html  # deferred: an optional plugin, imported only when --html asks for it
    except ImportError:
        return None
    return pytest_html


def _html_figures(trainer: str, check: str, figures: dict[str, Any], verdict: str | None) -> str:
    """The verdict (if any) over a table of every figure, for the report row."""
    rows = "".join(f"<tr><td>{escape(str(key))}</td><td>{escape(json.dumps(value))}</td></tr>"
                   for key, value in figures.items())
    head = f"<p><b>verdict:</b> {escape(str(verdict))}</p>" if verdict else ""
    return (f'<div class="ddp-conformance"><p>{escape(trainer)} / {escape(check)}</p>{head}'
            f"<table>{rows}</table></div>")


OUTCOME_WORDS = {"passed": "PASS", "failed": "FAIL", "skipped": "skip"}


def _words(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width`, broken only between words: a figure is never cut."""
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]


_NAME_BREAKS = re.compile(r"(?<=[_.+/:\\-])")  # a name breaks only after one of these, never inside a word


def _pieces(name: str) -> list[str]:
    return [piece for piece in _NAME_BREAKS.split(name) if piece]


def _broken(name: str, width: int) -> list[str]:
    """A trainer or check name over as many lines of `width` as it needs, broken only after `_ . + / : -`
    (a piece longer than `width` stands whole on its line: the column is made wide enough for it)."""
    lines = [""]
    for piece in _pieces(name):
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return lines


def _cell_text(result: dict[str, Any] | None, note: int | None) -> tuple[str, str]:
    """(outcome, with the number of its note below the matrix; the key figure) of one cell."""
    if result is None:
        return "-", ""
    head = OUTCOME_WORDS.get(result["outcome"], result["outcome"]) + (f" [{note}]" if note else "")
    summary = str(result["figures"].get("summary", ""))  # a skip's too, when it measured something
    return head, summary


def _cell(text: tuple[str, str], width: int) -> list[str]:
    head, summary = text
    return [head, *(_words(summary, width) if summary else [])]


def _widths(texts: list[list[tuple[str, str]]], checks: list[str], room: int) -> list[int] | None:
    """Column widths within `room`: each at least its longest word (so nothing is cut), the rest
    shared in proportion to what each column would need to fit on one line; None if impossible."""
    least, most = [], []
    for check, column in zip(checks, texts, strict=True):
        words = [w for head, summary in column for w in (head, *summary.split())]
        least.append(max(MIN_COLUMN, *(len(w) for w in words), *(len(p) + 1 for p in check.split("_"))))
        most.append(max(len(check), *(max(len(head), len(summary)) for head, summary in column)))
    spare = room - sum(least)
    if spare < 0:
        return None
    wants = [max(m - low, 0) for m, low in zip(most, least, strict=True)]
    total = sum(wants) or 1
    widths = [low + min(want, spare * want // total) for low, want in zip(least, wants, strict=True)]
    return widths


def matrix_lines(doc: dict[str, Any], width: int = MATRIX_WIDTH) -> list[str]:
    """The trainer x check matrix in `width` columns, each cell its outcome over its key figure (wrapped,
    never cut), then every failure's verdict and every skip's reason in full, numbered as in the cells.
    A row per trainer and a column per check; where the checks cannot fit side by side, a row per check
    and a column per trainer; where neither fits, one line per trainer and check."""
    results = doc["results"]
    checks = list(dict.fromkeys(r["check"] for r in results))
    trainers = list(dict.fromkeys(r["trainer"] for r in results))
    cells = {(r["trainer"], r["check"]): r for r in results}
    said = _said_once([r for r in results if r["outcome"] != "passed"])
    notes = {(r["trainer"], r["check"]): n for n, group in enumerate(said, start=1) for r in group}
    texts = {(t, c): _cell_text(cells.get((t, c)), notes.get((t, c))) for t in trainers for c in checks}
    lines = (_grid("trainer", trainers, checks, lambda t, c: texts[(t, c)], width)
             or _grid("check", checks, trainers, lambda c, t: texts[(t, c)], width)
             or _listed(trainers, checks, texts, width))
    if said:
        lines.append("")
    for n, group in enumerate(said, start=1):
        first = group[0]
        lines += textwrap.wrap(f"[{n}] {first['trainer']} / {_checks_named(group)} {first['outcome']}: "
                               f"{first['message']}", width, subsequent_indent="    ", break_long_words=False,
                               break_on_hyphens=False)
    return lines


def _said_once(results: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The results that need a note, those of one trainer with the same outcome and message under one note
    (a trainer that cannot be built skips every other check with the same reason), in order of first use."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["trainer"], r["outcome"], r["message"]), []).append(r)
    return list(groups.values())


def _checks_named(group: list[dict[str, Any]]) -> str:
    """The checks one note covers: each by name, or the first and last of more than three, with their count."""
    names = [r["check"] for r in group]
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)} checks)"


def _grid(corner: str, rows: list[str], columns: list[str], text: Callable[[str, str], tuple[str, str]],
          width: int) -> list[str] | None:
    """A row per name in `rows` and a column per name in `columns` within `width`, or None if it cannot fit."""
    longest_piece = max((len(piece) for name in rows for piece in _pieces(name)), default=0)
    label_width = max(min(max([len(corner), *(len(name) for name in rows)]), TRAINER_WIDTH), longest_piece)
    cells = [[text(row, column) for row in rows] for column in columns]
    gap, widths = next(((gap, found) for gap in GAPS if (found := _widths(
        cells, columns, width - label_width - gap * len(columns))) is not None), (0, None))
    if widths is None:
        return None
    lines = _rows([corner], [_broken(c, w) for c, w in zip(columns, widths, strict=True)], label_width, widths, gap)
    for row in rows:
        grid = [_cell(text(row, column), w) for column, w in zip(columns, widths, strict=True)]
        block = _rows(_broken(row, label_width), grid, label_width, widths, gap)
        lines += ([""] if len(block) > 1 else []) + block  # tall rows apart, so a cell's lines stay together
    return lines


def _rows(label: list[str], cells: list[list[str]], label_width: int, widths: list[int], gap: int) -> list[str]:
    """One matrix row over as many lines as its tallest cell."""
    height = max(len(label), *(len(cell) for cell in cells))
    lines = []
    for i in range(height):
        parts = [(label[i] if i < len(label) else "").ljust(label_width)]
        parts += [(cell[i] if i < len(cell) else "").ljust(w) for cell, w in zip(cells, widths, strict=True)]
        lines.append((" " * gap).join(parts).rstrip())
    return lines


def _listed(trainers: list[str], checks: list[str], texts: dict[tuple[str, str], tuple[str, str]],
            width: int) -> list[str]:
    """The matrix for a narrow terminal: a line per trainer and check."""
    lines = []
    for trainer in trainers:
        lines.append(trainer)
        for check in checks:
            cell = " ".join(part for part in texts[(trainer, check)] if part)
            lines += textwrap.wrap(f"{check}: {cell}", width, initial_indent="  ", subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False)
    return lines
