"""FitRecorder sees what a hand-written DDP loop really does, with no call in the loop."""

from __future__ import annotations

import pytest

from ddp_conformance.checks.support.fit_watch import FitPlan


@pytest.mark.ddp(world_size=2)
def test_recorder_sees_ddp_micro_batches_steps_and_the_indices_drawn(ddp):
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

    from ddp_conformance.checks.support.observe import FitRecorder

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(10, 3), torch.randn(10, 1))
    sampler = DistributedSampler(data, num_replicas=2, rank=ddp.rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    model = DistributedDataParallel(nn.Linear(3, 1), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder() as recorder:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for position, (x, y) in enumerate(loader):
                sync = position % 2 == 1
                context = model.no_sync() if not sync else torch.enable_grad()
                with context:
                    nn.functional.mse_loss(model(x), y).backward()
                if sync:
                    optimizer.step()
                    optimizer.zero_grad()
        with torch.no_grad():  # an evaluation pass: not the training loader's
            for x, _ in loader:
                model(x)
    record = recorder.record
    assert record.ddp["gradient_as_bucket_view"] is True and record.ddp["static_graph"] is False
    assert record.micro_batches == 6 and record.synced == [False, True, False] * 2
    assert record.optimizer_steps == 2
    assert [p.trained for p in record.passes] == [True, True, False]
    expected = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        expected.append([order[i:i + 2] for i in range(0, len(order), 2)])
    assert [p.batches for p in record.training_passes()] == expected
    assert record.passes[0].length == 3 and record.passes[0].dataset_size == 10
    assert record.passes[0].shuffle is True and record.passes[0].indexed
    # everything is put back: the next fit (or the user's code) runs unhooked
    assert "__iter__" in DataLoader.__dict__ and DataLoader.__iter__.__qualname__ == "DataLoader.__iter__"
    assert BatchSampler.__iter__.__qualname__ == "BatchSampler.__iter__"
    from torch.nn.modules import module

    assert not module._global_forward_pre_hooks


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


def test_a_first_step_one_process_cannot_redo_is_not_judged_and_says_why():
    import torch

    from ddp_conformance.checks.gradient_equivalence.fit_step import _unjudgeable
    from ddp_conformance.checks.support.fit_record import FirstStep, FitRecord, LoaderPass

    def record(model=None, rng_drawn=False, grads=True, indexed=True, overflowed=0):
        model = model or torch.nn.Linear(2, 2)
        step = FirstStep([p.detach() for p in model.parameters()], [torch.zeros(1)] if grads else None, 1, rng_drawn,
                         overflowed)
        loader = LoaderPass(length=4, dataset_size=8, sampler="DistributedSampler", shuffle=True, batches=[[0, 1]],
                            indexed=indexed, trained=True)
        return FitRecord(model=model, first_step=step, passes=[loader])

    assert _unjudgeable(record()) == ""
    assert "no optimizer step" in _unjudgeable(FitRecord())
    assert "no optimizer step" in _unjudgeable(record(grads=False))
    assert "drew random numbers during it (dropout" in _unjudgeable(record(rng_drawn=True))
    assert "a GradScaler skipped the fit's first 2 optimizer step(s)" in _unjudgeable(record(overflowed=2))
    batchnorm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert "BatchNorm in training mode" in _unjudgeable(record(model=batchnorm))
    assert _unjudgeable(record(model=batchnorm.eval())) == ""
    assert "no dataset indices through a BatchSampler" in _unjudgeable(record(indexed=False))


def test_the_recorder_keeps_what_optimizers_step_outside_the_model_and_what_each_batch_fed():
    import torch
    from torch.utils.data import DataLoader, Sampler

    from ddp_conformance.checks.support.digests import input_digest
    from ddp_conformance.checks.support.model_state import OUTSIDE, trained
    from ddp_conformance.checks.support.observe import FitRecorder

    class Pairs(Sampler):  # a hand-written batch sampler of keys, not indices: nothing to read by index
        def __iter__(self):
            return iter([["a", "b"], ["c", "d"], ["e", "f"]])

        def __len__(self):
            return 3

    rows = torch.arange(12.0).reshape(6, 2)
    loader = DataLoader({key: (rows[n],) for n, key in enumerate("abcdef")}, batch_sampler=Pairs())
    model, temperature = torch.nn.Linear(2, 1), torch.nn.Parameter(torch.ones(()))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)  # stepped by no optimizer: not compared
    optimizer = torch.optim.SGD([*model.parameters(), temperature, frozen], lr=0.1)
    with FitRecorder() as recorder:
        for (x,) in loader:
            (model(x).sum() * temperature).backward()
            optimizer.step()
    record = recorder.record
    outside = record.stepped_outside_model()
    name = "optimizer param_groups[0][2], a scalar"
    assert list(outside) == [name] and outside[name].data_ptr() == temperature.data_ptr()  # the live tensor
    assert sorted(trained(model.state_dict(), record, outside=[name])) == ["bias", OUTSIDE + name, "weight"]
    start, now = record.outside_digests()[name]  # before the first step, and after the last
    assert start == input_digest(torch.ones(())) and now == input_digest(temperature.detach()) != start
    [fed] = record.training_passes()
    assert fed.sampler == "Pairs" and fed.shuffle is None and not fed.indexed
    assert len(fed.inputs) == 3 and len(set(fed.inputs)) == 3 and fed.first_input == fed.inputs[0]


def test_a_hand_written_batch_sampler_of_indices_is_recorded_and_its_class_restored():
    """A length-bucketing sampler is a `Sampler` yielding lists of indices, no BatchSampler: its
    class's __iter__ is wrapped for the fit, and only the outermost of nested batch samplers records."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler, TensorDataset

    from ddp_conformance.checks.support.observe import FitRecorder

    class Buckets(Sampler):  # regroups a BatchSampler's batches, as bucketing samplers do
        def __init__(self):
            self.inner = BatchSampler(SequentialSampler(range(6)), batch_size=2, drop_last=False)

        def __iter__(self):
            flat = [i for batch in self.inner for i in batch]
            yield from ([flat[i], flat[i + 3]] for i in range(3))

        def __len__(self):
            return 3

    original = Buckets.__dict__["__iter__"]
    loader = DataLoader(TensorDataset(torch.arange(12.0).reshape(6, 2)), batch_sampler=Buckets())
    model = torch.nn.Linear(2, 1)
    with FitRecorder() as recorder:
        for _epoch in range(2):
            for (x,) in loader:
                model(x).sum().backward()
    assert Buckets.__dict__["__iter__"] is original  # restored when the fit ends
    passes = recorder.record.training_passes()
    assert [p.batches for p in passes] == [[[0, 3], [1, 4], [2, 5]]] * 2 and all(p.indexed for p in passes)
    assert passes[0].sampler == "Buckets" and len(passes[0].inputs) == 1  # indices: only the first input digested


def test_indices_into_nested_subsets_are_recorded_as_the_underlying_dataset_s():
    import torch
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from ddp_conformance.checks.support.fit_record import base_index
    from ddp_conformance.checks.support.observe import FitRecorder

    base = TensorDataset(torch.arange(20.0))
    shard = Subset(Subset(base, range(1, 20, 2)), [4, 0, 2])  # odd samples, then three of them
    with FitRecorder() as recorder:
        for _ in DataLoader(shard, batch_size=2):
            pass
    (recorded,) = recorder.record.passes
    assert recorded.batches == [[0, 1], [2]] and recorded.indexed  # the Subset's own, as a DataLoader draws
    assert recorded.base_batches() == [[9, 1], [5]]
    assert recorded.dataset_size == 3 and recorded.base_size == 20 and recorded.universe == [1, 5, 9]
    assert base_index([9, 1], 2) < 0 and base_index([9, 1], -1) < 0 and base_index(None, 7) == 7


def _loop(loader, model, read_ahead=False):
    """One optimizer step over 2 micro-batches of `loader` (reading the next batch before each
    forward's backward, as nanoGPT's loop does, or a further one ahead with `read_ahead`)."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(loader)
    batch = next(batches)
    if read_ahead:
        next(batches)  # a batch read before the first forward needs it
    for _ in range(2):
        out = model(batch["x"]).sum()
        batch = next(batches)  # the next micro-batch's, fetched before this backward
        out.backward()
    optimizer.step()
    optimizer.step()  # a later step's batches are not kept


def test_the_first_step_s_batches_are_kept_as_the_loader_yielded_them_and_read_ahead_shows():
    import torch
    from torch.utils.data import DataLoader

    from ddp_conformance.checks.gradient_equivalence.script_step import _first_step_problem
    from ddp_conformance.checks.support.observe import FitRecorder

    data = [{"x": torch.full((3,), float(i)), "id": i} for i in range(8)]
    with FitRecorder(plan=FitPlan(first_step=True, keep_batches=True)) as recorder:
        _loop(DataLoader(data, batch_size=2), torch.nn.Linear(3, 1))
    first = recorder.record.first_step
    assert first.micro_batches == 2 and first.sources == [(0, 1), (0, 2)]
    assert [b["id"].tolist() for b in first.batches] == [[0, 1], [2, 3]]
    assert first.batches[1]["x"][:, 0].tolist() == [2.0, 3.0]
    assert _first_step_problem(recorder.record) == ""
    with FitRecorder(plan=FitPlan(first_step=True, keep_batches=True)) as recorder:
        _loop(DataLoader(data, batch_size=2), torch.nn.Linear(3, 1), read_ahead=True)
    assert recorder.record.first_step.sources == [(0, 2), (0, 3)]
    assert "its loader is not read one batch per micro-batch" in _first_step_problem(recorder.record)
    with FitRecorder(plan=FitPlan(first_step=True)) as recorder:  # not asked: nothing kept, the loader's own iterator
        _loop(DataLoader(data, batch_size=2), torch.nn.Linear(3, 1))
    assert recorder.record.first_step.batches == []
    assert "no DataLoader" in _first_step_problem(recorder.record)


def test_the_ranks_micro_batches_are_joined_along_the_batch_dimension_or_the_skip_says_why():
    from collections import namedtuple

    import torch

    from ddp_conformance.checks.gradient_equivalence.script_step import Unjudged, _size_problem, concatenated

    Pair = namedtuple("Pair", "x y")
    joined = concatenated([{"pair": Pair(torch.zeros(2, 3), torch.zeros(2)), "task": "lm"},
                           {"pair": Pair(torch.ones(2, 3), torch.ones(2)), "task": "lm"}])
    assert isinstance(joined["pair"], Pair) and joined["pair"].x.shape == (4, 3) and joined["task"] == "lm"
    assert joined["pair"].y.tolist() == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(Unjudged, match="cannot be concatenated"):
        concatenated([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(Unjudged, match="differ between ranks"):
        concatenated([(torch.zeros(2), "a"), (torch.zeros(2), "b")])
    assert "differ in size" in _size_problem([[torch.zeros(4)], [torch.zeros(3)]])
    assert _size_problem([[torch.zeros(4), torch.zeros(4)], [torch.zeros(4), torch.zeros(4)]]) == ""


@pytest.mark.parametrize(("dropout", "randint_batches", "drew"), [
    (0.0, False, False),  # the PyTorch DDP tutorial's loop: only the loaders draw (their seeds, each pass)
    (0.5, False, True),  # dropout
    (0.0, True, True),  # nanoGPT's batches: torch.randint offsets drawn by the loop
])
def test_the_trainer_s_rng_draws_are_told_from_a_dataloader_s_own(dropout, randint_batches, drew):
    """A DataLoader without a generator draws its `_base_seed` from torch's RNG at every pass, and a
    RandomSampler its seed at its first batch: that is not the trainer using random numbers, which is
    what an RNG verdict needs. The RNG state at every micro-batch is kept with the steps before it."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_conformance.checks.support.observe import FitRecorder

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    loader = DataLoader(data, batch_size=2, shuffle=True)  # RandomSampler, no generator
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(dropout), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with FitRecorder() as recorder:
        for _epoch in range(3):
            for x, y in loader:
                if randint_batches:
                    picked = torch.randint(len(data), (2,))
                    x, y = data.tensors[0][picked], data.tensors[1][picked]
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    record = recorder.record
    assert record.rng_consumed is drew
    trail = record.rng_trail
    # the loader's draws: its `_base_seed` and the RandomSampler's seed, before each pass's first batch
    assert [m.steps for m in trail] == list(range(12))
    assert [m.loader_drew for m in trail] == [True, False, False, False] * 3
    assert trail[0].rng == record.first_rng and len({m.rng for m in trail}) == (12 if drew else 3)


def test_steps_are_digested_and_snapshotted_only_on_request_and_a_second_optimizer_ends_the_step():
    """Only the fits that compare steps digest them (`step_marks.StepDigests`); the snapshot at step k holds
    the state after every optimizer of that iteration."""
    import functools

    import torch
    from torch import nn

    from ddp_conformance.checks.support.fit_watch import FitPlan
    from ddp_conformance.checks.support.observe import FitRecorder
    from ddp_conformance.checks.support.step_marks import SnapshotAt, StepDigests, snapshot_of, step_digests

    def fit(plan: FitPlan) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        first = torch.optim.SGD(model[0].parameters(), lr=0.1)
        second = torch.optim.SGD(model[1].parameters(), lr=0.1)
        after: list[dict] = []
        with FitRecorder(plan=plan) as recorder:
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
                first.step()
                second.step()
                after.append({k: v.clone() for k, v in model.state_dict().items()})
        return recorder.record, after

    plain, _ = fit(FitPlan())
    assert step_digests(plain) == [] and snapshot_of(plain) is None and plain.watchers == []
    record, after = fit(FitPlan(watchers=(StepDigests, functools.partial(SnapshotAt, 2))))
    assert len(step_digests(record)) == 6 and len(set(step_digests(record))) == 6  # every optimizer's step
    snapshot = snapshot_of(record)
    assert snapshot is not None and snapshot.step == 2 and snapshot.micro_batches == 2
    assert all(torch.equal(snapshot.state[k], v) for k, v in after[1].items())  # after both optimizers of step 2


def test_a_step_digest_tells_one_ulp_in_one_parameter_and_nothing_else() -> None:
    import torch

    from ddp_conformance.checks.support.digests import step_digest

    torch.manual_seed(0)
    parameters = [torch.randn(300, 7), torch.randn(11)]
    same = [p.clone() for p in parameters]
    assert step_digest(parameters) == step_digest(same)
    for index in (0, 1):
        moved = [p.clone() for p in parameters]
        flat = moved[index].view(-1)
        flat[5] = torch.nextafter(flat[5], torch.tensor(float("inf")))
        assert step_digest(moved) != step_digest(parameters)
    assert step_digest(parameters) != step_digest(parameters[::-1])  # which tensor holds what counts too


@pytest.mark.ddp(world_size=2)
def test_recorder_sees_ddp_join_and_how_it_is_entered(ddp):
    import torch
    from torch import nn
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from ddp_conformance.checks.support.fit_record import JoinUse
    from ddp_conformance.checks.support.observe import FitRecorder

    model = DistributedDataParallel(nn.Linear(3, 1))
    with FitRecorder() as recorder:
        with model.join(throw_on_early_termination=True):
            model(torch.randn(2, 3)).sum().backward()
        with Join([model], enable=False):
            model(torch.randn(2, 3)).sum().backward()
    assert recorder.record.joins == [JoinUse(("DistributedDataParallel",), True, True),
                                     JoinUse(("DistributedDataParallel",), False, False)]
    assert Join.__init__.__qualname__ == "Join.__init__"  # put back after the fit


def test_steps_a_grad_scaler_skips_are_counted_as_the_trainer_counts_them_not_taken_for_a_window():
    """A GradScaler whose scaled gradients overflow skips `optimizer.step()`, so no step hook runs: the first
    applied step comes micro-batches later, and those before it are not in its gradients. The trainer's loop
    still counts the skipped step (Lightning's global_step does), so step k's snapshot is the trainer's step k:
    counted otherwise, a checkpoint at k was compared with the state one applied step later ("the model
    weights are not restored" for Lightning's demo at 16-mixed on an H200)."""
    import torch
    from torch import nn

    from ddp_conformance.checks.gradient_equivalence.fit_step import _unjudgeable
    from ddp_conformance.checks.gradient_equivalence.script_step import _first_step_problem
    from ddp_conformance.checks.support.observe import FitRecorder
    from ddp_conformance.checks.support.step_marks import SnapshotAt, StepDigests, snapshot_of, step_digests

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    inputs = [torch.full((2, 3), float("inf")), torch.randn(2, 3), torch.randn(2, 3)]  # a first batch that overflows
    after = []
    plan = FitPlan(first_step=True, watchers=(StepDigests, lambda: SnapshotAt(2)))
    with FitRecorder(plan=plan) as recorder:
        for x in inputs:
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            after.append(model.weight.detach().clone())
    record = recorder.record
    assert (record.first_step.overflowed, record.first_step.micro_batches, record.optimizer_steps) == (1, 2, 3)
    assert torch.equal(snapshot_of(record).state["weight"], after[1]) and not torch.equal(after[0], after[1])
    assert len(step_digests(record)) == 3 and step_digests(record)[0] != step_digests(record)[1]
    assert all(torch.isfinite(g).all() for g in record.first_step.grads)
    assert torch.amp.GradScaler.step.__qualname__ == "GradScaler.step"  # put back after the fit
    skipped = "a GradScaler skipped the fit's first 1 optimizer step(s)"  # neither rerun takes 2 micro-batches for it
    assert skipped in _unjudgeable(record) and skipped in _first_step_problem(record)


def test_a_recompute_is_refused_when_make_dataset_is_not_what_the_fit_s_loader_yielded():
    """Lightning's BoringModel builds its RandomDataset anew in train_dataloader(): make_dataset() then holds
    other random tensors than the fit read, and a recompute from it computes another step. The kept batches are
    matched by how many the pass had yielded, so a loop that fetches one ahead (Lightning's) still matches."""
    import torch
    from torch.utils.data import default_collate

    from ddp_conformance.checks.gradient_equivalence.fit_step import _fed_other_items
    from ddp_conformance.checks.support.fit_record import FirstStep

    data = [torch.full((2,), float(i)) for i in range(8)]
    sampled = [[3, 1], [0, 2], [5, 4]]
    adapter = type("Adapter", (), {"collate": staticmethod(default_collate)})()

    def first(*counts):
        step = FirstStep([], [torch.zeros(1)], len(counts))
        step.batches = [default_collate([data[i] for i in sampled[c - 1]]) for c in counts]
        step.sources = [(0, c) for c in counts]
        return step

    assert not _fed_other_items(adapter, data, first(1, 2), sampled)
    assert not _fed_other_items(adapter, data, first(2, 3), sampled)  # fetched one ahead, as Lightning does
    redrawn = [torch.randn(2) for _ in data]  # the same indices, data built again
    assert _fed_other_items(adapter, redrawn, first(1, 2), sampled)


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


def test_with_model_hooks_only_the_recorder_leaves_every_other_module_s_forward_unhooked():
    """compiled_model's fits: a forward compiled after the first micro-batch traces none of the recorder's hooks,
    which still count every micro-batch of the model; an unused parameter's None gradient is no gradient."""
    import torch
    from torch import nn
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

    from ddp_conformance.checks.support.observe import FitRecorder

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    spare = nn.Linear(3, 3)  # a parameter the graph never uses
    model.add_module("spare", spare)
    model.forward = lambda x: model[2](model[1](model[0](x)))  # type: ignore[method-assign]
    before = (len(_global_forward_pre_hooks), len(_global_forward_hooks))
    with FitRecorder(plan=FitPlan(model_hooks_only=True)) as recorder:
        assert (len(_global_forward_pre_hooks), len(_global_forward_hooks)) == (before[0] + 1, before[1] + 1)
        for step in range(3):
            output = model(torch.randn(2, 3))
            assert (len(_global_forward_pre_hooks), len(_global_forward_hooks)) == before
            assert not model[0]._forward_pre_hooks and len(model._forward_pre_hooks) == 1
            if step == 0:  # before any gradient: as a compiled backward calls it for a parameter it did not use
                for hook in spare.weight._backward_hooks.values():
                    hook(None)
            output.sum().backward()
    assert recorder.record.micro_batches == 3 and recorder.record.model is model
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_activation_checkpointing_s_recomputed_forwards_are_no_micro_batches():
    """A checkpointed block's forward runs again inside the backward (reentrant or not): the recorder counted each
    recomputation as a micro-batch, so a correct fit with checkpointing read as three micro-batches per step."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from ddp_conformance.checks.support.observe import FitRecorder

    class Checkpointed(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.stem, self.block = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.reentrant = reentrant

        def forward(self, x):
            x = self.stem(x)
            for _ in range(2):
                x = checkpoint(self.block, x, use_reentrant=self.reentrant)
            return x.sum()

    for reentrant in (True, False):
        model = Checkpointed(reentrant)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with FitRecorder() as recorder:
            for _ in range(2):
                model(torch.randn(2, 3)).backward()
                optimizer.step()
        assert recorder.record.micro_batches == 2 and recorder.record.optimizer_steps == 2
