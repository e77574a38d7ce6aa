"""The fork-server process ranks are forked from (`python -m ddp_conformance.runner.rank.fork_server`).

It imports what every rank needs (`wire.RANK_IMPORTS`) once, then forks a rank per request of its parent's
`parent.fork_server._Server`; each child becomes a rank (`serve.serve`) without returning into the loop.
It is on the rank side because every rank starts as a copy of this process: what it imports, every
rank has. It reaps its children and reports each exit status to the parent.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

from ..wire import RANK_IMPORTS, WARMUP, Call, Exited, Fork, Forked, Ready, WarmUp, receive, send
from . import serve

# wire.WARMUP, once the pool says ranks use it, is imported while the fork server is idle, one module
# at a time, so that a fork request never waits long
WARMUP_AFTER_IDLE = 0.5  # seconds without a request: a pool being started sends its forks back to back


def _child(request: Fork | Call, conn: Connection, fork_server_pid: int) -> None:
    """In the forked process: never returns into the fork server's loop."""
    code = 1
    try:
        conn.close()
        os.setsid()  # its own process group, killed whole by the pool
        log = os.open(request.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        if isinstance(request, Fork):
            os.environ.clear()
            os.environ.update(request.env)
        os.environ["DDP_CONFORMANCE_PARENT"] = str(fork_server_pid)  # taken before the fork: no race
        serve.die_with_parent()
        code = serve.serve() if isinstance(request, Fork) else _call(request)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _call(request: Call) -> int:
    """`request.target(request.argument)`, its str written whole (temp file + rename) or not at all."""
    sys.path[:] = request.sys_path
    os.chdir(request.cwd)
    module, _, name = request.target.partition(":")
    result = getattr(importlib.import_module(module), name)(request.argument)
    temp = f"{request.result_path}.tmp"
    with open(temp, "w", encoding="utf-8") as out:
        out.write(result)
    os.replace(temp, request.result_path)
    return 0


def _reap(conn: Connection) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(conn, Exited(pid=pid, status=status))


def _import_quietly(name: str) -> str | None:
    """A preload is an optimisation: one that fails is logged, and the ranks import it themselves.
    Returns the error's one line, for the pool to judge (a rank without torch serves no test)."""
    try:
        __import__(name)
    except Exception as exc:
        traceback.print_exc()
        return f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"
    return None


def _import_all(names: tuple[str, ...]) -> dict[str, str]:
    """Each module's import, and the error of every one that raised."""
    problems = {name: _import_quietly(name) for name in dict.fromkeys(names)}
    return {name: problem for name, problem in problems.items() if problem is not None}


def import_problems(names: str) -> str:
    """`ForkServer.import_problems`' question (a JSON list of module names) asked in a process forked as a
    rank is: a JSON object of those that raised on import, each with its error."""
    return json.dumps(_import_all(tuple(json.loads(names))))


def main(fd: int, preload: list[str]) -> int:
    serve.die_with_parent()
    conn = Connection(fd)
    unimportable = _import_all((*RANK_IMPORTS, *preload))  # (torch._dynamo also writes os.environ: reset per rank)
    warmup: list[str] = []
    busy_until = time.monotonic() + WARMUP_AFTER_IDLE
    try:
        send(conn, Ready(pid=os.getpid(), unimportable=unimportable))
        while True:
            _reap(conn)
            if not conn.poll(0.02):
                if warmup and time.monotonic() > busy_until:
                    _import_quietly(warmup.pop(0))  # (torch._dynamo also writes os.environ: reset per rank)
                continue
            busy_until = time.monotonic() + WARMUP_AFTER_IDLE
            request = receive(conn)
            if isinstance(request, WarmUp):
                warmup = [name for name in WARMUP if name not in sys.modules]
            if isinstance(request, Fork | Call):
                me = os.getpid()
                pid = os.fork()
                if pid == 0:
                    _child(request, conn, me)
                send(conn, Forked(pid=pid))
    except (EOFError, OSError):
        return 0  # the pool is gone (a closed channel is how it says so); its ranks follow us


if __name__ == "__main__":
    code = main(int(sys.argv[1]), sys.argv[2:])
    sys.stdout.flush()
    os._exit(code)  # no teardown of torch's modules (seconds of CPU): nothing here needs it
