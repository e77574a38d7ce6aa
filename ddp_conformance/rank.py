"""The worker side: a rank process that joins the group once and then runs test after test.

Started by `supervisor.RankPool` as `python -m ddp_conformance.rank TASK_FD RESULT_FD STACK_FILE`.
Everything that can make a rank outlive pytest is settled here first: the parent-death signal, and a
check that the parent did not die before it was set.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this rank when pytest dies, even by SIGKILL (Linux). Elsewhere the supervisor's kill
    on every exit path is all there is."""
    expected = int(os.environ.get("DDP_CONFORMANCE_PARENT", "0"))
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if expected and os.getppid() != expected:
        os._exit(70)  # the parent is already gone: the signal above came too late to fire


def join_group() -> None:
    import torch
    import torch.distributed as dist

    backend = os.environ["DDP_CONFORMANCE_BACKEND"]
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store = dist.FileStore(os.environ["DDP_CONFORMANCE_STORE"], world_size)
    timeout = timedelta(seconds=float(os.environ.get("DDP_CONFORMANCE_PG_TIMEOUT", "120")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def main(argv: list[str]) -> int:
    die_with_parent()
    task_fd, result_fd, stack_file = int(argv[0]), int(argv[1]), argv[2]
    faulthandler.enable(file=sys.stderr, all_threads=True)
    stacks = open(stack_file, "w")  # noqa: SIM115 - kept open for the life of the rank
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    tasks = Connection(task_fd, readable=True, writable=False)
    results = Connection(result_fd, readable=False, writable=True)

    join_group()
    from . import runtime
    from .messages import Ready, Stop, receive, send

    send(results, Ready(pid=os.getpid()))
    while True:
        try:
            message = receive(tasks)
        except (EOFError, OSError):
            return 0  # the parent closed the pipe: nothing more to do
        if isinstance(message, Stop):
            runtime.leave_group()
            return 0
        send(results, runtime.run_task(message))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
