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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

from ..wire import (
    FAILED,
    STACK_DUMP_SIGNAL,
    STATUS_FILE_ENV,
    PoolRun,
    RankEnd,
    RankReply,
    Stop,
    Task,
    encode,
    receive,
    send,
)
from .fork_server import ForkServer
from .handshake import DiedWhileStarting, Handshake, StartTimeout
from .process import ProcessHandle, RankProcess, catches_signal

# After one rank has failed, how long the others get to answer before they count as stuck (typically
# blocked in a collective the failed rank will never join). Long enough for a slow rank to finish its
# own failure, short enough that a one-sided assert does not hold the session for the whole timeout.
FAILURE_GRACE_SECONDS = 5.0
COLLECTIVES_RECORDED = 1000  # per rank process, all its groups together: the last few steps of a large model's
STOP_GRACE_SECONDS = 5.0
UNCAUGHT_DUMP_SIGNAL = (f"(no stack: the rank had no handler for {STACK_DUMP_SIGNAL.name}, the stack-dump signal, "
                        "and was not sent it; a test can remove it, as Lightning's Trainer does at the end of every "
                        "fit)")


class PoolStartError(Exception):
    """The ranks did not all come up; the message says which and why."""


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


class RankDevices(NamedTuple):
    """Where a pool's ranks run: the device type (None: cuda under nccl, else cpu), the GPUs they may see, and
    the CPU threads each may use (None: torch's own default)."""

    device: str | None = None
    cuda_devices: tuple[str, ...] = ()
    rank_threads: int | None = None


#: a pool's devices unless told: by its backend, with torch's own thread count
ANY_DEVICES = RankDevices()


