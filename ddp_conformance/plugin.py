"""The pytest face of ddp-conformance: options, the `ddp` marker and fixture, and report hooks.

Hooks only: decisions live in `session` (the controller), processes in `supervisor`, rank-side work
in `runtime`. Loading this module imports neither torch nor lightning.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from . import external, options
from .context import DdpPlan
from .messages import SKIPPED, XFAILED
from .verdict import DistributedTestFailure, failure_exception

pytest_plugins = ["ddp_conformance.report"]

SESSION_KEY = pytest.StashKey["DistributedSession"]()
EXTERNAL_KEY = pytest.StashKey["ExternalRanks"]()
TERM_KEY = pytest.StashKey[Any]()
SETTINGS_KEY = pytest.StashKey[options.Settings]()
PLAN_KEY = pytest.StashKey[DdpPlan]()
DISPATCH_KEY = pytest.StashKey["Dispatch"]()
SHAPE_KEY = pytest.StashKey[tuple[int | None, float]]()

MARKER_HELP = (
    "ddp(world_size=None, timeout=None): run the test body on every rank of an initialised process "
    "group; world_size an int or a list of ints (one test id each), default --ddp-world-size."
)


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)
    if external.launched_externally():
        external.remember_terminal()


@pytest.hookimpl(tryfirst=True)  # before junitxml reads its path: other ranks must not clobber it
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    launched = external.launched_externally()
    if launched:
        external.quiet_non_zero_rank(config)  # before the settings read the report path
    options.refuse_path_taken_for_a_test_path(config)
    settings = options.read_settings(config)
    config.stash[SETTINGS_KEY] = settings
    if launched:
        config.stash[EXTERNAL_KEY] = external.ExternalRanks(settings.backend, settings.timeout)
    if config.getoption("ddp_trainers") or config.getini("ddp_trainers") or settings.config_path:
        options.validate_trainers_and_config(config, settings)


def _terminate_as_interrupt(config: pytest.Config) -> None:
    """While ranks run, SIGTERM (a CI runner cancelling the job) ends pytest like Ctrl-C: the session
    unwinds, the pools are killed, pytest exits non-zero with one line instead of dying with ranks
    mid-test. Installed with the first pool, put back at the end of the session."""
    if threading.current_thread() is not threading.main_thread() or TERM_KEY in config.stash:
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"pytest received {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)
    config.stash[TERM_KEY] = previous


def settings_of(config: pytest.Config) -> options.Settings:
    """The session's validated options (trainer SPECs, config path, world size...), for the suite."""
    return config.stash[SETTINGS_KEY]


def _session(config: pytest.Config) -> Any:
    from .session import DistributedSession

    if SESSION_KEY not in config.stash:
        config.stash[SESSION_KEY] = DistributedSession(config.stash[SETTINGS_KEY])
        _terminate_as_interrupt(config)
    return config.stash[SESSION_KEY]


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(SESSION_KEY, None)
    if session is not None:
        session.close()
    if TERM_KEY in config.stash and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, config.stash[TERM_KEY])
    launched = config.stash.get(EXTERNAL_KEY, None)
    if launched is not None:
        launched.finish()


# -- collection --------------------------------------------------------------------------------
def _marker_sizes(marker: pytest.Mark, where: str) -> list[int] | None:
    value = marker.kwargs.get("world_size", marker.args[0] if marker.args else None)
    if value is None:
        return None
    sizes = list(value) if isinstance(value, (list, tuple)) else [value]
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise pytest.UsageError(
            f"{where}: @pytest.mark.ddp(world_size=...) expects an int >= 1 or a list of them, got {value!r}"
        )
    return sizes


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("ddp")
    if marker is None:
        return
    sizes = _marker_sizes(marker, metafunc.definition.nodeid)
    _marker_timeout(marker, metafunc.definition.nodeid)
    if sizes is None or len(sizes) == 1:
        return
    # parametrize needs an argument the test requests: the `ddp` fixture, indirectly
    if "ddp" not in metafunc.fixturenames:
        metafunc.fixturenames.append("ddp")
    metafunc.parametrize("ddp", sizes, indirect=True, ids=[f"ws{s}" for s in sizes])


