"""The parent's handles on the fork servers ranks come from (the process itself: `rank.fork_server`).

`import torch` costs 2-3 s of CPU on a small CI runner; a pool of N ranks started by exec pays it N
times, and again after every failure that forces a rebuild. Forking from a process that has torch
imported (but never initialised threads, CUDA or a process group) makes a rank's start a few
milliseconds. The fork server dies with pytest (parent-death signal) and its ranks die with it.

Ranks are the fork server's children, so it reaps them and reports each exit status to the pool; the pool
still watches them through pidfds and kills them directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection

from ..wire import RANK_IMPORTS, Call, Exited, Fork, Forked, Ready, WarmUp, receive, send


class _Server:
    """One fork-server process: start it, ask it for ranks, learn how they ended."""

    def __init__(self, start_timeout: float, preload: tuple[str, ...], hash_seed: str | None) -> None:
        """`hash_seed`: its PYTHONHASHSEED (None: the user's)."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ, DDP_CONFORMANCE_PARENT=str(os.getpid()), PYTHONUNBUFFERED="1")
        if hash_seed is not None:
            env["PYTHONHASHSEED"] = hash_seed
        # its own words (an import error, say) go to a private log, read back when it fails to start,
        # never onto pytest's terminal
        self.log_dir = tempfile.mkdtemp(prefix="ddp-conformance-fork-server-")
        self.log_path = os.path.join(self.log_dir, "fork_server.log")
        try:
            with open(self.log_path, "wb") as log:
                self.popen = subprocess.Popen(
                    [sys.executable, "-m", "ddp_conformance.runner.rank.fork_server", str(theirs.fileno()), *preload],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True,
                )
        except BaseException:
            ours.close()
            shutil.rmtree(self.log_dir, ignore_errors=True)
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.exits: dict[int, int] = {}
        self.start_timeout = start_timeout
        self.ready = False  # it imports torch while pytest goes on; the first fork waits for it
        self.unimportable: dict[str, str] = {}  # its imports that raised, each with its error (`wire.Ready`)

    def wait_ready(self) -> None:
        if self.ready:
            return
        try:
            if not self.conn.poll(self.start_timeout):
                raise OSError(f"the rank fork server did not start within {self.start_timeout:g} s")
            message = receive(self.conn)
        except (EOFError, OSError) as exc:
            words = self._log_tail()
            self.close()
            raise OSError(f"the rank fork server failed to start: {exc}{words}") from None
        if not isinstance(message, Ready):
            self.close()
            raise OSError(f"the rank fork server said {message!r} instead of ready")
        self.unimportable = message.unimportable
        self.ready = True

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as log:
            tail = log.read().strip().splitlines()[-5:]
            return ("\n" + "\n".join(tail)) if tail else ""
        return ""

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def fork(self, request: Fork | Call) -> int:
        self.wait_ready()
        try:
            send(self.conn, request)
            while True:
                message = receive(self.conn)
                if isinstance(message, Forked):
                    self.exits.pop(message.pid, None)  # a pid used again: not the earlier rank's exit
                    return message.pid
                self._note(message)
        except EOFError:
            raise OSError("the rank fork server is gone") from None

    def warm_up(self) -> None:
        with contextlib.suppress(OSError):
            send(self.conn, WarmUp())

    def _note(self, message: object) -> None:
        if isinstance(message, Exited):
            self.exits[message.pid] = os.waitstatus_to_exitcode(message.status)

    def returncode(self, pid: int) -> int | None:
        with contextlib.suppress(EOFError, OSError):
            while pid not in self.exits and self.conn.poll(0):
                self._note(receive(self.conn))
        return self.exits.get(pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()
        try:
            if self.popen.poll() is None:
                self.popen.kill()
            self.popen.wait()
        finally:
            shutil.rmtree(self.log_dir, ignore_errors=True)


class ForkServer:
    """The pool's side of the fork servers: two processes, rank 0 forked from one and every other rank
    from the other.

    Forked ranks share their server's str hash secret, which Python picks per interpreter: ranks
    forked from one process would all iterate a set of strings in one order and agree on every
    `hash(name)`, where torchrun's ranks, separate interpreters, do not. A vocabulary built from
    `set(label_names)`, or files sharded by `hash(path)`, would then look consistent here and differ
    per rank in production. Two servers give rank 0 and the others different secrets: fixed ones
    (PYTHONHASHSEED 1 and 2), so that a verdict that depends on them is the same in every run. Both
    import torch at once, on a machine's two cores. Where the user sets PYTHONHASHSEED, torchrun's
    ranks would all inherit it: one server, with the user's, serves every rank."""

    HASH_SEEDS = ("1", "2")

    def __init__(self, start_timeout: float, preload: tuple[str, ...] = ()) -> None:
        """`preload`: modules imported, after `wire.RANK_IMPORTS`, before it says it is ready (`DdpTest.preload`)."""
        self.servers: list[_Server] = []
        self.preload = preload
        seeds: tuple[str | None, ...] = (None,) if "PYTHONHASHSEED" in os.environ else self.HASH_SEEDS
        try:
            for seed in seeds:
                self.servers.append(_Server(start_timeout, preload, seed))
        except BaseException:
            self.close()
            raise
        self.warming = False

    @property
    def pids(self) -> list[int]:
        return [server.popen.pid for server in self.servers]

    def wait_ready(self) -> None:
        try:
            for server in self.servers:
                server.wait_ready()
        except BaseException:
            self.close()  # the other one too: a fork server that cannot fork every rank is no use
            raise

    @property
    def alive(self) -> bool:
        return all(server.alive for server in self.servers)

    def import_problems(self, names: tuple[str, ...]) -> dict[str, str]:
        """Which of these modules a rank cannot import, each with its error. The servers tried theirs on
        starting (waited for); the others are tried in a process forked as a rank is. Raises OSError
        where that process gives no answer."""
        self.wait_ready()
        problems = {name: problem for server in self.servers for name, problem in server.unimportable.items()}
        untried = [name for name in names if name not in RANK_IMPORTS and name not in self.preload]
        if untried:
            answer = self.call("ddp_conformance.runner.rank.fork_server:import_problems", json.dumps(untried))
            problems.update(json.loads(answer))
        return {name: problems[name] for name in names if name in problems}

    def fork(self, env: dict[str, str], log_path: str) -> ForkedRank:
        """A rank with this environment: from the first server for rank 0, from the last for the rest."""
        server = self.servers[0 if env.get("RANK", "0") == "0" else -1]
        return ForkedRank(server, server.fork(Fork(env=env, log_path=log_path)))

    def call(self, target: str, argument: str) -> str:
        """What `target(argument)` returns (`wire.Call`), run in a process forked from rank 0's server once
        it has imported what ranks need, with this process's sys.path and working directory (as a rank
        runs a task); waits as long as that takes, as an import in this process would. Raises OSError
        (with its last words) when it ends without a result."""
        server = self.servers[0]
        result_path = os.path.join(server.log_dir, f"call-{time.monotonic_ns()}.out")
        log_path = f"{result_path}.log"
        call = Call(target, argument, result_path, log_path, sys_path=list(sys.path), cwd=os.getcwd())
        child = ForkedRank(server, server.fork(call))
        try:
            code = child.wait()
        except BaseException:  # interrupted: the child goes, reaped by its server before this one may go too
            child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)
            raise
        try:
            with open(result_path, encoding="utf-8") as result:
                return result.read()
        except OSError:
            words = ""
            with contextlib.suppress(OSError), open(log_path, errors="replace") as log:
                words = "".join(f": {line}" for line in log.read().strip().splitlines()[-1:])
            raise OSError(f"{target} ended with exit code {code} and no result{words}") from None
        finally:
            for path in (result_path, log_path):
                with contextlib.suppress(OSError):
                    os.remove(path)

    def warm_up(self) -> None:
        """Ranks use the WARMUP modules: have them imported for the ranks forked from now on."""
        if not self.warming:
            self.warming = True
            for server in self.servers:
                server.warm_up()

    def close(self) -> None:
        """Kill them: they hold nothing worth a goodbye (their pools are stopped first), and asking one
        to leave cost a session seconds (it hears only between its idle-time imports, and a Python
        that has imported torch takes seconds to tear itself down)."""
        with contextlib.ExitStack() as closing:  # every one, even when closing another is interrupted
            for server in self.servers:
                closing.callback(server.close)


class ForkedRank:
    """A rank one fork server forked, with the subset of Popen the supervisor uses."""

    def __init__(self, server: _Server, pid: int) -> None:
        self.server = server
        self.pid = pid

    def poll(self) -> int | None:
        code = self.server.returncode(self.pid)
        if code is None and not self.server.alive:
            return -9  # its server is gone, and with it (parent-death signal) every rank it forked
        return code

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
