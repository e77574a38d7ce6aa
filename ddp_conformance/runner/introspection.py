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
report, and `tests/runner/test_assert_explanations.py` fails loudly.
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
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

import pytest

from .protocol import ConfigRecipe

CONFTEST = "conftest.py"
# the rank never runs a session, and capture must stay off so that building the Config cannot swap
# the rank's stdout/stderr
_RANK_ARGS = ("--capture=no", "-p", "no:cacheprovider")


_recipe_key = pytest.StashKey[ConfigRecipe]()
_conftests_key = pytest.StashKey[dict[Path, tuple[str, ...]]]()


def recipe_of(config: pytest.Config) -> ConfigRecipe:
    """The parent's Config as a picklable recipe, made once per session."""
    if _recipe_key not in config.stash:
        config.stash[_recipe_key] = _make_recipe(config)
    return config.stash[_recipe_key]


def _make_recipe(config: pytest.Config) -> ConfigRecipe:
    """The parent's option values (those that pickle; the rest keep their defaults in the rank) and
    only the arguments pytest itself must parse again: never the parent's command line, whose
    options belong to whatever plugins the parent loaded (`--lf` to the cache provider the rank
    leaves out, `-n` to xdist, `--html` to pytest-html, a conftest's own) and would be
    "unrecognized arguments" to a rank that lacks one; their values arrive in `options`."""
    picklable = {}
    for name, value in vars(config.option).items():
        with contextlib.suppress(Exception):
            pickle.dumps(value)
            picklable[name] = value
    picklable["capture"] = "no"
    return ConfigRecipe(
        args=_rank_args(config),
        options=pickle.dumps(picklable),
        invocation_dir=str(config.invocation_params.dir),
    )


def _rank_args(config: pytest.Config) -> tuple[str, ...]:
    """pytest's own arguments that decide what the rank's Config loads: the parent's rootdir and
    ini file (pinned: found again from the test paths they could differ), the `-p` plugins it
    loaded or blocked (a block must be known before plugins autoload), and its test paths (the
    initial conftests). Every other value comes from the option values, which parsing leaves be."""
    args = [f"--rootdir={config.rootpath}"]
    if config.inipath is not None:
        args.append(f"--config-file={config.inipath}")
    for plugin in config.option.plugins or ():
        args += ["-p", str(plugin)]
    return (*args, *_RANK_ARGS, "--", *(str(arg) for arg in config.option.file_or_dir or ()))


def conftests_of(config: pytest.Config, path: Path) -> tuple[str, ...]:
    """The conftest files the parent loaded that apply to `path` (those in its directory or above),
    found once per directory: tests run after collection has loaded every conftest."""
    by_dir = config.stash.setdefault(_conftests_key, {})
    if path.parent not in by_dir:
        files = _conftest_files(config.pluginmanager.get_plugins())
        by_dir[path.parent] = tuple(file for file in files if _applies(file, path))
    return by_dir[path.parent]


def _conftest_files(plugins: Iterable[object]) -> list[str]:
    files = (getattr(plugin, "__file__", None) for plugin in plugins)
    return [file for file in files if file and os.path.basename(file) == CONFTEST]


def _applies(conftest: str, path: Path) -> bool:
    return Path(conftest).parent in path.parents


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
        known = set(_conftest_files(pm.get_plugins()))
        for file, name in conftests.items():
            if file not in known:
                pm.register(_import_conftest(file, name), name=file)
        others = [plugin for plugin in pm.get_plugins() if _is_conftest_elsewhere(plugin, path)]
        return types.SimpleNamespace(config=config, ihook=_HookProxy(pm, others), path=path,
                                     nodeid=str(path), location=(str(path), None, ""))


def _is_conftest_elsewhere(plugin: object, path: Path) -> bool:
    file = getattr(plugin, "__file__", None)
    return bool(file) and os.path.basename(file) == CONFTEST and not _applies(file, path)


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
    from _pytest.terminal import TerminalReporter

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
    from .runtime import load_module

    return load_module(file, f"ddp_conftest_{abs(hash(file)):x}")


def _install(item: Any) -> Generator[None, object, object]:
    """Run pytest's assertion plugin's `pytest_runtest_protocol` wrapper up to its yield: it sets
    the rewritten asserts' explanation hook for `item` and restores it when resumed."""
    from _pytest import assertion

    protocol = assertion.pytest_runtest_protocol(item)
    if not isinstance(protocol, types.GeneratorType):
        raise ExplanationsUnavailable(
            f"pytest {pytest.__version__}: _pytest.assertion.pytest_runtest_protocol is no longer a wrapper")
    next(protocol)
    return protocol
