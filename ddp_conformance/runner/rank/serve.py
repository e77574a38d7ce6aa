"""A rank process's main (pytest-xdist's `remote.py`): join the group once, then serve test after test.

A rank is either exec'd (`python -m ddp_conformance.runner.rank.serve`) or forked by the fork server
(the fork server), which has torch
imported already; both end up in `serve()`, configured entirely by the environment the pool set.
Everything that can make a rank outlive pytest is settled first: the parent-death signal, and a check
that the parent did not die before it was set.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

from ..wire import Hello, Ready, Stop, receive, send
from . import fault_handlers
from .ddp_context import context_from_env

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies, even by SIGKILL (Linux). Elsewhere the supervisor's
    kill on every exit path is all there is."""
    expected = int(os.environ.get("DDP_CONFORMANCE_PARENT", "0"))
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if expected and os.getppid() != expected:
        os._exit(70)  # the parent is already gone: the signal above came too late to fire


def connect(address: str) -> Connection:
    """One duplex channel to the pool: a Unix socket in the pool's private directory."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return Connection(sock.detach())


def join_group() -> None:
    import torch  # deferred: torch is heavy to import, and a rank says hello before it pays for it
    import torch.distributed as dist

    backend = os.environ["DDP_CONFORMANCE_BACKEND"]
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    device = torch.device(context_from_env().device_name)
    if device.type == "cuda":  # the rank's own GPU, or its share of one under gloo (`rank_device`)
        torch.cuda.set_device(device)
    store = dist.FileStore(os.environ["DDP_CONFORMANCE_STORE"], world_size)
    timeout = timedelta(seconds=float(os.environ.get("DDP_CONFORMANCE_PG_TIMEOUT", "120")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def serve() -> int:
    """Say hello, join the group, then answer tasks until told to stop or the pool goes away."""
    fault_handlers.arm(os.environ["DDP_CONFORMANCE_STACK_FILE"])
    channel = connect(os.environ["DDP_CONFORMANCE_SOCKET"])
    send(channel, Hello(rank=int(os.environ["RANK"]), pid=os.getpid()))
    join_group()
    # deferred: the task runner brings pytest; a rank that exec'd says hello and joins first
    from .seeds import fresh_seeds
    from .task_runner import leave_group, quiet_harness_warnings, run_task

    fresh_seeds()  # forked ranks share the fork server's RNG state: each starts from its own, as under torchrun
    quiet_harness_warnings()
    send(channel, Ready(pid=os.getpid()))
    while True:
        try:
            message = receive(channel)
        except (EOFError, OSError):
            return 0  # the pool closed the channel: nothing more to do
        if isinstance(message, Stop):
            leave_group()
            return 0
        send(channel, run_task(message))
        fault_handlers.rearm()  # whatever the test did to them; after the reply, off the test's clock


def main() -> int:
    die_with_parent()
    return serve()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as a forked rank ends: no teardown of torch's modules (seconds) while the pool waits
