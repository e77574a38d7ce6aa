"""The package's layering, read from its source (module-level, TYPE_CHECKING and in-function imports
alike): no import goes round in a circle anywhere in the package; the runner imports nothing above it;
its parent and rank sides import nothing of each other (they share `wire.py` and `frames.py`); the
pytest process loads no torch for the plugin, the suite and the report; and an
import inside a function is there only to defer a heavy one, which a `# deferred: ...` comment says.

`python tests/test_layers.py` prints the counts: modules, modules in import circles, imports in functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = "ddp_conformance.runner"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module(path): path for path in (ROOT / "ddp_conformance").rglob("*.py")}


def _statements(path: Path) -> list[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement of a file but `from __future__`, whether it sits in a function (deferred: it runs
    where the function does), and whether it sits under `if TYPE_CHECKING:` (never run)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and getattr(child, "module", "") != "__future__":
                found.append((child, in_function, typing_only))
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for branch, only in ((child.body, True), (child.orelse, typing_only)):
                    visit(ast.Module(body=branch, type_ignores=[]), in_function, only)
                continue
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)), typing_only)

    visit(ast.parse(path.read_text(), filename=str(path)), False, False)
    return found


def _names(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules one statement imports (`from . import x` imports `x` too)."""
    if isinstance(node, ast.Import):
        found = {alias.name for alias in node.names}
    else:
        package = module if FILES[module].name == "__init__.py" else module.rpartition(".")[0]
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        found = {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return {name for name in found if name in FILES and name != module}


def _graph() -> dict[str, set[str]]:
    return {module: {name for node, *_ in _statements(path) for name in _names(module, node)}
            for module, path in FILES.items()}


def _in_circles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that import themselves back through others."""
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

    return sorted(module for module in graph if reaches(module, module))


def _in_functions() -> list[tuple[str, int, bool]]:
    """(file, line, whether a `# deferred` comment on its line or over its block says why) of every
    import inside a function."""
    found = []
    for path in FILES.values():
        lines = path.read_text().splitlines()
        for node, in_function, _ in _statements(path):
            if in_function:
                first = node.lineno - 1
                while first > 0 and lines[first - 1].strip().startswith(("import ", "from ", "#")):
                    first -= 1  # up through the block of imports and comments it sits in
                said = any("# deferred" in line.lower() for line in lines[first:node.end_lineno])
                found.append((str(path.relative_to(ROOT)), node.lineno, said))
    return found


def test_no_import_goes_round_in_a_circle() -> None:
    assert _in_circles(_graph()) == []


def test_the_runner_imports_nothing_above_it() -> None:
    above = sorted((module, name) for module, names in _graph().items() if module.startswith(RUNNER)
                   for name in names if not name.startswith(RUNNER))
    assert above == []


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_parent_and_rank_sides_import_nothing_of_each_other() -> None:
    crossing = sorted((module, name) for module, names in _graph().items() for name in names
                      for mine, theirs in ((".parent", ".rank"), (".rank", ".parent"))
                      if _within(module, RUNNER + mine) and _within(name, RUNNER + theirs))
    assert crossing == []


def _top_level_graph() -> dict[str, set[str]]:
    """What importing each module imports (its imports outside functions and `if TYPE_CHECKING:`), with the plugins
    it names in `pytest_plugins`, which pytest imports with it."""
    graph = {module: {name for node, in_function, typing_only in _statements(path) if not (in_function or typing_only)
                      for name in _names(module, node)}
             for module, path in FILES.items()}
    for module, path in FILES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytest_plugins" for t in node.targets):
                graph[module] |= {name for name in ast.literal_eval(node.value) if name in FILES}
    return graph


def _reached(graph: dict[str, set[str]], starts: set[str]) -> set[str]:
    seen, todo = set(starts), list(starts)
    while todo:
        for name in graph[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


#: what a rank process runs: the rank side of the runner, a pytest process launched as a rank, the checks and the
#: trainers they build
RANK_SIDE = (f"{RUNNER}.rank", f"{RUNNER}.launched", "ddp_conformance.checks", "ddp_conformance.trainers")


def _on_rank_side(module: str) -> bool:
    return any(_within(module, side) for side in RANK_SIDE)


def test_only_the_parent_side_and_the_plugin_import_the_parent_side() -> None:
    outside = sorted((module, name) for module, names in _graph().items() for name in names
                     if _within(name, f"{RUNNER}.parent") and not _within(module, f"{RUNNER}.parent")
                     and module != "ddp_conformance.plugin")
    assert outside == []


def test_only_rank_side_code_imports_the_rank_side() -> None:
    outside = sorted((module, name) for module, names in _graph().items() for name in names
                     if _within(name, f"{RUNNER}.rank") and not _on_rank_side(module))
    assert outside == []


def test_a_module_outside_the_runner_that_both_processes_load_says_so() -> None:
    """The pytest process loads the plugin and what it names; a rank loads its side of the runner, the checks and
    the trainers. A module both load must work in either (no torch at its top, no rank state), so its docstring's
    first line begins "Both processes"."""
    graph = _top_level_graph()
    both = _reached(graph, {"ddp_conformance.plugin"}) & _reached(graph, {m for m in FILES if _on_rank_side(m)})
    silent = sorted(module for module in both if not _within(module, RUNNER) and not (
        ast.get_docstring(ast.parse(FILES[module].read_text())) or "").startswith("Both processes"))
    assert silent == []


def test_an_import_in_a_function_says_why_it_is_deferred() -> None:
    assert [f"{file}:{line}" for file, line, said in _in_functions() if not said] == []


def test_the_pytest_process_imports_no_torch_for_the_plugin_the_suite_and_the_report() -> None:
    """What pytest loads for every session stays light: torch is imported by the ranks, and by the
    rank-only modules at their top (a check, the fit recorder), never through these."""
    code = ("import sys, ddp_conformance.plugin, ddp_conformance.suite.test_conformance, "
            "ddp_conformance.suite.report, ddp_conformance.suite.unbuilt; "
            "print(sorted(m for m in ('torch', 'numpy', 'lightning') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


if __name__ == "__main__":
    print(f"modules: {len(FILES)}; modules in import circles: {len(_in_circles(_graph()))}; "
          f"imports inside functions: {len(_in_functions())}")
