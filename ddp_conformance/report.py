"""The conformance report: a trainer x check matrix at the end of the session, and `--ddp-report` JSON.

Conformance results are recognised by two user properties the suite puts on each of its tests in
the pytest process (`conformance_trainer`, `conformance_check`); the rest of the test's user
properties are rank 0's `ddp.figures` (which the plugin also writes to JUnit XML). Reports, not
items, are read (`pytest_runtest_logreport`), so results from pytest-xdist workers reach the
controller, which alone prints the matrix and writes the JSON. No torch, no checks imported here.

JSON shape: {"world_size": N, "backend": "...", "results": [{"trainer", "check", "outcome":
"passed|failed|skipped", "figures": {...}, "message": "..."}]}. `message` is the check's full
verdict on failure (the headline pytest shows is clipped), the reason on skip, "" on pass.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

TRAINER_PROPERTY, CHECK_PROPERTY = "conformance_trainer", "conformance_check"
CELL_WIDTH = 30


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


def _message(report: pytest.TestReport, figures: dict[str, Any]) -> str:
    if report.passed:
        return ""
    if report.failed and figures.get("verdict"):
        return str(figures["verdict"])
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, lineno, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    text = str(longrepr or "").strip()
    return text.splitlines()[0] if text else ""


class ConformanceReport:
    """One session's conformance results: collected from reports, shown and written at the end.
    A plugin object per pytest config, so nested in-process sessions (pytester) keep their own."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        properties = dict(report.user_properties)
        if CHECK_PROPERTY not in properties:
            return
        if not (report.when == "call" or (report.when == "setup" and not report.passed)):
            return
        trainer, check = str(properties.pop(TRAINER_PROPERTY)), str(properties.pop(CHECK_PROPERTY))
        figures = _jsonable(properties)
        self.results.append({"trainer": trainer, "check": check, "outcome": report.outcome, "figures": figures,
                             "message": _message(report, figures)})

    def document(self) -> dict[str, Any]:
        """The JSON report. World size and backend come from the results' figures (what the ranks
        saw), else from the options."""
        from .checks import CHECK_IDS
        from .plugin import settings_of

        settings = settings_of(self.config)
        trainers = list(settings.trainers)

        def order(result: dict[str, Any]) -> tuple[int, int]:  # xdist finishes tests in any order
            t, c = result["trainer"], result["check"]
            return (trainers.index(t) if t in trainers else len(trainers),
                    CHECK_IDS.index(c) if c in CHECK_IDS else len(CHECK_IDS))

        results = sorted(self.results, key=order)
        shaped = next((r["figures"] for r in results if "world_size" in r["figures"]), {})
        return {"world_size": shaped.get("world_size", settings.world_size),
                "backend": shaped.get("backend", settings.backend), "results": results}

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from .plugin import settings_of

        path = settings_of(self.config).report_path
        if path and not hasattr(self.config, "workerinput"):  # under xdist the controller writes it
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(self.document(), indent=2) + "\n", encoding="utf-8")

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        doc = self.document()
        if not doc["results"]:
            return
        terminalreporter.write_sep("=", f"ddp conformance (world size {doc['world_size']}, {doc['backend']})")
        for line in matrix_lines(doc):
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ConformanceReport(config), "ddp-conformance-report")


def _label(spec: str) -> str:
    from .checks import trainer_label

    return trainer_label(spec)


def _cell(result: dict[str, Any]) -> str:
    outcome = {"passed": "PASS", "failed": "FAIL", "skipped": "skip"}.get(result["outcome"], result["outcome"])
    summary = str(result["figures"].get("summary", ""))  # a skip's too, when it measured something
    text = f"{outcome} {summary}".strip()
    return text if len(text) <= CELL_WIDTH else text[:CELL_WIDTH - 3] + "..."


def matrix_lines(doc: dict[str, Any]) -> list[str]:
    """The trainer x check matrix, then one line per failure or skip with its message."""
    results = doc["results"]
    checks: list[str] = []
    trainers: list[str] = []
    for r in results:
        if r["check"] not in checks:
            checks.append(r["check"])
        if r["trainer"] not in trainers:
            trainers.append(r["trainer"])
    cells = {(r["trainer"], r["check"]): r for r in results}
    width = max([len("trainer"), *(len(_label(t)) for t in trainers)])
    widths = [max(len(c), CELL_WIDTH) for c in checks]
    lines = ["  ".join(["trainer".ljust(width), *(c.ljust(w) for c, w in zip(checks, widths, strict=True))])]
    for trainer in trainers:
        row = [_label(trainer).ljust(width)]
        for check, w in zip(checks, widths, strict=True):
            result = cells.get((trainer, check))
            row.append((_cell(result) if result else "-").ljust(w))
        lines.append("  ".join(row).rstrip())
    notes = [r for r in results if r["outcome"] != "passed"]
    if notes:
        lines.append("")
    for r in notes:
        lines.append(f"{_label(r['trainer'])} / {r['check']} {r['outcome']}: {r['message']}")
    return lines
