"""pytest's built-in fixtures made real in a rank: capsys, capfd, caplog, recwarn, monkeypatch,
tmp_path_factory and request behave on each rank as they do in a plain test, for that rank.

Their parent-side values hold the pytest session (capture manager, config, the item) and cannot be
pickled, and would be the wrong object anyway: capsys in the parent captures the parent. So the
parent sends a small picklable stand-in (`wire.StandIn`, made by `parent.stand_ins`), and each rank
turns it into the real thing for the duration of the test (`materialize`), on its own streams,
loggers and warnings. No torch here: this imports nothing beyond the standard library and pytest.

What a rank's `request` offers is documented on `RankRequest`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from ..wire import (
    UNSET,
    CaptureStandIn,
    LogCaptureStandIn,
    MonkeyPatchStandIn,
    RankNode,
    RequestStandIn,
    StandIn,
    TempPathFactoryStandIn,
    WarningsStandIn,
)


# -- capsys / capfd ----------------------------------------------------------------------------------
class CaptureResult(NamedTuple):
    """What `readouterr()` returns, as pytest's: `out` and `err`, str (bytes for the binary ones)."""

    out: Any
    err: Any


class _TeeIO(io.TextIOWrapper):
    """A capture buffer that also writes through to the stream it replaced (capteesys)."""

    def __init__(self, other: Any) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8", newline="", write_through=True)
        self._other = other

    def write(self, text: str) -> int:
        self._other.write(text)
        return super().write(text)


class RankCapture:
    """capsys/capfd in a rank: this rank's writes to sys.stdout/sys.stderr ("sys") or to file
    descriptors 1 and 2 ("fd", which includes C code and subprocesses), as pytest.CaptureFixture.
    Output left unread at the end goes on to the rank's output, shown under the test by rank."""

    def __init__(self, level: str, binary: bool = False, tee: bool = False) -> None:
        self.level, self.binary, self.tee = level, binary, tee
        self._streams: dict[int, Any] = {}  # 1, 2 -> the text stream that captures
        self._saved_streams: tuple[Any, Any] | None = None
        self._saved_fds: dict[int, int] = {}
        self._active = False

    def start(self) -> None:
        originals = (sys.stdout, sys.stderr)
        for stream in originals:
            with contextlib.suppress(Exception):
                stream.flush()
        self._saved_streams = originals
        for fd, original in zip((1, 2), originals, strict=True):
            if self.level == "fd":
                self._streams[fd] = io.TextIOWrapper(tempfile.TemporaryFile(buffering=0), encoding="utf-8",  # noqa: SIM115
                                                     errors="replace", newline="", write_through=True)
                self._saved_fds[fd] = os.dup(fd)
            else:
                self._streams[fd] = (_TeeIO(original) if self.tee else
                                     io.TextIOWrapper(io.BytesIO(), encoding="utf-8", newline="", write_through=True))
        self._resume()

    def _resume(self) -> None:
        if self.level == "fd":
            for fd, stream in self._streams.items():
                os.dup2(stream.fileno(), fd)
        sys.stdout, sys.stderr = self._streams[1], self._streams[2]
        self._active = True

    def _suspend(self) -> None:
        assert self._saved_streams is not None
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if self.level == "fd":
            for fd, saved in self._saved_fds.items():
                os.dup2(saved, fd)
        sys.stdout, sys.stderr = self._saved_streams
        self._active = False

    def _take(self, fd: int) -> bytes:
        """What the stream for `fd` captured since the last read, emptied."""
        stream = self._streams[fd]
        stream.flush()
        if self.level == "fd":
            stream.seek(0)
            data = stream.buffer.read()
        else:
            data = stream.buffer.getvalue()
        stream.seek(0)
        stream.truncate()
        return data

    def _decode(self, data: bytes) -> Any:
        return data if self.binary else data.decode("utf-8", "replace")

    def readouterr(self) -> CaptureResult:
        """The output captured so far (str, or bytes for the binary fixtures), then forgotten."""
        if not self._streams:
            return CaptureResult(self._decode(b""), self._decode(b""))
        return CaptureResult(self._decode(self._take(1)), self._decode(self._take(2)))

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Write to the rank's real output while inside the `with` block."""
        if not self._active:
            yield
            return
        self._suspend()
        try:
            yield
        finally:
            self._resume()

    def close(self) -> None:
        """Stop capturing; what nobody read goes to the rank's own output (tee: already there)."""
        if not self._streams:
            return
        out, err = self._take(1), self._take(2)
        if self._active:
            self._suspend()
        for fd, data in ((1, out), (2, err)):
            if data and not self.tee:
                self._write_original(fd, data)
            self._streams[fd].close()
        for saved in self._saved_fds.values():
            os.close(saved)
        self._streams, self._saved_fds = {}, {}

    def _write_original(self, fd: int, data: bytes) -> None:
        if self.level == "fd":
            os.write(fd, data)
            return
        assert self._saved_streams is not None
        stream = self._saved_streams[fd - 1]
        stream.write(data.decode("utf-8", "replace"))
        stream.flush()


