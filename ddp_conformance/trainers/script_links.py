"""Both processes (it acts in the ranks): the links a `script:` fit's working directory holds to the SPEC's
base while the script runs, and what keeps the script's own writes out of the base through them.

The working directory is the fit's `{checkpoint_dir}` (the Trainer's `--output_dir`), and it holds a link to
each entry of the base so that relative inputs (`data/`, `config/train.py`) resolve as they would from there.
A script that writes a file of the same name as one of the base's into its output directory (the Trainer's
model card, `output_dir/README.md`) would write through the link into the user's own file. So while links
stand, an audit hook (`sys.addaudithook`, PEP 578) sees every Python `open` of one of these file links for
writing and first turns the link into a file of the working directory's own: removed where the open
truncates, a copy of the base's file where it appends or updates. The base's file is left as it was, and
the fit is told which (`diverted`). Writes by native code that bypass Python's `open` (a C or Rust writer)
and writes inside a linked folder are not diverted; the fit names them afterwards from the base's listing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: suffixes of files never linked: an earlier run's checkpoint in the base must not be resumed from
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

_file_links: dict[str, Path] = {}  # absolute path of a file link in a working directory -> the base's file
_diverted: list[str] = []  # the links the hook turned into files of their own, by name
_busy = threading.local()  # the hook's own copy opens files too
_installed = False


class LinkedInputs:
    """The links of one run; `hidden`: the checkpoint-like files of the base not linked, `diverted`: the
    base files the script wrote to, which it got a copy of its own of instead."""

    def __init__(self, base: Path, cwd: Path) -> None:
        self.base, self.cwd = base, cwd
        self.hidden: list[str] = []
        self.diverted: list[str] = []

    @contextlib.contextmanager
    def standing(self) -> Iterator[LinkedInputs]:
        _install()
        links = []
        for entry in sorted(self.base.iterdir()):
            link = self.cwd / entry.name
            if entry.is_file() and entry.suffix in CHECKPOINT_SUFFIXES:
                self.hidden.append(entry.name)
            elif not os.path.lexists(link):
                link.symlink_to(entry, target_is_directory=entry.is_dir())
                links.append(link)
                if not entry.is_dir():
                    _file_links[_key(link)] = entry
        del _diverted[:]
        try:
            yield self
        finally:
            self.diverted = list(_diverted)
            for link in links:
                _file_links.pop(_key(link), None)
                if link.is_symlink():
                    link.unlink()


def _install() -> None:
    global _installed
    if not _installed:
        sys.addaudithook(_on_event)  # for the process's life: inert while no link stands
        _installed = True


def _on_event(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _file_links or getattr(_busy, "on", False):
        return
    path, mode, flags = (*args, None, None)[:3]
    if not isinstance(path, (str, bytes, os.PathLike)) or not _writes(mode, flags):
        return
    absolute = _key(os.fsdecode(path))
    target = _file_links.get(absolute)
    if target is None or not os.path.islink(absolute):
        return
    _busy.on = True
    try:
        os.unlink(absolute)
        if isinstance(mode, str) and "x" in mode:
            pass  # an exclusive create makes the file itself
        elif (isinstance(mode, str) and "w" in mode) or bool((flags or 0) & os.O_TRUNC):
            Path(absolute).touch()  # truncated: an empty file of its own, for an open that does not create
        else:  # appends or updates: the script's own copy of what the base holds
            staged = f"{absolute}.ddp-copy"
            shutil.copyfile(target, staged)
            os.replace(staged, absolute)
        del _file_links[absolute]
        _diverted.append(os.path.basename(absolute))
    finally:
        _busy.on = False


def _key(path: str | Path) -> str:
    """A link's path with its folder resolved (the process's cwd is: `os.getcwd()` resolves symbolic links), not
    the link itself."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _writes(mode: Any, flags: Any) -> bool:
    """Whether an open's mode (builtin `open`) or flags (`os.open`) can change the file."""
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
