"""guarded_fit watches every rank's progress: a fit that computes is no hang, a blocked one is, and a fit that
raises drops what the rank kept."""

from __future__ import annotations

import pytest

from ddp_conformance.checks.support.progress import Progress, stall_verdict


def _context(ddp, tmp_path, stall_after: float):
    from ddp_conformance.adapter import RankContext
    from ddp_conformance.checks.support.check_context import CheckContext
    from ddp_conformance.config import RunConfig

    return CheckContext(check_id="watchdog", spec="torch", factory=lambda: None, config=RunConfig(),
                        rank_ctx=RankContext.from_fixture(ddp, tmp_path), ddp=ddp, workdir=tmp_path,
                        stall_after=stall_after, figures=ddp.figures)


def _compute(seconds: float) -> None:
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        sum(range(1000))


def _train_one_step() -> None:
    """A fit's minimum: one training forward, backward and optimizer step (the recorder reads the
    fit's state from them)."""
    import torch

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()


@pytest.mark.ddp(world_size=2)
def test_a_fit_that_computes_without_events_is_not_taken_for_a_hang(ddp, tmp_path):
    """A first import or compile on a loaded machine reaches no hook for longer than the watchdog's
    4 x stall_after (here 3.2 s); its CPU time shows it is alive. (A stall_after much below 1 s
    would be unfair: a watcher thread that shares the GIL with a busy fit can wait ~0.6 s.)"""
    from ddp_conformance.checks.support.progress import guarded_fit

    ctx = _context(ddp, tmp_path, stall_after=0.8)
    _, progress = guarded_fit(ctx, "computes", 1, lambda observer: (_compute(4.0), _train_one_step()))
    assert [p.state for p in progress] == ["done", "done"]


@pytest.mark.ddp(world_size=2)
def test_a_rank_blocked_while_another_is_done_is_a_hang(ddp, tmp_path):
    """Rank 0 blocked (no CPU, no event) while rank 1 has finished: a hang after ~stall_after."""
    import time

    from ddp_conformance.checks.support.check_context import CheckFailed
    from ddp_conformance.checks.support.progress import guarded_fit

    ctx = _context(ddp, tmp_path, stall_after=1.0)
    _train_one_step()  # a rank's first optimizer imports torch._dynamo (~2 s of CPU): not the watcher's
    began, cpu = time.monotonic(), time.process_time()
    with pytest.raises(CheckFailed, match=r"training hangs: rank 1 stopped .* while rank 0 waits"):
        guarded_fit(ctx, "blocked", 1, lambda observer: (ddp.rank == 0 and time.sleep(20), _train_one_step()))
    took = time.monotonic() - began
    assert took < 10 and ddp.figures["hung"] is True
    # the finished rank's watcher waits between polls: a spinning one would itself look like a computing rank
    assert time.process_time() - cpu < 0.3 * took, (time.process_time() - cpu, took)


