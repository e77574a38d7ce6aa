"""Helpers shared by the plugin's own tests: finding rank processes, reading nested-pytest output."""

from __future__ import annotations

import os
from pathlib import Path


def _rank_parent(pid: int) -> int | None:
    """The pytest pid a rank process belongs to (from its environment), or None if not a rank."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"ddp_conformance." not in cmdline:  # ranks, exec'd or forked by the fork server, and the fork server
            return None
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"DDP_CONFORMANCE_PARENT="):
                return int(entry.split(b"=", 1)[1])
    except (OSError, ValueError):
        return None
    return None


class _LiveRanks:
    """Rank processes alive now, optionally only those of one parent pytest."""

    def __call__(self, parent: int | None = None, exclude_parent: int | None = None) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            owner = _rank_parent(int(entry))
            if owner is None or (parent is not None and owner != parent):
                continue
            if exclude_parent is not None and owner == exclude_parent:
                continue
            if _is_zombie(int(entry)):
                continue
            found.append(int(entry))
        return found

    @staticmethod
    def parent_gone(pid: int) -> bool:
        owner = _rank_parent(pid)
        return owner is not None and not Path(f"/proc/{owner}").exists()


def is_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a container's PID 1 may never reap an orphan)."""
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


live_ranks = _LiveRanks()


def failure_report(lines: list[str]) -> list[str]:
    """A nested pytest's FAILURES section, without its `= FAILURES =` line: what a user reads of the
    failures, up to the next `=` separator (the conformance matrix or the short summary)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("=") and " FAILURES " in line)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("=")), len(lines))
    return lines[start + 1:end]
