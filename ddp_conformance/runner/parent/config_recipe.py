"""The parent's pytest Config as a recipe a rank can build its own from (`wire.ConfigRecipe`).

A rank explains a failing `assert` with pytest's own machinery, from a real Config built there
(`rank.assertion_explanations`). The parent sends what that Config needs: its option values that
pickle, its rootdir, ini file and `-p` plugins, and the conftest files that apply to the test.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import pytest

from ..wire import ConfigRecipe, conftest_applies, conftest_files

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


def installed_plugins(config: pytest.Config) -> tuple[str, ...]:
    """The modules of the plugins the parent loaded from installed distributions (pytest11 entry points, less
    what `-p no:` blocked). Each rank's Config loads the same ones (`_rank_args`) before its first test: the fork
    server ranks are forked from imports them once, not every rank of every pool (benchmarks/RESULTS.md, "first
    test")."""
    names = (getattr(plugin, "__name__", None) for plugin, _ in config.pluginmanager.list_plugin_distinfo())
    return tuple(dict.fromkeys(name for name in names if isinstance(name, str)))


def conftests_of(config: pytest.Config, path: Path) -> tuple[str, ...]:
    """The conftest files the parent loaded that apply to `path` (those in its directory or above),
    found once per directory: tests run after collection has loaded every conftest."""
    by_dir = config.stash.setdefault(_conftests_key, {})
    if path.parent not in by_dir:
        files = conftest_files(config.pluginmanager.get_plugins())
        by_dir[path.parent] = tuple(file for file in files if conftest_applies(file, path))
    return by_dir[path.parent]
