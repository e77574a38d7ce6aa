"""The runner's layering, read from its source: it imports nothing above it, its parent and rank sides
import nothing of each other (they share `wire.py` and `frames.py`), and no import goes round in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[2] / "ddp_conformance" / "runner"
PACKAGE = "ddp_conformance.runner"


def _module(path: Path) -> str:
    parts = path.relative_to(RUNNER.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ddp_conformance module `path` imports, at module level or inside a function."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("ddp_conformance")}


def _graph() -> dict[str, set[str]]:
    """Each runner module's imports: the runner's own modules, and anything of the package above it."""
    files = {_module(path): path for path in RUNNER.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        names = _imports(path)
        graph[module] = {name for name in names if (name in files and name != module) or not name.startswith(PACKAGE)}
    return graph


def test_the_runner_imports_nothing_above_it() -> None:
    above = sorted((module, name) for module, names in _graph().items() for name in names
                   if not name.startswith(PACKAGE))
    assert above == []


def test_the_parent_and_rank_sides_import_nothing_of_each_other() -> None:
    crossing = sorted((module, name) for module, names in _graph().items() for name in names
                      for mine, theirs in ((".parent", ".rank"), (".rank", ".parent"))
                      if module.startswith(PACKAGE + mine) and name.startswith(PACKAGE + theirs))
    assert crossing == []


def test_no_import_goes_round_in_a_circle() -> None:
    imports = _graph()
    graph = {module: {name for name in names if name in imports} for module, names in imports.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for name in graph[todo.pop()]:
                if name == goal:
                    return True
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
        return False

    circles = sorted(module for module in graph if reaches(module, module))
    assert circles == []
