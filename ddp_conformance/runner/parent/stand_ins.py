"""The parent's side of pytest's built-in fixtures in ranks: a small picklable stand-in per value.

A built-in fixture's parent value (capsys, caplog, recwarn, monkeypatch, tmp_path_factory, request)
holds the pytest session and cannot be pickled, and would be the wrong object anyway: capsys in the
parent captures the parent. So the task carries a stand-in (`wire.StandIn`) instead, which each rank
makes real for that rank (`rank.builtin_fixtures`).
"""

from __future__ import annotations

import logging
import pickle
import re
from typing import Any

import pytest

from ..wire import (
    CAPTURE_FIXTURES,
    UNSET,
    CallSpec,
    CaptureStandIn,
    LogCaptureStandIn,
    MonkeyPatchStandIn,
    RankNode,
    RequestStandIn,
    StandIn,
    TempPathFactoryStandIn,
    WarningsStandIn,
)


def parent_stand_in(name: str, value: Any, item: pytest.Function) -> StandIn | None:
    """The stand-in for a built-in fixture's value, or None when `value` is not one (it is then
    pickled as it is). Recognised by type, so a user's fixture of the same name is left alone."""
    if isinstance(value, pytest.CaptureFixture) and name in CAPTURE_FIXTURES:
        level, binary, tee = CAPTURE_FIXTURES[name]
        return CaptureStandIn(level, binary, tee)
    if isinstance(value, pytest.LogCaptureFixture):
        return log_capture_stand_in(item.config)
    if isinstance(value, pytest.WarningsRecorder):
        return WarningsStandIn()
    if isinstance(value, pytest.MonkeyPatch):
        return MonkeyPatchStandIn()
    if isinstance(value, pytest.TempPathFactory):
        root = value.mktemp(f"ddp-{_safe_name(item.name)}", numbered=True)
        return TempPathFactoryStandIn(basetemp=value.getbasetemp(), root=root)
    if isinstance(value, pytest.FixtureRequest):
        return request_stand_in(value, item)
    return None


def _safe_name(name: str) -> str:
    """A test name as a directory name, as pytest's tmp_path makes it (and as short)."""
    return re.sub(r"[\W]", "_", name)[:30]


def unpicklable_message(name: str, value: Any, exc: BaseException) -> str:
    """One line for a fixture whose value cannot reach the ranks: which one and what to do. The
    pickler's own words are kept only when they speak of the user's object, not of this plugin."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    said = "" if "ddp_conformance" in reason or len(reason) > 100 else f" ({reason})"
    return (f"fixture {name!r} cannot be sent to the ranks: its {type(value).__name__} value does not pickle{said}; "
            "return picklable data from the fixture (numbers, strings, paths, tensors, dataclasses) "
            "or build the object inside the test")


def log_capture_stand_in(config: pytest.Config) -> LogCaptureStandIn:
    """caplog's stand-in: the session's log level and formats, as pytest's caplog handler uses them."""

    def setting(name: str) -> Any:
        value = config.getoption(name, None)
        return value if value is not None else config.getini(name)

    level = setting("log_level")
    if isinstance(level, str) and level:
        level = int(level) if level.isdigit() else logging.getLevelName(level.upper())
    return LogCaptureStandIn(level=level if isinstance(level, int) else None,
                             fmt=setting("log_format") or logging.BASIC_FORMAT,
                             datefmt=setting("log_date_format") or None)


def request_stand_in(request: pytest.FixtureRequest, item: pytest.Function) -> RequestStandIn:
    """request's stand-in: the test's names, markers, keywords and parameters that pickle."""
    markers, left_out = [], []
    for mark in item.iter_markers():
        if _picklable(mark):
            markers.append(mark)
        else:
            left_out.append(mark.name)
    callspec = getattr(item, "callspec", None)
    spec = None
    if callspec is not None:
        params = {k: v for k, v in callspec.params.items() if _picklable(v)}
        spec = CallSpec(params, callspec.id)
    node = RankNode(name=item.name, nodeid=item.nodeid, originalname=item.originalname,
                    markers=tuple(markers), keywords=frozenset(item.keywords), callspec_=spec,
                    left_out=tuple(left_out))
    param = getattr(request, "param", UNSET)
    return RequestStandIn(node=node, fixturenames=tuple(request.fixturenames),
                          param=param if _picklable(param) else UNSET)


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
