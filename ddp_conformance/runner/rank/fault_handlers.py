"""A rank's Python stacks on demand and its last words on a crash, kept installed whatever tests do.

faulthandler writes the stacks from a C signal handler, so they come even from a rank blocked in a
collective or spinning in C. Lightning's Trainer, at the end of every fit, sets every signal back
to the handler Python's `signal` module last saw: SIG_DFL for faulthandler's, which sit beneath
Python. The pool's stack request (STACK_DUMP_SIGNAL) would then kill the rank, and a segfault would
lose its traceback. So the rank installs them again after every test, and the Lightning adapter
after every fit. This module is never run as a script: the rank's entry point (`python -m
...runner.rank.serve`) and the adapter must share its one `_files`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
from typing import TextIO

from ..wire import STACK_DUMP_SIGNAL

_files: tuple[TextIO, TextIO] | None = None  # (stacks on request, last words): set in a pool's rank only


def arm(stack_file: str) -> None:
    """Stacks on STACK_DUMP_SIGNAL into `stack_file` (the pool reads it when a test hangs), and on a
    fatal signal into this process's stderr as it is now (the rank's log)."""
    global _files
    _files = (open(stack_file, "w"), sys.stderr)  # noqa: SIM115 - they live with the rank
    rearm()


def rearm() -> None:
    """Install both again (~7 us); a no-op outside a pool's rank. Always a reinstall: faulthandler
    skips a handler it believes installed, which after Lightning's reset it no longer is."""
    if _files is None:
        return
    stacks, last_words = _files
    # while faulthandler's own handler is off (unregister puts back the one it replaced), a stack
    # request is ignored, never fatal; the main thread alone may set a handler
    with contextlib.suppress(ValueError):
        signal.signal(STACK_DUMP_SIGNAL, signal.SIG_IGN)
    faulthandler.unregister(STACK_DUMP_SIGNAL)
    faulthandler.register(STACK_DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    faulthandler.disable()
    faulthandler.enable(file=last_words, all_threads=True)