# -- caplog ------------------------------------------------------------------------------------------
class _RecordingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Keeps the records and their formatted text, as pytest's caplog handler does."""

    def __init__(self) -> None:
        super().__init__(io.StringIO())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        super().emit(record)

    def clear(self) -> None:
        self.records.clear()
        self.stream = io.StringIO()

    def handleError(self, record: logging.LogRecord) -> None:
        if logging.raiseExceptions:
            raise  # a bad log call fails the test, as under pytest


class RankLogCapture:
    """caplog in a rank: the public API of pytest.LogCaptureFixture over this rank's logging
    (records, record_tuples, messages, text, clear, set_level, at_level, filtering, handler).
    `get_records("call")` is the test's records; setup and teardown ran in pytest, so they have none."""

    def __init__(self, level: int | None, fmt: str, datefmt: str | None) -> None:
        self.handler = _RecordingHandler()
        self.handler.setFormatter(logging.Formatter(fmt, datefmt))
        self._level = level
        self._attached: list[logging.Logger] = []
        self._root_level: int | None = None
        self._initial_logger_levels: dict[str | None, int] = {}
        self._initial_handler_level: int | None = None
        self._initial_disabled: int | None = None

    def start(self) -> None:
        root = logging.getLogger()
        if self._level is not None:
            self.handler.setLevel(self._level)
            self._root_level = root.level
            root.setLevel(min(root.level, self._level))
        # as pytest: the root logger, and the loggers that do not propagate to it
        self._attached = [root] + [logger for logger in root.manager.loggerDict.values()
                                   if isinstance(logger, logging.Logger) and not logger.propagate]
        for logger in self._attached:
            logger.addHandler(self.handler)

    def finish(self) -> None:
        for logger in self._attached:
            logger.removeHandler(self.handler)
        for name, level in self._initial_logger_levels.items():
            logging.getLogger(name).setLevel(level)
        if self._root_level is not None:
            logging.getLogger().setLevel(self._root_level)
        if self._initial_disabled is not None:
            logging.disable(self._initial_disabled)

    @property
    def records(self) -> list[logging.LogRecord]:
        return self.handler.records

    @property
    def record_tuples(self) -> list[tuple[str, int, str]]:
        return [(r.name, r.levelno, r.getMessage()) for r in self.records]

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    @property
    def text(self) -> str:
        return self.handler.stream.getvalue()

    def get_records(self, when: str) -> list[logging.LogRecord]:
        return list(self.records) if when == "call" else []

    def clear(self) -> None:
        self.handler.clear()

    def _enable(self, level: int | str, logger: logging.Logger) -> int:
        """Lift a `logging.disable` that would hide `level` (as pytest does); the previous setting."""
        before = logger.manager.disable
        number = logging.getLevelName(level) if isinstance(level, str) else level
        if not isinstance(number, int):
            logging.disable(logging.NOTSET)
        elif not logger.isEnabledFor(number):
            logging.disable(max(number - 10, logging.NOTSET))
        return before

    def set_level(self, level: int | str, logger: str | None = None) -> None:
        """Set a logger's level (root by default) and the handler's for the rest of the test."""
        target = logging.getLogger(logger)
        self._initial_logger_levels.setdefault(logger, target.level)
        target.setLevel(level)
        if self._initial_handler_level is None:
            self._initial_handler_level = self.handler.level
        self.handler.setLevel(level)
        disabled = self._enable(level, target)
        if self._initial_disabled is None:
            self._initial_disabled = disabled

    @contextlib.contextmanager
    def at_level(self, level: int | str, logger: str | None = None) -> Iterator[None]:
        target = logging.getLogger(logger)
        before, handler_before = target.level, self.handler.level
        target.setLevel(level)
        self.handler.setLevel(level)
        disabled = self._enable(level, target)
        try:
            yield
        finally:
            target.setLevel(before)
            self.handler.setLevel(handler_before)
            logging.disable(disabled)

    @contextlib.contextmanager
    def filtering(self, filter_: logging.Filter) -> Iterator[None]:
        if filter_ in self.handler.filters:
            yield
            return
        self.handler.addFilter(filter_)
        try:
            yield
        finally:
            self.handler.removeFilter(filter_)