@pytest.fixture
def overloaded_core():
    """One core of this machine, with three busy-looping processes pinned to it: a thread pinned
    there gets about a quarter of it, as a computing rank does on a loaded 2-core CI runner."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity") or not os.path.exists(f"/proc/{os.getpid()}/task"):
        pytest.skip("needs Linux: CPU affinity and /proc")
    core = min(os.sched_getaffinity(0))
    hog = (f"import os\nos.sched_setaffinity(0, {{{core}}})\nprint('pinned', flush=True)\n"
           f"while os.getppid() == {os.getpid()}:\n    sum(range(100000))\n")  # ends with its pytest
    hogs = [subprocess.Popen([sys.executable, "-c", hog], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    for process in hogs:
        assert process.stdout is not None and process.stdout.readline() == "pinned\n"
    try:
        yield core
    finally:
        for process in hogs:
            process.kill()
            process.wait()


def _beat_over(seconds: float, work) -> tuple[bool, float]:
    """Whether RunnableBeat calls this process busy while a thread does `work`, after `seconds` of
    watching as a rank's watcher does (a poll every 20 ms from the main thread); and the CPU share
    the worker got."""
    import os
    import threading
    import time

    from ddp_conformance.checks.support.progress import POLL_SECONDS, Progress, RunnableBeat

    stop = threading.Event()
    cpu: list[float] = []

    def worker() -> None:
        began = time.thread_time()
        work(stop)
        cpu.append(time.thread_time() - began)

    thread = threading.Thread(target=worker)
    thread.start()
    beat, me = RunnableBeat(), [Progress(rank=0, fit_thread=thread.native_id or 0)]
    began = time.monotonic()
    busy = False
    while time.monotonic() - began < seconds:
        busy = beat.busy(me, time.monotonic()) or busy
        time.sleep(POLL_SECONDS)
    stop.set()
    thread.join()
    assert os.getpid() == me[0].pid
    return busy, cpu[0] / (time.monotonic() - began)


def test_a_thread_computing_on_an_overloaded_core_is_busy_and_a_blocked_one_is_not(overloaded_core):
    import os

    def compute(stop) -> None:
        os.sched_setaffinity(0, {overloaded_core})  # this thread only
        while not stop.is_set():
            sum(range(1000))

    busy, share = _beat_over(1.5, compute)
    # a quarter of a core: the process's CPU time alone would not reach the fallback's share
    from ddp_conformance.checks.support.progress import BUSY_CPU_FRACTION

    assert share < BUSY_CPU_FRACTION, f"the core was not loaded ({share:.2f} of it went to the thread)"
    assert busy

    def wake(stop) -> None:  # blocked, waking 100 times a second as gloo's event loop does
        os.sched_setaffinity(0, {overloaded_core})
        while not stop.wait(0.01):
            pass

    def wakers(stop) -> None:  # five of them (gloo's, an xdist worker's execnet thread...)
        import threading

        others = [threading.Thread(target=wake, args=(stop,)) for _ in range(4)]
        for thread in others:
            thread.start()
        wake(stop)
        for thread in others:
            thread.join()

    busy, _ = _beat_over(1.5, wakers)
    assert not busy


def test_a_rank_waiting_for_a_compiler_it_started_computes():
    """A cold torch.compile on a CPU runs g++ (which runs cc1plus) while the rank's thread waits: on a loaded
    2-core machine that read as 8 s without progress, a hang. Here a child waits on a grandchild that computes."""
    import os
    import signal
    import subprocess
    import sys

    spin = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"

    def compile_in_a_child(stop) -> None:
        driver = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
        try:
            stop.wait()
        finally:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()

    busy, _ = _beat_over(1.5, compile_in_a_child)
    assert busy
    # the same child of another thread of the rank says nothing of its fit
    import threading

    stop = threading.Event()
    elsewhere = threading.Thread(target=compile_in_a_child, args=(stop,))
    elsewhere.start()
    try:
        busy, _ = _beat_over(1.5, lambda stop: stop.wait())
    finally:
        stop.set()
        elsewhere.join()
    assert not busy


def test_a_rank_computes_when_one_thread_is_runnable_not_when_many_wake_briefly(monkeypatch):
    """Judged per thread: five wakers that each waited 12% of a window (a loaded machine) summed to
    60%, and a blocked rank read as computing in CI; one thread runnable 90% of it is computing."""
    from ddp_conformance.checks.support.progress import BUSY_WINDOW, Progress, RunnableBeat

    def beat_over(per_thread: list[float]) -> bool:
        counters = [{str(tid): 0.0 for tid in range(len(per_thread))},
                    {str(tid): share * BUSY_WINDOW for tid, share in enumerate(per_thread)}]
        monkeypatch.setattr(RunnableBeat, "_counters", lambda self, pid, watcher, fit_thread: counters.pop(0))
        beat, rank = RunnableBeat(), [Progress(rank=0)]
        return beat.busy(rank, 0.0) or beat.busy(rank, BUSY_WINDOW)

    assert not beat_over([0.12] * 5)
    assert beat_over([0.9, 0.01, 0.01])


@pytest.mark.ddp(world_size=2)
def test_a_rank_whose_fit_ended_while_another_s_raised_stops_with_it(ddp, tmp_path):
    """Rank 1's fit raises after the fit's last collective (its own code at the end of the fit) while
    rank 0's ends: rank 0 must not go on to the check's next collective alone, where it would wait for
    rank 1 until the test's timeout. It raises too, naming rank 1's error."""
    import time

    import torch.distributed as dist

    from ddp_conformance.checks.support.progress import PeerFitFailed, guarded_fit

    def fit(observer):
        _train_one_step()
        if ddp.rank == 1:
            raise ValueError("the trainer's own error at the end of its fit")

    ctx = _context(ddp, tmp_path, stall_after=5.0)
    began = time.monotonic()
    expected = ValueError if ddp.rank == 1 else PeerFitFailed
    with pytest.raises(expected) as raised:
        guarded_fit(ctx, "ends-apart", 1, fit)
    assert time.monotonic() - began < 5.0  # at once, not after a stall
    if ddp.rank == 0:
        assert raised.value.rank == 1
        assert "ValueError: the trainer's own error at the end of its fit" in str(raised.value)
    dist.barrier()  # both ranks are here: nothing is left waiting


def _held() -> bool:
    """Whether this rank still holds the kept evidence the tests below put there (collective)."""
    from ddp_conformance.checks.support import session_evidence

    return session_evidence.kept_or_run(("guarded-fit-evidence",), lambda: "fresh")[1]


@pytest.mark.ddp(world_size=2)
def test_a_fit_that_ends_normally_keeps_the_kept_evidence(ddp, tmp_path):
    from ddp_conformance.checks.support import session_evidence
    from ddp_conformance.checks.support.progress import guarded_fit

    _held()
    guarded_fit(_context(ddp, tmp_path, stall_after=2.0), "fine", 1, lambda observer: _train_one_step())
    assert _held()
    session_evidence.forget()


@pytest.mark.ddp(world_size=2)
def test_a_fit_that_raises_drops_the_kept_evidence(ddp, tmp_path):
    """A fit that raised may leave a half-built trainer, RNG or files behind: the next fit starts afresh."""
    from ddp_conformance.checks.support import session_evidence
    from ddp_conformance.checks.support.progress import guarded_fit

    def fails(observer):
        raise ValueError("the trainer's own error")

    _held()
    with pytest.raises(ValueError):
        guarded_fit(_context(ddp, tmp_path, stall_after=2.0), "raises", 1, fails)
    assert not _held()
    session_evidence.forget()


def test_a_fit_that_ends_between_two_polls_has_its_end_written_before_the_watch_returns(tmp_path):
    """The other ranks learn how this rank's fit ended from its file alone (nonfinite_loss waits there for
    every rank's error): a fit that ends between the watcher's write and its question whether the fit still
    runs must still have its end written. Here the fit ends exactly when asked."""
    from types import SimpleNamespace

    from ddp_conformance.checks.support.progress import ProgressObserver, _watch, read_all

    observer = ProgressObserver(tmp_path / "rank0.json", 0)

    class EndsWhenAsked:
        def join(self, timeout: float) -> None:
            pass

        def is_alive(self) -> bool:
            if not observer.progress.stopped:
                observer.end(FloatingPointError("non-finite loss on some rank: stopping every rank"))
            return False

    _watch(SimpleNamespace(world_size=1, stall_after=5.0), observer, EndsWhenAsked(), 1)
    written = read_all(tmp_path, 1)[0]
    assert written is not None and written.state == "error" and "FloatingPointError" in written.error


def step(epoch: int, position: int, global_step: int) -> dict:
    return {"rank": 0, "epoch": epoch, "global_step": global_step, "position": position, "batch_size": 4,
            "optimizer_step": True, "loss": None}


def test_a_rank_that_returned_early_is_named_with_its_step_and_the_waiting_rank():
    progress = [Progress(rank=0, state="in_step", begun=4, finished=3, last=step(0, 3, 3)),
                Progress(rank=1, state="done", begun=3, finished=3, last=step(0, 2, 2))]
    text = stall_verdict(progress, 3.0, steps=4)
    assert text.startswith("training hangs: rank 1 stopped at micro-batch 3 of a 4-step fit")
    assert "rank 0 waits inside micro-batch 3 (epoch 0, batch 3, optimizer step 3)" in text
    assert "left its training loop early" in text


def test_a_rank_that_failed_is_named_with_its_error_and_only_the_waiting_ranks_hang():
    progress = [Progress(rank=0, state="in_step", begun=1, finished=0, last=step(0, 0, 0)),
                Progress(rank=1, state="error", begun=1, finished=0, error="ValueError: boom"),
                Progress(rank=2, state="in_step", begun=1, finished=0, last=step(0, 0, 0))]
    text = stall_verdict(progress, 3.0, steps=4)
    assert text.startswith("rank 1 failed with ValueError: boom after 0 micro-batch(es) of a 4-step fit; "
                           "ranks 0, 2 hang waiting for it (rank 0 waits")
    assert "training hangs" not in text and "rank 1 stopped" not in text
    assert "rank 2 waits" in text and "a rank that failed" in text


def test_without_a_stopped_rank_the_rank_behind_is_named():
    progress = [Progress(rank=0, state="in_step", begun=5, finished=4, last=step(0, 4, 4)),
                Progress(rank=1, state="between", begun=3, finished=3, last=step(0, 2, 2))]
    text = stall_verdict(progress, 12.0, steps=8)
    assert text.startswith("training hangs: rank 1 stopped at micro-batch 3") and "fell behind" in text


def test_all_ranks_stuck_alike_is_a_deadlock():
    progress = [Progress(rank=r, state="in_step", begun=2, finished=1, last=step(0, 1, 1)) for r in range(2)]
    assert "collective deadlock" in stall_verdict(progress, 12.0, steps=4)
