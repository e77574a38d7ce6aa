"""Process supervision: one object owns the ranks of a pool, their output and their exit codes.

Modelled on torch.distributed.elastic's `PContext`: ranks are plain subprocesses the pool starts,
watches (result pipe + pidfd per rank), asks for a stack dump, and kills. Rendezvous goes through a
FileStore in the pool's private temp dir, so no port is ever fixed or guessed, and the store file is
deleted only after every rank is dead (deleting it under a live group hangs it, DeepSpeed #7941).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Protocol

from .messages import Hello, RankReply, Ready, Stop, Task, encode, receive, send
from .zygote import ForkedRank, Zygote

STACK_DUMP_SIGNAL = signal.SIGUSR1
# After one rank has failed, how long the others get to answer before they count as stuck (typically
# blocked in a collective the failed rank will never join). Long enough for a slow rank to finish its
# own failure, short enough that a one-sided assert does not hold the session for the whole timeout.
FAILURE_GRACE_SECONDS = 5.0
STOP_GRACE_SECONDS = 5.0
OUTPUT_READ_BYTES = 4 << 20  # a rank's output of one test read whole up to this size...
OUTPUT_KEEP_BYTES = 256 << 10  # ...beyond it, only this much of its head and of its tail


class PoolStartError(Exception):
    """The ranks did not all come up; the message says which and why."""


class ProcessHandle(Protocol):
    """What the supervisor needs of a rank process: `subprocess.Popen`, or a zygote's `ForkedRank`."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


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


@dataclass
class RankEnd:
    """How one rank ended a task when it sent no reply: crashed, or stuck and then killed."""

    rank: int
    kind: str  # "crashed" | "hung"
    detail: str
    stack: str = ""


@dataclass
class PoolRun:
    """Everything the pool learned from one task, in rank order."""

    replies: dict[int, RankReply] = field(default_factory=dict)
    ends: dict[int, RankEnd] = field(default_factory=dict)
    output: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False
    duration: float = 0.0
    arrival: list[int] = field(default_factory=list)  # ranks in the order their answer or end came

    @property
    def poisoned(self) -> bool:
        """Whether the group can serve another test: any crash or hang, or a rank that says its group
        is out of step (sequence numbers differ, the group was destroyed, threads left behind)."""
        if self.ends:
            return True
        if any(not reply.group_healthy for reply in self.replies.values()):
            return True
        sequences = {reply.sequence for reply in self.replies.values()}
        return len(sequences) > 1


class _Watch:
    """One poll set over the ranks' channels (an answer) and pidfds (an exit) for one task: built
    once per test, where `multiprocessing.connection.wait` builds a selector per wake-up."""

    def __init__(self, procs: Iterable[RankProcess], channels: bool = True) -> None:
        self._poll = select.poll()
        self._owner: dict[int, tuple[int, bool]] = {}  # fd -> (rank, is its pidfd)
        for proc in procs:
            if channels and proc.conn is not None:
                self._add(proc.conn.fileno(), proc.rank, False)
            if proc.sentinel is not None:
                self._add(proc.sentinel, proc.rank, True)

    def _add(self, fd: int, rank: int, is_pidfd: bool) -> None:
        self._poll.register(fd, select.POLLIN)
        self._owner[fd] = (rank, is_pidfd)

    def wait(self, timeout: float) -> tuple[set[int], set[int]]:
        """(ranks with something to read, ranks that exited), after at most `timeout` seconds."""
        readable: set[int] = set()
        ended: set[int] = set()
        for fd, _ in self._poll.poll(max(0, math.ceil(timeout * 1000))):
            rank, is_pidfd = self._owner[fd]
            (ended if is_pidfd else readable).add(rank)
        return readable, ended

    def forget(self, proc: RankProcess) -> None:
        for fd in [fd for fd, (rank, _) in self._owner.items() if rank == proc.rank]:
            self._poll.unregister(fd)
            del self._owner[fd]

    def close(self) -> None:
        self._owner.clear()


def loopback_interface() -> str | None:
    """The name of the loopback interface, so gloo never picks a CI machine's external NIC."""
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return None


