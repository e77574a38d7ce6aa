"""One rank process as the supervisor sees it: its handle, its channel, its log and its exit.

`ProcessHandle` is what the supervisor needs of a process, whoever started it (`subprocess.Popen` for
an exec'd rank, the fork server's `ForkedRank` for a forked one).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import subprocess
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

OUTPUT_READ_BYTES = 4 << 20  # a rank's output of one test read whole up to this size...
OUTPUT_KEEP_BYTES = 256 << 10  # ...beyond it, only this much of its head and of its tail


class ProcessHandle(Protocol):
    """What the supervisor needs of a rank process: `subprocess.Popen`, or a fork server's `ForkedRank`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def catches_signal(pid: int | str, signum: int) -> bool:
    """Whether process `pid` ("self" for this one) has a handler for `signum`: Linux's SigCgt mask
    in /proc; True where that cannot be read, so a caller that asks before signalling acts as before."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


@dataclass
class RankProcess:
    rank: int
    popen: ProcessHandle
    log_path: Path
    stack_path: Path
    sentinel: int | None
    conn: Connection | None = None  # set when the rank says hello on the pool's socket
    log_offset: int = 0
    log_fd: int | None = None  # kept open: reopening four logs per test cost more than the test

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def ended_within(self, timeout: float) -> bool:
        """Whether the process ends within `timeout` seconds. Its pidfd turns readable the moment it
        exits, before whoever reaps it has: a forked rank is reaped by the fork server, which hears of it
        only between the imports it does while idle (seconds each), and ending a session waited on
        that. Without a pidfd, the handle's own wait."""
        if self.sentinel is None:
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        watch = select.poll()  # not select(): a long session's pidfd can be above FD_SETSIZE
        watch.register(self.sentinel, select.POLLIN)
        ended = bool(watch.poll(max(0, math.ceil(timeout * 1000))))
        if ended:
            self.popen.poll()  # reaped now if it is ours (exec'd); a forked one's code comes later
        return ended

    def exit_description(self) -> str:
        code = self.popen.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name} ({-code})"
        return f"exit code {code}"

    def _log(self) -> int | None:
        if self.log_fd is None:
            with contextlib.suppress(OSError):
                self.log_fd = os.open(self.log_path, os.O_RDONLY)
        return self.log_fd

    def output_since(self, offset: int) -> str:
        """What the rank printed from `offset` on, read through the log kept open; beyond
        OUTPUT_READ_BYTES only its first and last OUTPUT_KEEP_BYTES (the report keeps a head and a
        tail of it anyway)."""
        fd, size = self._log(), self.log_size()
        if size - offset <= OUTPUT_READ_BYTES:
            return self._read(fd, offset, size).decode("utf-8", "replace")
        head = self._read(fd, offset, offset + OUTPUT_KEEP_BYTES)
        tail = self._read(fd, size - OUTPUT_KEEP_BYTES, size)
        cut = size - offset - 2 * OUTPUT_KEEP_BYTES
        return f"{head.decode('utf-8', 'replace')}\n... {cut} bytes cut ...\n{tail.decode('utf-8', 'replace')}"

    @staticmethod
    def _read(fd: int | None, start: int, end: int) -> bytes:
        chunks: list[bytes] = []
        with contextlib.suppress(OSError):
            while fd is not None and start < end and (chunk := os.pread(fd, end - start, start)):
                chunks.append(chunk)
                start += len(chunk)
        return b"".join(chunks)

    def log_size(self) -> int:
        fd = self._log()
        try:
            return os.fstat(fd).st_size if fd is not None else 0
        except OSError:
            return 0

    def close_log(self) -> None:
        if self.log_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.log_fd)
            self.log_fd = None
