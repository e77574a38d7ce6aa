"""How a pool's ranks check in: one Unix socket per pool, a hello per rank, then a ready per rank.

The socket is a path inside the pool's private (0700) directory, so no other user can reach it, and
on Linux only the pool's own rank pids are accepted (SO_PEERCRED). Nothing a stranger sends is ever
unpickled. A rank connects before it joins the group (`Hello`) and says `Ready` once it has joined.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path

from ..wire import Hello, Ready, receive
from .process import RankProcess


class StartTimeout(Exception):
    """Some ranks did not check in before the deadline; `waiting` says which."""

    def __init__(self, waiting: list[int]) -> None:
        super().__init__(waiting)
        self.waiting = waiting


class DiedWhileStarting(Exception):
    """A rank exited before it was ready."""

    def __init__(self, proc: RankProcess) -> None:
        super().__init__(proc.rank)
        self.proc = proc


class Handshake:
    """The pool's listening socket, from `bind` until every rank is ready (or the start failed)."""

    def __init__(self, directory: Path, backlog: int) -> None:
        self.address = str(directory / "pool.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.address)
        sock.listen(backlog)
        self._listener: socket.socket | None = sock

    def _accept(self, ranks: Sequence[RankProcess]) -> tuple[Connection, int | None] | None:
        """A rank's connection and its rank (from its pid, where the kernel tells), or None for a
        connection that is not one of ours (closed unread)."""
        assert self._listener is not None
        client, _ = self._listener.accept()
        peer_credentials = getattr(socket, "SO_PEERCRED", None)
        if peer_credentials is None:
            return Connection(client.detach()), None  # the 0700 directory is the only gate here
        pid = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, peer_credentials, struct.calcsize("3i")))[0]
        for proc in ranks:
            if proc.popen.pid == pid and proc.conn is None:
                return Connection(client.detach()), proc.rank
        client.close()
        return None

    def await_ready(self, ranks: Sequence[RankProcess], deadline: float) -> None:
        """Give each rank its channel (`conn`) as it says hello, and return once every rank is ready.
        Raises `StartTimeout` at the deadline and `DiedWhileStarting` for a rank that exited."""
        assert self._listener is not None
        by_rank = {proc.rank: proc for proc in ranks}
        strangers: list[Connection] = []
        waiting = set(by_rank)
        try:
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StartTimeout(sorted(waiting))
                for rank in sorted(waiting):
                    if not by_rank[rank].alive:
                        raise DiedWhileStarting(by_rank[rank])
                watch: list[object] = [self._listener, *strangers]
                watch += [by_rank[r].conn for r in waiting if by_rank[r].conn is not None]
                for ready in wait(watch, timeout=min(remaining, 0.1)):
                    if ready is self._listener:
                        self._take_connection(ranks, by_rank, strangers)
                        continue
                    assert isinstance(ready, Connection)
                    self._take_message(ready, by_rank, strangers, waiting)
        finally:
            self.close(strangers)

    def _take_connection(self, ranks: Sequence[RankProcess], by_rank: dict[int, RankProcess],
                         strangers: list[Connection]) -> None:
        accepted = self._accept(ranks)
        if accepted is None:
            return
        conn, known_rank = accepted
        if known_rank is None:
            strangers.append(conn)
        else:
            by_rank[known_rank].conn = conn

    @staticmethod
    def _take_message(ready: Connection, by_rank: dict[int, RankProcess], strangers: list[Connection],
                      waiting: set[int]) -> None:
        try:
            message = receive(ready)
        except (EOFError, OSError):
            if ready in strangers:
                strangers.remove(ready)
            return  # its exit is picked up on the next pass, with its code
        if isinstance(message, Hello) and ready in strangers:
            strangers.remove(ready)
            if message.rank in by_rank and by_rank[message.rank].conn is None:
                by_rank[message.rank].conn = ready
            else:
                ready.close()
        elif isinstance(message, Ready):
            waiting.discard(next(r for r, p in by_rank.items() if p.conn is ready))

    def close(self, strangers: Sequence[Connection] = ()) -> None:
        for conn in strangers:
            with contextlib.suppress(OSError):
                conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