class RankPool:
    """The warm ranks of one (world size, backend): started once, fed test after test."""

    def __init__(
        self,
        world_size: int,
        backend: str,
        *,
        start_timeout: float,
        rank_threads: int | None,
        cuda_devices: tuple[str, ...] = (),
        zygote: Zygote | None = None,
        group_timeout: float | None = None,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.start_timeout = start_timeout
        self.rank_threads = rank_threads
        self.cuda_devices = cuda_devices
        self.ranks: list[RankProcess] = []
        self.workdir: Path | None = None
        self.zygote = zygote
        # collectives must not give up before the test's own wall-clock limit: the supervisor, not
        # the group, decides when a test has hung
        self.group_timeout = max(group_timeout or 0.0, start_timeout, 30.0)
        self.ready = False
        self.started_in = 0.0
        self._launched_at = 0.0
        self._listener: socket.socket | None = None
        self._address = ""

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Spawn the ranks and return at once: they import torch and meet while pytest goes on."""
        self._launched_at = time.monotonic()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"ddp-conformance-ws{self.world_size}-"))
        if len(str(self.workdir / "pool.sock")) > 100 and os.path.isdir("/tmp"):  # AF_UNIX path limit
            os.rmdir(self.workdir)
            self.workdir = Path(tempfile.mkdtemp(prefix="ddpc-", dir="/tmp"))
        store = self.workdir / "store"
        try:
            self._listen()
            for rank in range(self.world_size):
                self.ranks.append(self._spawn(rank, store))
        except BaseException:
            self.kill()
            raise

    def wait_ready(self) -> None:
        if self.ready:
            return
        try:
            self._await_ready(self._launched_at + self.start_timeout)
        except BaseException:
            self.kill()
            raise
        self.ready = True
        self.started_in = time.monotonic() - self._launched_at

    def _listen(self) -> None:
        """The pool's socket, which every rank connects to: a path inside the pool's private (0700)
        directory, so no other user can reach it, and on Linux only the pool's own rank pids are
        accepted (SO_PEERCRED). Nothing a stranger sends is ever unpickled."""
        assert self.workdir is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._address = str(self.workdir / "pool.sock")
        sock.bind(self._address)
        sock.listen(self.world_size)
        self._listener = sock

    def _accept(self) -> tuple[Connection, int | None] | None:
        """A rank's connection and its rank (from its pid, where the kernel tells), or None for a
        connection that is not one of ours (closed unread)."""
        assert self._listener is not None
        client, _ = self._listener.accept()
        peer_credentials = getattr(socket, "SO_PEERCRED", None)
        if peer_credentials is None:
            return Connection(client.detach()), None  # the 0700 directory is the only gate here
        pid = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, peer_credentials, struct.calcsize("3i")))[0]
        for proc in self.ranks:
            if proc.popen.pid == pid and proc.conn is None:
                return Connection(client.detach()), proc.rank
        client.close()
        return None

    def _environment(self, rank: int, store: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            GROUP_RANK="0",
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            PYTHONUNBUFFERED="1",
            DDP_CONFORMANCE_STORE=str(store),
            DDP_CONFORMANCE_SOCKET=self._address,
            DDP_CONFORMANCE_STACK_FILE=str(self.workdir / f"rank{rank}.stack") if self.workdir else "",
            DDP_CONFORMANCE_BACKEND=self.backend,
            DDP_CONFORMANCE_PARENT=str(os.getpid()),
            DDP_CONFORMANCE_PG_TIMEOUT=str(self.group_timeout),
        )
        env.pop("TORCHELASTIC_RUN_ID", None)  # ranks are ours, not an elastic agent's
        if self.rank_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.rank_threads)
        if self.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env:
            name = loopback_interface()
            if name:
                env["GLOO_SOCKET_IFNAME"] = name
        if self.backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.cuda_devices[: self.world_size])
        return env

    def _spawn(self, rank: int, store: Path) -> RankProcess:
        assert self.workdir is not None
        log_path = self.workdir / f"rank{rank}.log"
        stack_path = self.workdir / f"rank{rank}.stack"
        stack_path.touch()
        log_path.touch()
        env = self._environment(rank, store)
        handle: ProcessHandle
        if self.zygote is not None and self.zygote.alive:
            handle = ForkedRank(self.zygote, self.zygote.fork(env, str(log_path)))
        else:
            with open(log_path, "wb") as log:
                handle = subprocess.Popen(
                    [sys.executable, "-m", "ddp_conformance.rank"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True,  # a rank's own children die with it (killpg)
                )
        sentinel = None
        with contextlib.suppress(AttributeError, OSError):
            sentinel = os.pidfd_open(handle.pid)
        return RankProcess(rank=rank, popen=handle, log_path=log_path, stack_path=stack_path, sentinel=sentinel)

    def _await_ready(self, deadline: float) -> None:
        """Accept each rank's hello on the pool socket, then wait for every rank to join the group."""
        assert self._listener is not None
        by_rank = {proc.rank: proc for proc in self.ranks}
        strangers: list[Connection] = []
        waiting = set(by_rank)
        try:
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stacks = self.dump_stacks(sorted(waiting))
                    lines = [f"rank {r}: no rendezvous within {self.start_timeout:g} s" for r in sorted(waiting)]
                    for rank, stack in stacks.items():
                        lines.append(f"rank {rank} stack:\n{stack}")
                    raise PoolStartError(self._start_failure("\n".join(lines)))
                for rank in sorted(waiting):
                    if not by_rank[rank].alive:
                        detail = by_rank[rank].exit_description()
                        raise PoolStartError(self._start_failure(f"rank {rank} died while starting ({detail})"))
                watch: list[object] = [self._listener, *strangers]
                watch += [by_rank[r].conn for r in waiting if by_rank[r].conn is not None]
                for ready in wait(watch, timeout=min(remaining, 0.1)):
                    if ready is self._listener:
                        accepted = self._accept()
                        if accepted is None:
                            continue
                        conn, known_rank = accepted
                        if known_rank is None:
                            strangers.append(conn)
                        else:
                            by_rank[known_rank].conn = conn
                        continue
                    assert isinstance(ready, Connection)
                    try:
                        message = receive(ready)
                    except (EOFError, OSError):
                        if ready in strangers:
                            strangers.remove(ready)
                        continue  # its exit is picked up on the next pass, with its code
                    if isinstance(message, Hello) and ready in strangers:
                        strangers.remove(ready)
                        if message.rank in by_rank and by_rank[message.rank].conn is None:
                            by_rank[message.rank].conn = ready
                        else:
                            ready.close()
                    elif isinstance(message, Ready):
                        waiting.discard(next(r for r, p in by_rank.items() if p.conn is ready))
        finally:
            self._close_listener(strangers)

    def _close_listener(self, strangers: Sequence[Connection] = ()) -> None:
        for conn in strangers:
            with contextlib.suppress(OSError):
                conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _start_failure(self, headline: str) -> str:
        parts = [f"could not start {self.world_size} {self.backend} ranks: {headline}"]
        for proc in self.ranks:
            out = proc.output_since(0).strip()
            if out:
                tail = "\n".join(out.splitlines()[-30:])
                parts.append(f"--- output of rank {proc.rank} ---\n{tail}")
        return "\n".join(parts)

    # -- run -----------------------------------------------------------------------------------
    def run(self, task: Task, timeout: float) -> PoolRun:
        """Send one task to every rank and collect one answer (or one end) from each."""
        began = time.monotonic()
        deadline = began + timeout
        run = PoolRun()
        payload = encode(task)  # once for all ranks
        for proc in self.ranks:
            proc.log_offset = proc.log_size()
        for proc in self.ranks:
            with contextlib.suppress(OSError):  # a dead rank's end is collected below
                self._channel(proc).send_bytes(payload)
        pending = {proc.rank: proc for proc in self.ranks}
        watch = _Watch(pending.values())
        first_failure: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE_SECONDS)
            if now >= limit:
                run.timed_out = now >= deadline
                self._collect_stuck(run, pending, timeout, first_failure is not None)
                break
            readable, ended = watch.wait(min(limit - now, 0.2))
            for rank, proc in list(pending.items()):
                if rank in readable:
                    try:
                        reply = receive(self._channel(proc))
                    except (EOFError, OSError):
                        reply = None
                    if isinstance(reply, RankReply):
                        run.replies[rank] = reply
                        run.arrival.append(rank)
                        del pending[rank]
                        watch.forget(proc)
                        if reply.outcome == "failed" and first_failure is None:
                            first_failure = time.monotonic()
                        continue
                if rank in ended or ((proc.sentinel is None or rank in readable) and not proc.alive):
                    proc.popen.wait()
                    run.ends[rank] = RankEnd(rank, "crashed", proc.exit_description())
                    run.arrival.append(rank)
                    del pending[rank]
                    watch.forget(proc)
                    if first_failure is None:
                        first_failure = time.monotonic()
        watch.close()
        run.duration = time.monotonic() - began
        for proc in self.ranks:
            run.output[proc.rank] = proc.output_since(proc.log_offset)
        return run

    @staticmethod
    def _channel(proc: RankProcess) -> Connection:
        assert proc.conn is not None, "a ready rank always has its channel"
        return proc.conn

    def _collect_stuck(self, run: PoolRun, pending: dict[int, RankProcess], timeout: float,
                       after_failure: bool) -> None:
        stacks = self.dump_stacks(list(pending))
        for rank, proc in pending.items():
            if not proc.alive:
                run.ends[rank] = RankEnd(rank, "crashed", proc.exit_description())
                continue
            if after_failure:
                detail = f"no answer {FAILURE_GRACE_SECONDS:g} s after another rank failed (stuck)"
            else:
                detail = f"timed out after {timeout:g} s"
            run.ends[rank] = RankEnd(rank, "hung", detail, stacks.get(rank, ""))

    def dead_ranks(self) -> list[str]:
        """Ranks that died since their last answer (a thread a test left behind, an OOM kill...).
        Asked before every test, so the ranks' pidfds are polled at once, without a round trip to
        the zygote per rank."""
        if all(proc.sentinel is not None for proc in self.ranks):
            watch = _Watch(self.ranks, channels=False)
            _, ended = watch.wait(0)
            watch.close()
            for proc in self.ranks:
                if proc.rank in ended:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.popen.wait(timeout=1)  # exited: let the zygote reap it and say how
            return [f"rank {proc.rank} ({proc.exit_description()})" for proc in self.ranks if proc.rank in ended]
        return [f"rank {proc.rank} ({proc.exit_description()})" for proc in self.ranks if not proc.alive]

    def dump_stacks(self, ranks: list[int], settle: float = 0.5) -> dict[int, str]:
        """Ask live ranks for their Python stacks (faulthandler, registered on a signal in each rank)."""
        asked = []
        for proc in self.ranks:
            if proc.rank in ranks and proc.alive:
                with contextlib.suppress(OSError):
                    proc.stack_path.write_bytes(b"")
                    os.kill(proc.popen.pid, STACK_DUMP_SIGNAL)
                    asked.append(proc)
        stacks: dict[int, str] = {}
        end = time.monotonic() + settle
        while asked and time.monotonic() < end:
            time.sleep(0.05)
            if all(p.stack_path.stat().st_size > 0 for p in asked):
                time.sleep(0.05)  # let the dump finish writing
                break
        for proc in asked:
            text = proc.stack_path.read_text("utf-8", "replace").strip()
            stacks[proc.rank] = text or "(no stack: the rank did not answer the dump signal)"
        return stacks

    # -- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Healthy pool: ranks leave the group themselves (bounded), then anything left is killed."""
        for proc in self.ranks:
            with contextlib.suppress(OSError, AssertionError):
                send(self._channel(proc), Stop())
        end = time.monotonic() + STOP_GRACE_SECONDS
        for proc in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(end - time.monotonic(), 0.01))
        self.kill()

    def kill(self) -> None:
        """Kill every rank (and its children) without asking a possibly hung group anything."""
        for proc in self.ranks:
            # the whole process group, even when the rank itself is gone: its children (DataLoader
            # workers, anything a test started) must not outlive it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            if proc.alive:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.kill()
        for proc in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
            if proc.conn is not None:
                with contextlib.suppress(OSError):
                    proc.conn.close()
            if proc.sentinel is not None:
                with contextlib.suppress(OSError):
                    os.close(proc.sentinel)
                proc.sentinel = None
            proc.close_log()
        self.ranks = []
        self._close_listener()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
