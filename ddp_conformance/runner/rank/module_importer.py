"""How a rank imports a test's module and the user's modules: the way pytest did in the parent.

Test modules are imported with pytest's assertion rewriting so a failing `assert` inside rank code
explains itself ("At index 2 diff: 3 != 4") exactly as it would in the parent. The user's other
modules the parent imported (conftests, helpers, packages: `Task.local_modules`) are imported by
name from the files the parent used, rewritten where pytest rewrote them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from typing import Any

from _pytest.assertion.rewrite import rewrite_asserts

_modules: dict[str, tuple[float, types.ModuleType]] = {}


def load_module(path: str, name: str) -> types.ModuleType:
    """Import a test module with asserts rewritten; reimported only when the file changed."""
    mtime = os.stat(path).st_mtime
    cached = _modules.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    _ensure_parents(name, path)
    module = types.ModuleType(name)
    module.__file__ = path
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module  # so objects defined there pickle and import by name
    exec(_compile(path, rewrite=True), module.__dict__)
    _modules[path] = (mtime, module)
    return module


def resolve(module: types.ModuleType, qualname: str, instance: Any = None) -> Any:
    if instance is not None:  # the parent's instance, with whatever setup_method and fixtures put there
        return getattr(instance, qualname.rsplit(".", 1)[-1])
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    if isinstance(owner, type):
        owner = owner()
    return getattr(owner, parts[-1])


class _LocalModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports, by name, the modules of the user's tree that the parent imported (conftests, test
    helpers, packages), from the files the parent used, rewriting asserts where pytest did."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, bool]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.files:
            return None
        file, _ = self.files[name]
        is_package = os.path.basename(file) == "__init__.py"
        spec = importlib.util.spec_from_file_location(
            name, file, loader=self, submodule_search_locations=[os.path.dirname(file)] if is_package else None)
        return spec

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        file, rewritten = self.files[module.__name__]
        exec(_compile(file, rewritten), module.__dict__)


_local_modules = _LocalModules()


def _compile(path: str, rewrite: bool) -> Any:
    with open(path, "rb") as handle:
        source = handle.read()
    tree = ast.parse(source, filename=path)
    if rewrite:
        rewrite_asserts(tree, source, path, None)
    return compile(tree, path, "exec", dont_inherit=True)


def know_local_modules(files: dict[str, tuple[str, bool]]) -> None:
    if files and not files.items() <= _local_modules.files.items():
        _local_modules.files.update(files)
    if files and _local_modules not in sys.meta_path:
        sys.meta_path.insert(0, _local_modules)


def _ensure_parents(name: str, path: str) -> None:
    """Make `a` and `a.b` importable for a module `a.b.c` (relative imports need them), from the
    parent's files where it had them, else as bare packages over the matching directories."""
    parts = name.split(".")
    directory = os.path.dirname(path)
    for depth in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            try:
                importlib.import_module(parent)
            except ImportError:
                package = types.ModuleType(parent)
                package.__path__ = [directory]
                sys.modules[parent] = package
        directory = os.path.dirname(directory)
