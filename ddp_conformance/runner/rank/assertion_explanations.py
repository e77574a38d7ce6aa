"""pytest's own assertion explanations inside a rank, from a real pytest Config built there.

A failing `assert [1, 2, 3] == [1, 2, 4]` in a rank must read exactly as it does in a plain test:
pytest's explanation, the user's conftest `pytest_assertrepr_compare` hooks, truncation and
verbosity. Re-implementing pytest's comparison (or calling its private `assertrepr_compare`, whose
signature changed in 9.2) degrades silently on the next release. Instead the rank builds a real
Config the way pytest documents for subprocesses (`Config.fromdictargs`, as pytest-xdist's workers
build theirs) from the parent's option values, rootdir and ini file, and lets pytest's assertion plugin
install its own hook caller around each test, exactly as it does for a plain test item.

One private entry point remains: `_pytest.assertion.pytest_runtest_protocol`, driven with a stand-in
item (config, ihook, path). If it changes, `ExplanationsUnavailable` says so in every failing rank's
report, and `tests/runner/rank/test_assertion_explanations.py` fails loudly.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import sys
import types
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from _pytest import assertion

from ..wire import CONFTEST, ConfigRecipe, conftest_applies, conftest_files
from .module_importer import load_module


class ExplanationsUnavailable(RuntimeError):
    """pytest's assertion machinery could not be installed in this rank (a pytest change?)."""


class _HookProxy:
    """`item.ihook` as pytest builds it for a file: every plugin's hooks but conftests of other dirs."""

    def __init__(self, pluginmanager: pytest.PytestPluginManager, others: list[object]) -> None:
        self._pm, self._others = pluginmanager, others

    def __getattr__(self, name: str) -> Any:
        caller = getattr(self._pm.hook, name)
        if self._others:
            caller = self._pm.subset_hook_caller(name, remove_plugins=self._others)
        setattr(self, name, caller)  # made once per file, as pytest's own FSHookProxy does
        return caller


class RankAssertions:
    """Builds the rank's Config once per recipe and installs pytest's hook caller around each test."""

    def __init__(self) -> None:
        self._recipe: ConfigRecipe | None = None
        self._config: pytest.Config | None = None
        self._items: dict[str, Any] = {}  # per test file: conftests load once, hook callers are made once
        self.error: str = ""

    @contextlib.contextmanager
    def around(self, recipe: ConfigRecipe, path: str, conftests: dict[str, str]) -> Generator[None]:
        """Explanations as pytest gives them for the test file at `path`, for the duration of the test;
        `conftests` maps the conftest files that apply to it to their module names in the parent."""
        protocol = None
        try:
            config = self._config_for(recipe)
            if path not in self._items:
                self._items[path] = self._item(config, Path(path), conftests)
            protocol = _install(self._items[path])
            self.error = ""
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        try:
            yield
        finally:
            if protocol is not None:
                with contextlib.suppress(StopIteration):
                    protocol.send(None)

    def _config_for(self, recipe: ConfigRecipe) -> pytest.Config:
        if self._config is None or recipe != self._recipe:
            self._config, self._recipe, self._items = _build_config(recipe), recipe, {}
        return self._config

    def _item(self, config: pytest.Config, path: Path, conftests: dict[str, str]) -> Any:
        pm = config.pluginmanager
        known = set(conftest_files(pm.get_plugins()))
        for file, name in conftests.items():
            if file not in known:
                pm.register(_import_conftest(file, name), name=file)
        others = [plugin for plugin in pm.get_plugins() if _is_conftest_elsewhere(plugin, path)]
        return types.SimpleNamespace(config=config, ihook=_HookProxy(pm, others), path=path,
                                     nodeid=str(path), location=(str(path), None, ""))


def _is_conftest_elsewhere(plugin: object, path: Path) -> bool:
    file = getattr(plugin, "__file__", None)
    return bool(file) and os.path.basename(file) == CONFTEST and not conftest_applies(file, path)


def _build_config(recipe: ConfigRecipe) -> pytest.Config:
    """`Config.fromdictargs` in the parent's directory, plus the terminal reporter pytest's
    comparison asks for its highlighter (never written to: its file is a buffer)."""
    here = os.getcwd()
    os.chdir(recipe.invocation_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the parent already showed its config warnings
            config = pytest.Config.fromdictargs(pickle.loads(recipe.options), list(recipe.args))
    finally:
        os.chdir(here)
    if not config.pluginmanager.has_plugin("terminalreporter"):
        config.pluginmanager.register(_terminal_reporter()(config, io.StringIO()), "terminalreporter")
    return config


def _terminal_reporter() -> type:
    """`pytest.TerminalReporter` (public since pytest 8.1); pytest 8.0 has it only in `_pytest.terminal`."""
    if hasattr(pytest, "TerminalReporter"):
        return pytest.TerminalReporter
    from _pytest.terminal import TerminalReporter  # deferred: only pytest 8.0 lacks the public name


    return TerminalReporter


def _import_conftest(file: str, name: str) -> types.ModuleType:
    """A conftest the parent loaded for this test's directory but the rank's Config did not (it
    only loads the initial ones): the module already imported from that file, else imported under
    the parent's name for it, so that classes it defines are the ones the test module sees."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == file:
            return module
    if name:
        module = importlib.import_module(name)
        if getattr(module, "__file__", None) == file:
            return module  # else that name is another conftest's (pytest's prepend mode reuses "conftest")
    return load_module(file, f"ddp_conftest_{abs(hash(file)):x}")


def _install(item: Any) -> Generator[None, object, object]:
    """Run pytest's assertion plugin's `pytest_runtest_protocol` wrapper up to its yield: it sets
    the rewritten asserts' explanation hook for `item` and restores it when resumed."""
    protocol = assertion.pytest_runtest_protocol(item)
    if not isinstance(protocol, types.GeneratorType):
        raise ExplanationsUnavailable(
            f"pytest {pytest.__version__}: _pytest.assertion.pytest_runtest_protocol is no longer a wrapper")
    next(protocol)
    return protocol