class RankPool:
    """The warm ranks of one (world size, backend): started once, fed test after test."""

    def __init__(
        self,
        world_size: int,
        backend: str,
        *,
        start_timeout: float,
        devices: RankDevices = ANY_DEVICES,
        fork_server: ForkServer | None = None,
        group_timeout: float | None = None,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.device = devices.device or ("cuda" if backend == "nccl" else "cpu")
        self.start_timeout = start_timeout
        self.rank_threads = devices.rank_threads
        self.cuda_devices = devices.cuda_devices
        self.ranks: list[RankProcess] = []
        self.workdir: Path | None = None
        self.fork_server = fork_server
        # collectives must not give up before the test's own wall-clock limit: the supervisor, not
        # the group, decides when a test has hung
        self.group_timeout = max(group_timeout or 0.0, start_timeout, 30.0)
        self.ready = False
        self._launched_at = 0.0
        self._handshake: Handshake | None = None

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Spawn the ranks and return at once: they import torch and meet while pytest goes on. The
        start timeout counts from when the last rank exists: a fork first waits for the fork server's
        import of torch, which has a limit of its own and must not eat into the ranks'."""
        self.workdir = Path(tempfile.mkdtemp(prefix=f"ddp-conformance-ws{self.world_size}-"))
        if len(str(self.workdir / "pool.sock")) > 100 and os.path.isdir("/tmp"):  # AF_UNIX path limit
            os.rmdir(self.workdir)
            self.workdir = Path(tempfile.mkdtemp(prefix="ddpc-", dir="/tmp"))
        store = self.workdir / "store"
        try:
            self._handshake = Handshake(self.workdir, backlog=self.world_size)
            for rank in range(self.world_size):
                self.ranks.append(self._spawn(rank, store))
            self._launched_at = time.monotonic()
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

    def _await_ready(self, deadline: float) -> None:
        """Every rank's hello, then its word that it joined the group; a start failure names why."""
        assert self._handshake is not None
        try:
            self._handshake.await_ready(self.ranks, deadline)
        except StartTimeout as late:
            stacks = self.dump_stacks(late.waiting)
            lines = [f"rank {r}: no rendezvous within {self.start_timeout:g} s" for r in late.waiting]
            for rank, stack in stacks.items():
                lines.append(f"rank {rank} stack:\n{stack}")
            raise PoolStartError(self._start_failure("\n".join(lines))) from None
        except DiedWhileStarting as died:
            detail = died.proc.exit_description()
            raise PoolStartError(self._start_failure(f"rank {died.proc.rank} died while starting ({detail})")) from None
        finally:
            self._handshake = None

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
            DDP_CONFORMANCE_SOCKET=self._handshake.address if self._handshake else "",
            DDP_CONFORMANCE_STACK_FILE=str(self.workdir / f"rank{rank}.stack") if self.workdir else "",
            DDP_CONFORMANCE_BACKEND=self.backend,
            DDP_CONFORMANCE_DEVICE=self.device,
            DDP_CONFORMANCE_PARENT=str(os.getpid()),
            DDP_CONFORMANCE_PG_TIMEOUT=str(self.group_timeout),
        )
        env.pop("TORCHELASTIC_RUN_ID", None)  # ranks are ours, not an elastic agent's
        env[STATUS_FILE_ENV] = str(self.status_path) if rank == 0 and self.status_path else ""  # rank 0 speaks
        # torch's flight recorder: each process group's recent collectives, with the Python stack that called
        # them, which a hung test's ranks dump to say where each waits (gloo too, torch >= 2.7); a user's own wins
        env.setdefault("TORCH_FR_BUFFER_SIZE", str(COLLECTIVES_RECORDED))
        if self.rank_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.rank_threads)
        if self.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env:
            name = loopback_interface()
            if name:
                env["GLOO_SOCKET_IFNAME"] = name
        if self.device == "cuda":  # nccl: one GPU per rank; gloo: the ranks share every GPU of the share
            count = self.world_size if self.backend == "nccl" else len(self.cuda_devices)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.cuda_devices[:count])
        return env

    def _spawn(self, rank: int, store: Path) -> RankProcess:
        assert self.workdir is not None
        log_path = self.workdir / f"rank{rank}.log"
        stack_path = self.workdir / f"rank{rank}.stack"
        stack_path.touch()
        log_path.touch()
        env = self._environment(rank, store)
        handle: ProcessHandle
        if self.fork_server is not None and self.fork_server.alive:
            handle = self.fork_server.fork(env, str(log_path))
        else:
            with open(log_path, "wb") as log:
                handle = subprocess.Popen(
                    [sys.executable, "-m", "ddp_conformance.runner.rank.serve"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True,  # a rank's own children die with it (killpg)
                )
        sentinel = None
        with contextlib.suppress(AttributeError, OSError):
            sentinel = os.pidfd_open(handle.pid)
        return RankProcess(rank=rank, popen=handle, log_path=log_path, stack_path=stack_path, sentinel=sentinel)

    def _start_failure(self, headline: str) -> str:
        parts = [f"could not start {self.world_size} {self.backend} ranks: {headline}"]
        for proc in self.ranks:
            out = proc.output_since(0).strip()
            if out:
                tail = "\n".join(out.splitlines()[-30:])
                parts.append(f"--- output of rank {proc.rank} ---\n{tail}")
        return "\n".join(parts)

    # -- run -----------------------------------------------------------------------------------
    @property
    def status_path(self) -> Path | None:
        """Where rank 0 says what its test is doing (`DdpContext.status`); gone with the pool's directory."""
        return self.workdir / "status" if self.workdir else None

    def run(self, task: Task, timeout: float, waiting: Callable[[], None] | None = None) -> PoolRun:
        """Send one task to every rank and collect one answer (or one end) from each; `waiting()` is
        called at every wake-up while they run (at least 5 times a second)."""
        deadline = time.monotonic() + timeout
        run = PoolRun()
        payload = encode(task)  # once for all ranks
        if self.status_path is not None:
            self.status_path.unlink(missing_ok=True)  # the previous test's last words
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
            if waiting is not None:
                waiting()
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
                        if reply.outcome == FAILED and first_failure is None:
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
        for proc in self.ranks:
            run.output[proc.rank] = proc.output_since(proc.log_offset)
        if self.fork_server is not None and not self.fork_server.warming and any(r.warm for r in run.replies.values()):
            self.fork_server.warm_up()
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
        the fork server per rank."""
        if all(proc.sentinel is not None for proc in self.ranks):
            watch = _Watch(self.ranks, channels=False)
            _, ended = watch.wait(0)
            watch.close()
            for proc in self.ranks:
                if proc.rank in ended:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.popen.wait(timeout=5)  # exited: let the fork server (maybe mid-import) say how
            return [f"rank {proc.rank} ({proc.exit_description()})" for proc in self.ranks if proc.rank in ended]
        return [f"rank {proc.rank} ({proc.exit_description()})" for proc in self.ranks if not proc.alive]

    def dump_stacks(self, ranks: list[int], settle: float = 0.5) -> dict[int, str]:
        """Ask live ranks for their Python stacks (faulthandler, registered on a signal in each rank)."""
        asked = []
        stacks: dict[int, str] = {}
        for proc in self.ranks:
            if proc.rank in ranks and proc.alive:
                if not catches_signal(proc.popen.pid, STACK_DUMP_SIGNAL):  # the signal would kill it: ask nothing
                    stacks[proc.rank] = UNCAUGHT_DUMP_SIGNAL
                    continue
                with contextlib.suppress(OSError):
                    proc.stack_path.write_bytes(b"")
                    os.kill(proc.popen.pid, STACK_DUMP_SIGNAL)
                    asked.append(proc)
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
        try:
            for proc in self.ranks:
                with contextlib.suppress(OSError, AssertionError):
                    send(self._channel(proc), Stop())
            end = time.monotonic() + STOP_GRACE_SECONDS
            for proc in self.ranks:
                proc.ended_within(end - time.monotonic())
        finally:
            self.kill()  # also when the wait above is interrupted: the ranks and the directory go

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
            proc.ended_within(10)
            if proc.conn is not None:
                with contextlib.suppress(OSError):
                    proc.conn.close()
            if proc.sentinel is not None:
                with contextlib.suppress(OSError):
                    os.close(proc.sentinel)
                proc.sentinel = None
            proc.close_log()
        self.ranks = []
        if self._handshake is not None:
            self._handshake.close()
            self._handshake = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
