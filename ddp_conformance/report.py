"""The conformance report: a trainer x check matrix at the end of the session, and `--ddp-report` JSON.

Conformance results are the tests of a module that sets `CONFORMANCE_SUITE = True`
(`ddp_conformance.suite.test_conformance`), parametrized with `trainer` and `check`. Their figures
are rank 0's `ddp.figures`, which the plugin already puts in `item.user_properties` (hence JUnit
XML properties); this module only collects them. It imports neither torch nor the checks.

JSON shape: {"world_size": N, "backend": "...", "results": [{"trainer", "check", "outcome":
"passed|failed|skipped", "figures": {...}, "message": "..."}]}. `message` is the check's full
verdict on failure (the headline pytest shows is clipped), the reason on skip, "" on pass.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

RESULTS_KEY = pytest.StashKey[list[dict[str, Any]]]()
SHAPE_KEY = pytest.StashKey[dict[str, Any]]()
CELL_WIDTH = 30


def conformance_id(item: pytest.Item) -> tuple[str, str] | None:
    """(trainer SPEC, check id) when `item` is a conformance test, else None."""
    module = getattr(item, "module", None)
    callspec = getattr(item, "callspec", None)
    if module is None or callspec is None or not getattr(module, "CONFORMANCE_SUITE", False):
        return None
    params = callspec.params
    if "trainer" not in params or "check" not in params:
        return None
    return str(params["trainer"]), str(params["check"])


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    ident = conformance_id(item)
    if ident is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return report
    figures = _jsonable(dict(item.user_properties))
    results = item.config.stash.setdefault(RESULTS_KEY, [])
    results.append({"trainer": ident[0], "check": ident[1], "outcome": report.outcome,
                    "figures": figures, "message": _message(report, figures)})
    shape = item.config.stash.setdefault(SHAPE_KEY, {})
    if "world_size" in figures and "world_size" not in shape:
        shape.update(world_size=figures["world_size"], backend=figures.get("backend"))
    if "world_size" not in shape:
        from .plugin import PLAN_KEY

        plan = item.stash.get(PLAN_KEY, None)
        if plan is not None:
            shape.update(world_size=plan.world_size, backend=plan.backend)
    return report


def document(config: pytest.Config) -> dict[str, Any]:
    """The JSON report of this session."""
    from .plugin import settings_of

    settings = settings_of(config)
    shape = config.stash.get(SHAPE_KEY, {})
    return {"world_size": shape.get("world_size", settings.world_size),
            "backend": shape.get("backend", settings.backend),
            "results": config.stash.get(RESULTS_KEY, [])}


def pytest_sessionfinish(session: pytest.Session) -> None:
    from .plugin import settings_of

    path = settings_of(session.config).report_path
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(document(session.config), indent=2) + "\n", encoding="utf-8")


def _label(spec: str) -> str:
    from .checks import trainer_label

    return trainer_label(spec)


def _cell(result: dict[str, Any]) -> str:
    outcome = {"passed": "PASS", "failed": "FAIL", "skipped": "skip"}.get(result["outcome"], result["outcome"])
    summary = str(result["figures"].get("summary", "")) if result["outcome"] == "passed" else ""
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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    doc = document(config)
    if not doc["results"]:
        return
    terminalreporter.write_sep("=", f"ddp conformance (world size {doc['world_size']}, {doc['backend']})")
    for line in matrix_lines(doc):
        terminalreporter.write_line(line)
