"""Which frames of a traceback or a stack are the user's: the plugin's own never show in a report.

A failure in a rank passes through the runner (the rank's loop, the test's call) and, for the
conformance suite, through the checks that drive the trainer. Those frames and their source say
nothing a user can act on, so every report shows the user's frames only: the harness is this
package's directory, whatever layer the frame belongs to. Library frames (torch, the standard
library) stay in tracebacks, where they locate the error, and become one phrase ("waiting in
all_reduce") in the stacks of stuck ranks.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

HARNESS_DIR = str(Path(__file__).resolve().parents[1]) + os.sep  # ddp_conformance/
_LIBRARY_DIRS = tuple(dict.fromkeys(
    str(Path(p).resolve()) + os.sep
    for p in (sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")) if p
))


def is_harness(path: str | os.PathLike[str]) -> bool:
    """Whether a frame's file is the plugin's own code."""
    return os.path.abspath(os.fspath(path)).startswith(HARNESS_DIR)


def is_library(path: str) -> bool:
    """Whether a frame's file is an installed package's or the standard library's (or frozen)."""
    if path.startswith("<"):
        return True
    absolute = os.path.abspath(path)
    return (absolute.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in absolute
            or f"{os.sep}dist-packages{os.sep}" in absolute)


def is_users(path: str) -> bool:
    """Whether a frame is the user's own code: neither the harness nor a library."""
    return not is_harness(path) and not is_library(path)