# -- recwarn, monkeypatch, tmp_path_factory ---------------------------------------------------------
def warnings_recorder() -> pytest.WarningsRecorder:
    """pytest's own WarningsRecorder. Its constructor is marked private (`_ispytest`); the test
    `test_builtin_fixtures_private_api` fails loudly if that changes."""
    return pytest.WarningsRecorder(_ispytest=True)


class RankTempPathFactory:
    """tmp_path_factory in a rank. `mktemp(name)` gives every rank the same directory (the k-th
    call with a name on each rank names the same place), under a directory pytest made for this
    test inside the session's base temp, so ranks can share files as they do through tmp_path."""

    def __init__(self, basetemp: Path, root: Path) -> None:
        self._basetemp, self._root = basetemp, root
        self._counts: dict[str, int] = {}

    def getbasetemp(self) -> Path:
        return self._basetemp

    def mktemp(self, basename: str, numbered: bool = True) -> Path:
        name = os.path.normpath(basename)
        if os.path.isabs(name) or name.startswith("..") or os.sep in name:
            raise ValueError(f"{basename} is not a normalized and relative path")
        if numbered:
            count = self._counts.get(name, 0)
            self._counts[name] = count + 1
            name = f"{name}{count}"
        path = self._root / name
        path.mkdir(mode=0o700, parents=True, exist_ok=True)  # exist_ok: every rank makes the same one
        return path


# -- request -------------------------------------------------------------------------------------------
@dataclass
class RankRequest:
    """`request` in a rank. Supported: `node` (name, nodeid, originalname, iter_markers,
    get_closest_marker, keywords, callspec), `fixturenames`, `scope`, and `param` where pytest's
    request has one. The rest (config, getfixturevalue, addfinalizer...) belongs to the pytest
    process: read what the test needs in a fixture and request that fixture."""

    node: RankNode
    fixturenames: tuple[str, ...]
    _param: Any = field(default=UNSET, repr=False)
    scope: str = "function"

    @property
    def param(self) -> Any:
        if self._param is UNSET:
            raise AttributeError("request.param: this request has no param (as in pytest: only a parametrized "
                                 "fixture's request has one; a test reads request.node.callspec.params)")
        return self._param

    def __getattr__(self, name: str) -> Any:
        __tracebackhide__ = True
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"request.{name} is not available inside a rank (it lives in the pytest process): "
                             "compute what the test needs in a fixture and request that fixture")


# -- a stand-in made real ----------------------------------------------------------------------------
def materialize(stand_in: StandIn, stack: contextlib.ExitStack) -> Any:
    """The rank's own value for a stand-in the parent sent, set up now and torn down when `stack`
    closes (after the test)."""
    return _MAKERS[type(stand_in)](stand_in, stack)


def _capture(stand_in: CaptureStandIn, stack: contextlib.ExitStack) -> RankCapture:
    capture = RankCapture(stand_in.level, stand_in.binary, stand_in.tee)
    capture.start()
    stack.callback(capture.close)
    return capture


def _log_capture(stand_in: LogCaptureStandIn, stack: contextlib.ExitStack) -> RankLogCapture:
    caplog = RankLogCapture(stand_in.level, stand_in.fmt, stand_in.datefmt)
    caplog.start()
    stack.callback(caplog.finish)
    return caplog


def _warnings(stand_in: WarningsStandIn, stack: contextlib.ExitStack) -> pytest.WarningsRecorder:
    recorder = stack.enter_context(warnings_recorder())
    warnings.simplefilter("default")  # as pytest's recwarn: every warning, once per location
    return recorder


def _monkeypatch(stand_in: MonkeyPatchStandIn, stack: contextlib.ExitStack) -> pytest.MonkeyPatch:
    patcher = pytest.MonkeyPatch()
    stack.callback(patcher.undo)
    return patcher


def _tmp_path_factory(stand_in: TempPathFactoryStandIn, stack: contextlib.ExitStack) -> RankTempPathFactory:
    return RankTempPathFactory(stand_in.basetemp, stand_in.root)


def _request(stand_in: RequestStandIn, stack: contextlib.ExitStack) -> RankRequest:
    return RankRequest(stand_in.node, stand_in.fixturenames, stand_in.param)


_MAKERS: dict[type[Any], Any] = {
    CaptureStandIn: _capture,
    LogCaptureStandIn: _log_capture,
    WarningsStandIn: _warnings,
    MonkeyPatchStandIn: _monkeypatch,
    TempPathFactoryStandIn: _tmp_path_factory,
    RequestStandIn: _request,
}
