"""The pytest face of ddp-conformance: options, the `ddp` marker and fixture, and report hooks.

Wiring only: `pytest_configure` picks one controller for the session
(`runner.parent.pool_controller.PoolController`, or `runner.launched.LauncherController` when
torchrun/srun started pytest once per rank) and every hook hands a marked test to it. The marker is
parsed once per test (`marker.ddp_test`). Loading this module imports neither torch nor lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from . import marker, options
from .runner import launched
from .runner.controller import Controller
from .runner.parent.config_recipe import installed_plugins
from .runner.parent.pool_controller import PoolController

pytest_plugins = ["ddp_conformance.suite.report", "ddp_conformance.suite.unbuilt", "ddp_conformance.plan"]

CONTROLLER_KEY = pytest.StashKey[Controller]()


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)
    if launched.launched_externally():
        launched.remember_terminal()


@pytest.hookimpl(tryfirst=True)  # before junitxml reads its path: other ranks must not clobber it
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", marker.MARKER_HELP)
    by_launcher = launched.launched_externally()
    if by_launcher:
        launched.quiet_non_zero_rank(config)  # before the settings read the report path
    options.refuse_path_taken_for_a_test_path(config)
    settings = options.read_settings(config)
    if by_launcher and not launched.writes_reports():
        settings = dataclasses.replace(settings, report_path=None)  # rank 0's to write, ini option or not
    if not hasattr(config, "workerinput"):  # an xdist worker: its controller checked it, and writes it
        options.validate_report_path(config, settings)
    config.stash[options.SETTINGS_KEY] = settings
    if by_launcher:
        controller: Controller = launched.LauncherController(settings.runner)
    else:
        controller = PoolController(settings.runner, rank_plugins=installed_plugins(config))
    config.stash[CONTROLLER_KEY] = controller
    preload = options.suite_preload(config)
    if preload is not None:  # the suite's ranks start importing while pytest validates and collects
        controller.expect(preload)
    if config.getoption("ddp_trainers") or config.getini("ddp_trainers") or settings.config_path:
        elsewhere = controller.call_where_ranks_start if preload is not None else None
        options.validate_trainers_and_config(config, settings, elsewhere)


def pytest_sessionfinish(session: pytest.Session) -> None:
    controller = session.config.stash.get(CONTROLLER_KEY, None)
    if controller is not None:
        controller.session_finished()


def pytest_unconfigure(config: pytest.Config) -> None:
    controller = config.stash.get(CONTROLLER_KEY, None)
    if controller is not None:
        controller.close()


def _controller(config: pytest.Config) -> Controller:
    return config.stash[CONTROLLER_KEY]


# -- collection --------------------------------------------------------------------------------
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker.parametrize(metafunc)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    tests = [test for test in map(marker.ddp_test, session.items) if test is not None]
    _controller(session.config).collection_finished(tests)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _controller(session.config).session_started(session.config)


# -- running -----------------------------------------------------------------------------------
# The item pytest is setting up or running, for the `ddp` fixture: a fixture that asks for `request`
# makes pytest 9 build a FixtureDef and inspect a signature per test, most of what a warm distributed
# test may cost (benchmarks/RESULTS.md). pytest runs one item at a time per process (xdist: per worker).
_current_item: list[pytest.Item] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _current_item[:] = [item]
    test = marker.ddp_test(item)
    if test is not None:
        _controller(item.config).setup(item, test)


@pytest.fixture
def ddp() -> Any:
    """The rank context of a distributed test (rank, local_rank, world_size, backend, device).

    In the parent this is the plan; on each rank the test receives its own `DdpContext`."""
    if not _current_item:
        pytest.fail("the ddp fixture belongs to a test marked @pytest.mark.ddp", pytrace=False)
    item = _current_item[0]
    return _controller(item.config).fixture_value(item, marker.ddp_test(item))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    test = marker.ddp_test(pyfuncitem)
    return None if test is None else _controller(pyfuncitem.config).call(pyfuncitem, test)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _current_item.clear()
    test = marker.ddp_test(item)
    if test is not None:
        _controller(item.config).teardown(item, test)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    test = marker.ddp_test(item)
    if test is not None:
        _controller(item.config).report(item, test, call, report)
    return report
