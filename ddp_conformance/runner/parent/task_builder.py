"""A collected test as a `wire.Task`: where its function lives and the fixture values it was given.

The fixture values are pickled once here (pytest's built-in fixtures as their stand-ins), with the
parent's Config recipe, the conftests that apply to the test and the user's modules the parent
imported, so that a rank can import and call the test as pytest did.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

from ..wire import Task
from .config_recipe import conftests_of, recipe_of
from .stand_ins import parent_stand_in, unpicklable_message


class UnpicklableFixture(Exception):
    """A fixture value (or the test's class instance) that cannot be sent to the ranks; its message is
    the one line the test fails with."""


def make_task(item: pytest.Function) -> Task:
    """The test reference sent to the ranks: module, qualified name and the fixture values."""
    args: dict[str, Any] = {}
    for name in item._fixtureinfo.argnames:
        value = item.funcargs[name]
        stand_in = parent_stand_in(name, value, item)
        args[name] = value if stand_in is None else stand_in
    funcargs = _pickled_funcargs(args)
    module = item.module
    assert module is not None and module.__file__ is not None
    qualname = item.originalname
    if item.cls is not None:
        qualname = f"{item.cls.__qualname__}.{qualname}"
    tbstyle = item.config.getoption("tbstyle", "auto")
    instance = None
    if item.instance is not None:
        try:
            instance = pickle.dumps(item.instance)
        except Exception as exc:
            raise UnpicklableFixture(
                f"the instance of {item.cls.__qualname__ if item.cls else 'the test class'} cannot be sent to the "
                f"ranks ({type(exc).__name__}: {exc}); keep its attributes picklable"
            ) from None
    return Task(
        nodeid=item.nodeid,
        module_path=module.__file__,
        module_name=module.__name__,
        qualname=qualname,
        funcargs=funcargs,
        sys_path=list(sys.path),
        cwd=os.getcwd(),
        tbstyle="long" if tbstyle == "auto" else tbstyle,
        pytest_config=recipe_of(item.config),
        conftests=conftests_of(item.config, item.path),
        instance=instance,
        local_modules=_local_modules(item.config.rootpath),
    )


def _pickled_funcargs(args: dict[str, Any]) -> bytes:
    """The fixture values as one pickle; when that fails, the fixture at fault is named."""
    try:
        return pickle.dumps(args)
    except Exception:
        pass
    for name, value in args.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise UnpicklableFixture(unpicklable_message(name, value, exc)) from None
    return pickle.dumps(args)  # each pickles alone: raise what pickling them together raised


class _LocalModuleIndex:
    """The user's modules (under rootdir, not installed packages) the parent imported, by name.

    Asked once per distributed test. A scan of every module in `sys.modules`, and even comparing
    `sys.modules` with a copy (thousands of module objects out of cache), cost a warm test more than the rest of
    it (benchmarks/RESULTS.md), so the answer is kept while `sys.modules` keeps its size and its newest entry: an import
    adds at the end, a removal shrinks it. (A module replaced in place under an older name is not
    seen; pytest's importers never do that.) A rescan looks again only at new module objects."""

    def __init__(self) -> None:
        self._signature: tuple[int, str, int] | None = None
        self._entries: dict[str, tuple[object, tuple[str, bool] | None]] = {}
        self._found: dict[Path, dict[str, tuple[str, bool]]] = {}

    @staticmethod
    def _current() -> tuple[int, str, int]:
        newest = next(reversed(sys.modules), "")
        return len(sys.modules), newest, id(sys.modules.get(newest))

    def __call__(self, root: Path) -> dict[str, tuple[str, bool]]:
        signature = self._current()
        if signature != self._signature:
            self._rescan()
            self._signature = signature
        if root not in self._found:
            prefix = str(root) + os.sep
            self._found[root] = {name: entry for name, (_, entry) in self._entries.items()
                                 if entry is not None and entry[0].startswith(prefix)}
        return self._found[root]

    def _rescan(self) -> None:
        previous, self._entries = self._entries, {}
        for name, module in list(sys.modules.items()):
            known = previous.get(name)
            same = known is not None and known[0] is module
            self._entries[name] = known if same else (module, self._entry(name, module))  # type: ignore[assignment]
        self._found = {}

    @staticmethod
    def _entry(name: str, module: object) -> tuple[str, bool] | None:
        """(file, asserts rewritten) of a module that may be the user's; None for the rest."""
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.endswith(".py") or "site-packages" in file:
            return None
        if name == "ddp_conformance" or name.startswith("ddp_conformance."):
            return None  # the plugin itself imports normally
        try:
            return file, "@py_builtins" in vars(module)
        except TypeError:  # an object without __dict__ standing in sys.modules
            return None


_local_modules = _LocalModuleIndex()
