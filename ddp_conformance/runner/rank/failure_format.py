"""A rank's failure as pytest would print it, showing the user's frames only.

The rank's loop, the test's call and (for the conformance suite) the checks are the plugin's frames:
they say nothing a user can act on, so `format_failure` leaves them out (`frames.is_harness`) and
says where the user's code raised.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import types
from collections.abc import Iterator
from typing import Any

from _pytest._code import Code, ExceptionInfo
from _pytest._io import TerminalWriter

from ..frames import is_harness


def _walk(tb: types.TracebackType | None) -> Iterator[str]:
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename
        tb = tb.tb_next


def shown_exception(exc: BaseException) -> BaseException:
    """The exception whose traceback a user should read. A harness exception raised `from` the
    user's (an adapter call that raised, a trainer that could not be built) has only the plugin's
    frames: its message is the verdict's headline, and its cause holds the user's frames."""
    while exc.__cause__ is not None and not any(not is_harness(path) for path in _walk(exc.__traceback__)):
        exc = exc.__cause__
    return exc


def _message_lines(exc: BaseException) -> str:
    """pytest's `E` lines of an exception without its traceback."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return "\n".join(f"E   {line}" for line in text.splitlines())


def format_failure(exc: BaseException, func: Any, style: str) -> tuple[str, str]:
    """pytest's own representation of a rank's failure in `style`, with the user's frames only, and
    where it was raised ("path:line"; "" when no frame is the user's): cut to start at the test
    function as pytest does, then every frame of the plugin itself left out (`frames.is_harness`).
    A failure with no frame of the user's (a check's verdict, raised by the harness) is its message."""
    shown = shown_exception(exc)
    start: tuple[Any, int] | None = None
    with contextlib.suppress(Exception):
        code = Code.from_function(inspect.unwrap(func))
        start = (code.path, code.firstlineno)

    def users_frames(info: ExceptionInfo[BaseException]) -> Any:
        traceback = info.traceback
        if start is not None and info.value is shown:
            cut = traceback.cut(path=start[0], firstlineno=start[1])
            traceback = cut if cut != traceback else cut.cut(path=start[0])
        return traceback.filter(info).filter(lambda entry: not is_harness(entry.path))

    info = ExceptionInfo.from_exception(shown)
    own = users_frames(info)
    if not own:
        return _message_lines(shown), ""
    where = f"{own[-1].path}:{own[-1].lineno + 1}"
    style = style if style in ("long", "short", "no", "native") else "short"
    buffer = io.StringIO()
    writer = TerminalWriter(file=buffer)
    writer.hasmarkup = False
    # not str(): TerminalRepr.__str__ strips, eating the first source line's indentation
    info.getrepr(style=style, funcargs=False, truncate_locals=True, tbfilter=users_frames).toterminal(writer)
    return buffer.getvalue().rstrip(), where
