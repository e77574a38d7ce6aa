"""Both processes: how a message names ranks, and a rank process's CPU time read from /proc.

The parent judges ranks with these, and the checks inside a rank name the ranks they judge and watch their peers'
processes with them: a module of the runner's own that neither side owns, like `wire.py` and `frames.py`."""

from __future__ import annotations

import os
from collections.abc import Iterable


def ranks_label(ranks: Iterable[int]) -> str:
    """"rank 1" or "ranks 1, 3": how every message names ranks."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def cpu_seconds(pid: int | str) -> float | None:
    """User + system CPU time of process `pid` so far (fields 14 and 15 of /proc/PID/stat, after the
    command's parentheses); None where it cannot be read (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return None