def _launcher_world_size(item: pytest.Item) -> int | None:
    """The size a test asks for when the launcher fixed the size: only an explicit one counts."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "ddp" in callspec.params:
        return int(callspec.params["ddp"])
    marker = item.get_closest_marker("ddp")
    sizes = _marker_sizes(marker, item.nodeid) if marker is not None else None
    return sizes[0] if sizes else None


def _marker_timeout(marker: pytest.Mark, where: str) -> float | None:
    value = marker.kwargs.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise pytest.UsageError(f"{where}: @pytest.mark.ddp(timeout=...) expects a number of seconds > 0, "
                                f"got {value!r}")
    return float(value)


def _shape(item: pytest.Item) -> tuple[int | None, float]:
    """(world size, None when unmarked; timeout) of a test, read from its markers once: a marker
    lookup walks the node chain, and a warm distributed test is only a few milliseconds."""
    shape = item.stash.get(SHAPE_KEY, None)
    if shape is None:
        shape = item.stash[SHAPE_KEY] = (_read_world_size(item), _read_timeout(item))
    return shape


def _test_timeout(item: pytest.Item) -> float:
    return _shape(item)[1]


def _plan_world_size(item: pytest.Item) -> int | None:
    return _shape(item)[0]


def _read_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("ddp")
    own = _marker_timeout(marker, item.nodeid) if marker is not None else None
    return own or item.config.stash[SETTINGS_KEY].timeout


def _read_world_size(item: pytest.Item) -> int | None:
    marker = item.get_closest_marker("ddp")
    if marker is None:
        return None
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "ddp" in callspec.params:
        return int(callspec.params["ddp"])
    sizes = _marker_sizes(marker, item.nodeid)
    return sizes[0] if sizes else item.config.stash[SETTINGS_KEY].world_size


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the first pools early. Under xdist a worker does not know which tests it will get, so
    it starts only the first shape."""
    if session.config.option.collectonly or EXTERNAL_KEY in session.config.stash:
        return
    sizes: list[int] = []
    timeouts: list[float] = []
    for item in session.items:
        size = _plan_world_size(item)
        if size is not None and size not in sizes:
            sizes.append(size)
        if size is not None:
            timeouts.append(_test_timeout(item))
    if sizes:
        from .backend import xdist_worker

        controller = _session(session.config)
        controller.longest_timeout = max([controller.longest_timeout, *timeouts])
        controller.prestart(sizes[:1] if xdist_worker()[1] > 1 else sizes)


# -- running -----------------------------------------------------------------------------------
# The item pytest is setting up or running, for the `ddp` fixture: a fixture that asks for `request`
# makes pytest 9 build a FixtureDef and inspect a signature per test, ~0.4 ms, which is most of
# what a warm distributed test may cost. pytest runs one item at a time per process (xdist: per worker).
_current_item: list[pytest.Item] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Decide the backend, and any skip that can be known here, before fixtures run or ranks spawn."""
    _current_item[:] = [item]
    marker = item.get_closest_marker("ddp")
    if marker is None:
        return
    launched = item.config.stash.get(EXTERNAL_KEY, None)
    if launched is not None:  # ranks are the launcher's: run here, on this rank
        reason = launched.skip_reason(_launcher_world_size(item)) or launched.unusable_reason
        if reason:
            _skip_at_item(reason)
        launched.ensure_group()
        launched.arm_watchdog(_test_timeout(item))
        return
    world_size = _plan_world_size(item)
    assert world_size is not None
    placement = _session(item.config).place(world_size)
    if placement.skip_reason:
        _skip_at_item(placement.skip_reason)
    item.stash[PLAN_KEY] = DdpPlan(world_size=world_size, backend=placement.backend)


def _skip_at_item(reason: str) -> None:
    """Skip reported at the test's location (as a skip marker is), not at this plugin's line."""
    try:
        raise pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:  # a pytest without the keyword
        pytest.skip(reason)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if EXTERNAL_KEY in session.config.stash:
        external.quiet_non_zero_rank_output(session.config)


@pytest.fixture
def ddp() -> Any:
    """The rank context of a distributed test (rank, local_rank, world_size, backend, device).

    In the parent this is the plan; on each rank the test receives its own `DdpContext`."""
    if not _current_item:
        pytest.fail("the ddp fixture belongs to a test marked @pytest.mark.ddp", pytrace=False)
    item = _current_item[0]
    launched = item.config.stash.get(EXTERNAL_KEY, None)
    if launched is not None and item.get_closest_marker("ddp") is not None:
        context = launched.context()
        item.stash[external.CONTEXT_KEY] = context  # its figures become the test's properties
        return context
    plan = item.stash.get(PLAN_KEY, None)
    if plan is None:
        pytest.fail(f"{item.nodeid}: the ddp fixture needs the test marked @pytest.mark.ddp", pytrace=False)
    return plan


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    plan = pyfuncitem.stash.get(PLAN_KEY, None)
    if plan is None:
        return None
    from .session import UnpicklableFixture

    timeout = _test_timeout(pyfuncitem)
    try:
        dispatch = _session(pyfuncitem.config).run(pyfuncitem, plan, timeout)
    except UnpicklableFixture as exc:
        problem = str(exc)
    else:
        problem = None
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    pyfuncitem.stash[DISPATCH_KEY] = dispatch
    if dispatch.notes:
        pyfuncitem.add_report_section("call", "ddp pool", "\n".join(dispatch.notes))
    if dispatch.output:
        pyfuncitem.add_report_section("call", "output (ranks)", dispatch.output)
    verdict = dispatch.verdict
    for key, value in verdict.figures.get(0, {}).items():
        pyfuncitem.user_properties.append((key, value))
    if verdict.outcome == SKIPPED:
        pytest.skip(verdict.headline)
    if verdict.outcome == XFAILED:
        pytest.xfail(verdict.headline)
    if verdict.failing_ranks or verdict.outcome == "failed":
        raise failure_exception(verdict.render(), verdict.exc_type)
    return True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _current_item.clear()
    if EXTERNAL_KEY in item.config.stash and item.get_closest_marker("ddp") is not None:
        external.ExternalRanks.disarm_watchdog()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, DistributedTestFailure) and report.failed:
        report.longrepr = call.excinfo.value.verdict_text
    launched = item.config.stash.get(EXTERNAL_KEY, None)
    if launched is not None and item.get_closest_marker("ddp") is not None:
        launched.agree_on_report(item, call.when, report)
    return report
