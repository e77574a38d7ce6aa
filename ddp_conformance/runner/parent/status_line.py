"""Progress of a long distributed test on the terminal: what rank 0 last said it was doing.

A rank says it with `ddp.status(text)` (`rank.ddp_context.DdpContext.status`), which writes a small
file the pool names in rank 0's environment (`wire.STATUS_FILE_ENV`). While the pool waits for the
test's answers, `StatusLine.poll` reads it and, once the test has run for a while and the text
changed, writes one line through pytest's terminal reporter, as pytest's own live logging does:

    [ddp] test_suite[torch-resume_fidelity]: resume_fidelity: fit 'uninterrupted', step 120 of 7501 (35 s)

Printed whether or not the output is a terminal: a CI log is not one, and a job that trains for
minutes is where progress is wanted most; the rate limit keeps such a log short.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# a test's first line comes after this long: most distributed tests end within a few seconds, and a
# line for each would only break up the row of dots
PROGRESS_AFTER_SECONDS = 5.0
PROGRESS_EVERY_SECONDS = 5.0  # the most one test prints: a line per this many seconds, when the text changed
# under -q, both: a quiet run shows progress only for work long enough that silence looks like a hang
QUIET_PROGRESS_SECONDS = 30.0
SHOWN_CHARS = 200  # of the rank's text, on one line


class StatusLine:
    """One test's progress lines: `poll` at every wake-up of the pool's wait loop (a few a second)."""

    def __init__(self, path: Path, name: str, write: Callable[[str], None], quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.name, self.write, self.clock = path, name, write, clock
        self.after = QUIET_PROGRESS_SECONDS if quiet else PROGRESS_AFTER_SECONDS
        self.every = QUIET_PROGRESS_SECONDS if quiet else PROGRESS_EVERY_SECONDS
        self.started = clock()
        self.shown = ""
        self.shown_at = -self.every

    def poll(self) -> None:
        now = self.clock()
        elapsed = now - self.started
        if elapsed < self.after or now - self.shown_at < self.every:
            return
        text = read_status(self.path)
        if not text or text == self.shown:
            return
        self.shown, self.shown_at = text, now
        self.write(f"  [ddp] {self.name}: {text} ({elapsed:.0f} s)")


def read_status(path: Path) -> str:
    """The first line of what the rank wrote, printable and cut to SHOWN_CHARS; "" when it wrote nothing."""
    try:
        text = path.read_text("utf-8", "replace")
    except OSError:
        return ""
    first = text.strip().splitlines()[0] if text.strip() else ""
    line = "".join(char if char.isprintable() else " " for char in first).strip()
    return line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS - 3] + "..."


def for_item(item: pytest.Item, path: Path) -> StatusLine | None:
    """The progress lines of one pytest test, written to pytest's terminal; None without a terminal
    reporter (`-p no:terminal`)."""
    config = item.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return None
    capture = config.pluginmanager.get_plugin("capturemanager")
    verbosity = config.getoption("verbose", 0) or 0

    def write(line: str) -> None:
        # the test's output is being captured now: the line goes past it, to the terminal
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext(), \
                contextlib.suppress(OSError):  # a closed terminal must not fail the test it would report on
            _write_between_results(reporter, line, item.nodeid, verbosity)

    name = item.nodeid.split("::", 1)[-1]
    return StatusLine(path, name, write, quiet=verbosity < 0)


def _write_between_results(reporter: Any, line: str, nodeid: str, verbosity: int) -> None:
    """`line` on a line of its own, with pytest's row of results going on after it as it would have:
    the test's file again (default verbosity), the test's name (-v), the dots on a new line (-q)."""
    reporter.ensure_newline()  # ends the line of the file's or test's name
    if verbosity < 0:
        if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 1):  # a row of dots
            reporter.write("\n")
        reporter.write_line(line)
        return
    reporter.write(line, flush=True)
    # left unended, so that what comes next ends it and no blank line follows: pytest's own marks for
    # "a line of no file" (None: the file's name is written again; -2: a newline before the next test's)
    reporter.currentfspath = None if verbosity == 0 else -2
    if verbosity == 0:
        reporter.write_fspath_result(nodeid, "")
