"""The code's shape that no linter holds: no function of the package takes more than `MOST_PARAMETERS`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a function that needs more takes a value that says what the parameters have in common
MOST_PARAMETERS = 6


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Its parameters by name, `self` and `cls` not counted, `*args` and `**kwargs` not either."""
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    return [a.arg for a in named if a.arg not in ("self", "cls")]


def too_many(source: str) -> list[str]:
    tree = ast.parse(source)
    return [f"{node.name} (line {node.lineno}): {len(parameters(node))}" for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(parameters(node)) > MOST_PARAMETERS]


def test_no_function_takes_more_than_six_parameters() -> None:
    found = {str(path.relative_to(ROOT)): too_many(path.read_text())
             for path in sorted((ROOT / "ddp_conformance").rglob("*.py"))}
    assert {path: functions for path, functions in found.items() if functions} == {}


def test_the_count_tells_seven_from_six() -> None:
    assert too_many("def f(self, a, b, c, d, e, f, *args, **kwargs): ...") == []
    assert too_many("class C:\n    def f(self, a, b, c, d, e, f, *, g=1): ...") == ["f (line 2): 7"]
