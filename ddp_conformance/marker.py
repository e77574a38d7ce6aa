"""The `ddp` marker, parsed and validated once per test into one `DdpTest` that every consumer reads.

`DdpTest` is the runner's input type (`runner.controller`); this module builds it from the marker.

`@pytest.mark.ddp(world_size=None, timeout=None, preload=(), requires=())`: world_size an int >= 1 or a
list of them (one test id each, through the `ddp` fixture's indirect parametrization), timeout a number
of seconds, preload module names the ranks import before the test can start (see `DdpTest.preload`),
requires those the test cannot run without (`DdpTest.requires`).
A bad marker is one line at collection, before anything is spawned: the test's collection error,
as pytest reports its own markers' misuse (`fail(..., pytrace=False)`), never a traceback.
"""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

from .options import settings_of
from .runner.controller import DdpTest

MARKER_HELP = (
    "ddp(world_size=None, timeout=None, preload=(), requires=()): run the test body on every rank of an "
    "initialised process group; world_size an int or a list of ints (one test id each), default "
    "--ddp-world-size; preload: modules imported once before the ranks start (e.g. torch._dynamo); "
    "requires: modules the ranks must import, else the session stops in one line before its first test."
)


_KEY = pytest.StashKey["DdpTest | None"]()
_UNREAD: Any = object()


KEYWORDS = ("world_size", "timeout", "preload", "requires")


def _bad(where: str, problem: str) -> NoReturn:
    """One line for a bad marker: the test's collection error, without a traceback."""
    pytest.fail(f"{where}: {problem}", pytrace=False)


def _signature(marker: pytest.Mark, where: str) -> None:
    """A misspelt keyword would otherwise be ignored, and the test run at the default world size."""
    unknown = [name for name in marker.kwargs if name not in KEYWORDS]
    if unknown:
        given = ", ".join(f"{name}={marker.kwargs[name]!r}" for name in unknown)
        _bad(where, f"@pytest.mark.ddp got an unknown keyword ({given}); expected {', '.join(KEYWORDS)}")
    if len(marker.args) > 1 or (marker.args and "world_size" in marker.kwargs):
        _bad(where, f"@pytest.mark.ddp takes world_size as its only positional argument, got "
                    f"{len(marker.args)} positional ({', '.join(map(repr, marker.args))})"
                    + (" and world_size=" if "world_size" in marker.kwargs else ""))


def _sizes(marker: pytest.Mark, where: str) -> list[int] | None:
    value = marker.kwargs.get("world_size", marker.args[0] if marker.args else None)
    if value is None:
        return None
    sizes = list(value) if isinstance(value, (list, tuple)) else [value]
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        _bad(where, f"@pytest.mark.ddp(world_size=...) expects an int >= 1 or a list of them, got {value!r}")
    return sizes


def _timeout(marker: pytest.Mark, where: str) -> float | None:
    value = marker.kwargs.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        _bad(where, f"@pytest.mark.ddp(timeout=...) expects a number of seconds > 0, got {value!r}")
    return float(value)


def _modules(marker: pytest.Mark, where: str, keyword: str) -> tuple[str, ...]:
    value = marker.kwargs.get(keyword, ())
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(
            isinstance(n, str) and n and all(part.isidentifier() for part in n.split(".")) for n in names):
        _bad(where, f"@pytest.mark.ddp({keyword}=...) expects a module name or a list of them "
                    f"(e.g. \"torch._dynamo\"), got {value!r}")
    return tuple(names)


def parametrize(metafunc: pytest.Metafunc) -> None:
    """Validate the marker at collection and give a test marked with several sizes one id per size."""
    marker = metafunc.definition.get_closest_marker("ddp")
    if marker is None:
        return
    _signature(marker, metafunc.definition.nodeid)
    sizes = _sizes(marker, metafunc.definition.nodeid)
    _timeout(marker, metafunc.definition.nodeid)
    for keyword in ("preload", "requires"):
        _modules(marker, metafunc.definition.nodeid, keyword)
    if sizes is None or len(sizes) == 1:
        return
    # parametrize needs an argument the test requests: the `ddp` fixture, indirectly
    if "ddp" not in metafunc.fixturenames:
        metafunc.fixturenames.append("ddp")
    metafunc.parametrize("ddp", sizes, indirect=True, ids=[f"ws{s}" for s in sizes])


def ddp_test(item: pytest.Item) -> DdpTest | None:
    """The test's parsed marker, None when it is not marked; read once per item (a marker lookup walks
    the node chain, and a warm distributed test is only a few milliseconds)."""
    parsed = item.stash.get(_KEY, _UNREAD)
    if parsed is _UNREAD:
        parsed = item.stash[_KEY] = _parse(item)
    return parsed


def _parse(item: pytest.Item) -> DdpTest | None:
    marker = item.get_closest_marker("ddp")
    if marker is None:
        return None
    settings = settings_of(item.config)
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "ddp" in callspec.params:
        requested: int | None = int(callspec.params["ddp"])
    else:
        sizes = _sizes(marker, item.nodeid)
        requested = sizes[0] if sizes else None
    # the closest marker that gives a timeout: a parametrized case's own marker may give one its function's omits
    timeouts = (_timeout(mark, item.nodeid) for mark in item.iter_markers("ddp"))
    timeout = next((seconds for seconds in timeouts if seconds is not None), None) or settings.timeout
    return DdpTest(world_size=requested or settings.world_size, requested_size=requested, timeout=timeout,
                   preload=_modules(marker, item.nodeid, "preload"),
                   requires=_modules(marker, item.nodeid, "requires"))
