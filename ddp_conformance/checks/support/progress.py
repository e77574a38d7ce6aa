"""Per-rank training progress recorded outside the process group, and fits that cannot hang a check.

A rank that stops training (returns early, raises, skips a batch) leaves the others blocked in
DDP's gradient all-reduce, and nothing that goes through the process group can report it. So every
fit a check runs goes through `guarded_fit`:
- the fit runs in a daemon thread under a `FitRecorder`, whose hooks drive a `ProgressObserver`
  that keeps this rank's progress (micro-batches begun and finished, the last `StepInfo`,
  done/error); the adapter need not call any observer;
- the calling thread writes it to `<dir>/rank<r>.json` in the workdir that all ranks share,
  atomically (temp file + rename), at each poll where it moved, and polls every rank's file. When
  all ranks are done it returns. When some rank is done (or failed) and no rank has made progress
  for `stall_after` seconds, or no rank has moved for `4 * stall_after`, the fit is hung: it
  raises `CheckFailed` naming the ranks that stopped and the step where they stopped, and marks
  the group unusable (a thread is left blocked in a collective, so the harness must rebuild the
  ranks).
- a rank that computes is not hung, events or not: every watcher reads how long the threads of every
  rank's process on its host ran or waited to run (`RunnableBeat`, from /proc with the pid each rank's
  file gives), and a rank with a thread at `BUSY_FRACTION` or more counts as progress. A blocked rank does neither; a
  first import of torch._dynamo or Lightning on a loaded CI machine can take far longer than
  `4 * stall_after` before the first event, and is not a hang. (Read from outside the process, since
  a rank's own watcher thread can wait ~0.6 s for the GIL while its fit computes.)
Every rank reads the same files, so every waiting rank reaches the same verdict; a rank whose own fit
raised answers with that error at once, and "hangs" is said only of the ranks it leaves waiting.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import pytest
from torch.nn.parallel import DistributedDataParallel

from ...adapter import FitObserver, StepInfo
from ...runner.ranks import cpu_seconds, ranks_label
from . import collectives, session_evidence
from .check_context import CheckContext, all_gather, hide_on_verdict, rounded
from .fit_record import FitRecord
from .fit_watch import RECORD_ONLY, FitPlan
from .observe import FitRecorder, ObservedState

POLL_SECONDS = 0.02
FitState = Literal["starting", "wrapped", "in_step", "between", "done", "error"]
# of the wall time: a rank is computing when one of its threads ran or waited to run for this much of
# it. A computing thread is runnable throughout (0.97 measured on a core shared with 3 busy processes;
# less only by a virtual machine's CPU steal); a blocked one that wakes 100 times a second, as gloo's event loop
# does, 0.05-0.16 there, from the waits after its wake-ups. Judged per thread: summed over a process,
# several such wakers (gloo's, an xdist worker's execnet thread) added up to a "computing" rank.
BUSY_FRACTION = 0.5
# of one core, for the fallback where schedstat is missing: the process's CPU time
BUSY_CPU_FRACTION = 0.3
# seconds without progress after another rank's fit raised before this rank says it hangs waiting for it:
# within the runner's grace after a failure (rank_pool.FAILURE_GRACE_SECONDS), so that the waiting
# rank answers with where it waits instead of being killed as stuck
FAILED_PEER_STALL = 2.0
BUSY_WINDOW = 0.4  # seconds over which it is measured; below the shortest stall_after a test uses
# how long a hung rank waits for the others' collective records before its verdict: they reach the stall within
# a poll or two of each other (they read the same files)
RECORDS_SECONDS = 1.0
# seconds without progress, every rank blocked in a collective or out of its fit, before ranks whose collective
# records part are a hang: no rank computes, and one runs a collective the others never join (a rank in no
# collective that is still in its fit may be reading its data: it gets the stall window). Past the 2 s a
# healthy rank needs to reach its peers' collective (`stall_seconds`)
PARTED_STALL = 3.0


@dataclass
class Progress:
    """What one rank's progress file says."""

    rank: int
    state: FitState = "starting"
    begun: int = 0  # micro-batches whose forward started
    finished: int = 0  # micro-batches whose backward (and after-backward) finished
    last: dict[str, Any] | None = None  # the last StepInfo, as a dict
    error: str = ""
    wrapped_type: str = ""
    is_ddp: bool | None = None  # None: the fit never reported its wrapped model (on_wrapped)
    seq: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)  # whose threads say whether the rank computes (RunnableBeat)
    host: str = field(default_factory=socket.gethostname)
    # the thread that watches (made in `guarded_fit`'s thread): not counted, as it only polls files
    watcher: int = field(default_factory=threading.get_native_id)
    # the thread the fit runs in (0: not begun): the processes it starts work for the rank (RunnableBeat)
    fit_thread: int = 0

    @property
    def stopped(self) -> bool:
        return self.state in ("done", "error")


class ProgressObserver(FitObserver):
    """Keeps this rank's progress at every event, then forwards to an inner observer; the watching
    thread writes it to the rank's file (`flush`). Written from the fit's thread at every event
    (JSON and an atomic rename each), it took a large share of the fits' time (benchmarks/RESULTS.md);
    a poll writes it at most every POLL_SECONDS, well inside any stall_after, and also while the fit's
    thread is blocked in a collective, which is when it matters."""

    def __init__(self, path: Path, rank: int, inner: FitObserver | None = None) -> None:
        self.path = path
        self.progress = Progress(rank=rank)
        self.inner = inner
        self.model: Any = None
        self._lock = threading.Lock()  # events (the fit's thread) against flush (the watcher's)
        self._last: StepInfo | None = None  # as a dict only when written
        self._written = -1
        self.hung_path = hung_marker(path.parent, rank)
        self.hung_path.unlink(missing_ok=True)  # a former fit's, in a rebuilt pool
        self.flush()

    def _moved(self, **changes: Any) -> None:
        with self._lock:
            for name, value in changes.items():
                setattr(self.progress, name, value)
            self.progress.seq += 1

    def flush(self) -> None:
        """Write the progress file if anything moved since the last write (only one thread writes)."""
        with self._lock:
            if self.progress.seq == self._written:
                return
            self._written = self.progress.seq
            if self._last is not None:
                self.progress.last = asdict(self._last)
            text = json.dumps(asdict(self.progress))
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def on_wrapped(self, model: Any) -> None:
        self.model = model
        self._moved(state="wrapped", wrapped_type=type(model).__name__,
                    is_ddp=isinstance(model, DistributedDataParallel))
        if self.inner is not None:
            self.inner.on_wrapped(model)

    def before_step(self, info: StepInfo) -> None:
        self._last = info
        self._moved(state="in_step", begun=self.progress.begun + 1)
        if self.inner is not None:
            self.inner.before_step(info)

    def after_step(self, info: StepInfo) -> None:
        if self.inner is not None:
            self.inner.after_step(info)
        self._last = info
        self._moved(state="between", finished=self.progress.finished + 1)

    def heartbeat(self) -> None:
        """The fit is alive (a loader pass began, the adapter reported something): only the sequence
        number moves, so the hang watchdog waits, and no micro-batch is counted."""
        self._moved()

    def declare_hung(self) -> None:
        """This rank's watcher gives the stall verdict, its fit's thread left blocked in a collective: a rank
        that waits for every rank's fit to end (`all_ended`) counts this one as ended, where it would otherwise
        wait for a fit that never ends. A file of its own, not the progress file: the other watchers would read
        a change there as progress, and wait a stall window more."""
        self.hung_path.touch()

    def end(self, error: BaseException | None, extra: dict[str, Any] | None = None) -> None:
        self._moved(state="error" if error is not None else "done", extra=extra or {},
                    error=f"{type(error).__name__}: {error}".splitlines()[0][:300] if error is not None else "")


class LossTap(FitObserver):
    """What the adapter is handed as its observer: the losses it reports reach `inner`; its calls
    count nothing (the recorder counts from the fit's own hooks) but show the fit is alive."""

    def __init__(self, inner: FitObserver | None, progress: ProgressObserver) -> None:
        self.inner, self.progress = inner, progress

    def on_wrapped(self, model: Any) -> None:
        self.progress.heartbeat()

    def before_step(self, info: StepInfo) -> None:
        self.progress.heartbeat()

    def after_step(self, info: StepInfo) -> None:
        self.progress.heartbeat()
        if self.inner is not None and info.loss is not None:
            self.inner.after_step(info)

    def stop_requested(self) -> bool:
        return self.inner is not None and self.inner.stop_requested()


def all_ended(directory: Path, progress: list[Progress | None]) -> bool:
    """Whether every rank's fit ended: done, raised, or declared hung by its own watcher (`declare_hung`)."""
    return all(p is not None and (p.stopped or hung_marker(directory, p.rank).exists()) for p in progress)


def progress_path(directory: Path, rank: int) -> Path:
    """A rank's progress file in a fit's directory, which every rank's watcher reads (`read_all`)."""
    return directory / f"rank{rank}.json"


def hung_marker(directory: Path, rank: int) -> Path:
    """The file a rank's watcher touches as it gives the stall verdict (`ProgressObserver.declare_hung`)."""
    return directory / f"rank{rank}.hung"


def read_all(directory: Path, world_size: int) -> list[Progress | None]:
    found: list[Progress | None] = []
    for rank in range(world_size):
        try:
            found.append(Progress(**json.loads(progress_path(directory, rank).read_text())))
        except (OSError, ValueError, TypeError):
            found.append(None)
    return found


def _where(p: Progress | None) -> str:
    """Where a rank is, in words a user can find in their loop."""
    if p is None:
        return "never started its fit"
    last = p.last or {}
    at = (f"micro-batch {p.begun - 1} (epoch {last.get('epoch')}, batch {last.get('position')}, "
          f"optimizer step {last.get('global_step')})") if last else ""
    if p.state == "in_step":
        return f"waits inside {at}: forward/backward, where DDP all-reduces the gradients"
    if p.state == "between":
        return f"waits after {at}, outside a step (optimizer step, checkpoint or loader)"
    if p.state == "wrapped":
        return "waits before its first step, after wrapping the model in DDP"
    if p.state == "starting":
        return "waits before wrapping the model (setup, DDP construction)"
    if p.state == "error":
        return f"failed after {p.finished} micro-batch(es) with {p.error}"
    return f"returned from its fit after {p.finished} micro-batch(es)"


def stall_verdict(progress: list[Progress | None], idle: float, steps: int, where: str = "", parting: str = "") -> str:
    # `idle` is the threshold that fired, not the time measured, so every rank words it alike
    """The diagnosis of a hung fit: who stopped, where, and who is left waiting; `where` and `parting` (from the
    ranks' collective records, `collectives.py`) say in which collective each rank waits and where they parted."""
    told = stall_words(progress, idle, steps, parting)
    return told + (f". Collectives: {where}" if where else "") + (
        f". First parting: {parting}" if parting and parting not in told else "")


def stall_words(progress: list[Progress | None], idle: float, steps: int, parting: str) -> str:
    stopped = [p.rank for p in progress if p is not None and p.stopped]
    waiting = [r for r, p in enumerate(progress) if p is None or not p.stopped]
    # every rank still in its fit, or those that left it having trained every step asked: the ranks still in it ran
    # a collective the others never join, which their records tell (not a guess by counts)
    finished = all((p := progress[r]) is not None and p.state == "done" and p.finished >= steps for r in stopped)
    if parting and (not stopped or finished):
        return f"training hangs: the ranks' collectives part: {parting}; no progress for {rounded(idle)} s"
    if not stopped:
        counts = [p.finished if p is not None else -1 for p in progress]
        behind = [r for r, c in enumerate(counts) if c == min(counts)]
        stopped = behind if len(behind) < len(progress) else []
        waiting = [r for r in range(len(progress)) if r not in stopped]
    if stopped:
        first = progress[stopped[0]]
        step = first.finished if first is not None else 0
        left = "; ".join(f"rank {r} {_where(progress[r])}" for r in waiting)
        failed = [r for r in stopped if (p := progress[r]) is not None and p.state == "error"]
        if failed:  # those ranks raised: named with their errors, and "hang" said only of the ranks left waiting
            who = "; ".join(f"rank {r} failed with {progress[r].error} after "  # type: ignore[union-attr]
                            f"{progress[r].finished} micro-batch(es)" for r in failed)  # type: ignore[union-attr]
            return (f"{who} of a {steps}-step fit; {ranks_label(waiting)} "
                    f"{'hangs' if len(waiting) == 1 else 'hang'} waiting for it ({left}), no progress for "
                    f"{rounded(idle)} s: a rank that failed leaves the others blocked in DDP's collectives")
        who = ", ".join(f"rank {r} {_where(progress[r])}" for r in stopped)
        kind = ("left its training loop early" if first is not None and first.stopped else "fell behind")
        return (f"training hangs: {ranks_label(stopped)} stopped at micro-batch {step} of a {steps}-step fit ({who}) "
                f"while {left}, no progress for {rounded(idle)} s: a rank that {kind} leaves the others blocked in "
                "DDP's gradient all-reduce")
    return (f"training hangs: all ranks are stuck in the same place ({_where(progress[0])}), no progress for "
            f"{rounded(idle)} s: a collective deadlock (ranks calling different collectives?)")


@runtime_checkable
class Testifies(Protocol):
    """An inner observer whose figures of the fit each rank's final progress carries (`Progress.extra`), for
    every rank to read (`vacuity.TrainingEvidence`)."""

    def figures(self, state: Any, record: FitRecord | None) -> dict[str, Any]: ...


def guarded_fit(ctx: CheckContext, label: str, steps: int, call: Callable[[FitObserver], Any],
                plan: FitPlan = RECORD_ONLY, inner: FitObserver | None = None) -> tuple[Any, list[Progress]]:
    """Run `call(observer)` (a fit or resume) in a thread while watching every rank's progress, under a
    `FitRecorder` with `plan` (what to keep, the watchers to call); `inner` hears the fit too.

    Returns the call's result and every rank's final progress (with each rank's `inner.figures` where the
    inner observer `Testifies`). Raises the call's own exception on a rank whose fit raised, `PeerFitFailed` on
    one whose fit ended while another's raised, `CheckFailed` when it hangs. Each way this rank's kept evidence
    (`session_evidence.py`) is dropped: the next fit starts in a process unlike a fresh one.
    """
    __tracebackhide__ = hide_on_verdict
    ctx.within_budget(label, steps)
    ctx.figures.setdefault("fits", {})[label] = steps  # what the check trained, held to its plan (`plan.py`)
    directory = ctx.workdir / "progress" / label
    directory.mkdir(parents=True, exist_ok=True)
    observer = ProgressObserver(progress_path(directory, ctx.rank), ctx.rank, inner)
    box: dict[str, Any] = {}

    def target() -> None:
        observer.progress.fit_thread = threading.get_native_id()
        try:
            # progress comes from the fit's own forwards and steps (the recorder's hooks); the
            # adapter's observer calls, if it makes any, only add the losses it reports
            with FitRecorder(observer, ctx.rank, plan) as recorder:
                ctx.recordings[label] = recorder.record
                result = call(LossTap(inner, observer))
            box["result"] = ObservedState.of(result, recorder.record)
        except BaseException as exc:  # reported to the watching thread
            box["error"] = exc
            observer.end(exc)
        else:
            try:
                testimony = inner.figures(box["result"], recorder.record) if isinstance(inner, Testifies) else None
                observer.end(None, testimony)
            except BaseException as exc:
                box["error"] = exc
                observer.end(exc)

    thread = threading.Thread(target=target, name=f"ddp-conformance-{label}", daemon=True)
    with ctx.training(steps):
        thread.start()
        try:
            progress = _watch(ctx, observer, thread, steps, label)
        except BaseException:
            # a hang (the fit may still run) or a peer's error: the process is not a fresh one's
            session_evidence.forget()
            raise
    if "error" in box:
        session_evidence.forget()  # a fit that raised may leave a half-built trainer, RNG or files behind
        raise box["error"]
    return box["result"], progress  # type: ignore[return-value]


class PeerFitFailed(RuntimeError):
    """This rank's fit ended, another rank's raised: raised on this rank so that it stops with that one,
    naming it, instead of going on to a collective that rank never joins."""

    def __init__(self, peer: Progress) -> None:
        super().__init__(f"rank {peer.rank}'s fit raised {peer.error} after {peer.finished} micro-batch(es), "
                         "while this rank's fit ended")
        self.rank = peer.rank


class RunnableBeat:
    """Whether a rank computes without reaching a hook (importing, compiling, a slow first step on a
    loaded machine) rather than waiting in a collective, read from outside it (/proc). Ranks on other
    hosts, or without /proc, never count as busy.

    Measured as the time the rank's threads ran *or waited to run* (`/proc/PID/task/TID/schedstat`):
    a computing thread is always one or the other, so the fraction stays near 1 however loaded the
    machine, and a blocked thread is neither. CPU time alone is not enough: with two test workers on
    a 2-core CI machine a computing rank got less than `BUSY_CPU_FRACTION` of a core, and a fit that only
    computed was taken for a hang. The rank's watching thread is left out: it only polls these
    files, and under load a woken poller waits in the run queue too. The threads of the processes the fit's
    thread started count as the rank's own (a compiler it waits for). Without schedstat, the process's
    CPU time (utime + stime) stands in. (A thread that ends within a window takes its share along.)"""

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self.since: dict[int, tuple[float, dict[str, float]]] = {}  # pid -> (wall time, counters) at its window's start

    def busy(self, progress: list[Progress | None], now: float) -> bool:
        """Whether one thread of some rank ran or waited to run for at least BUSY_FRACTION of its
        last BUSY_WINDOW seconds, or (fallback) the rank used BUSY_CPU_FRACTION of a core (a window,
        not a poll: CPU time moves in 10 ms ticks)."""
        busy = False
        for p in progress:
            if p is None or not p.pid or p.host != self.host:
                continue
            start = self.since.get(p.pid)
            if start is not None and now - start[0] < BUSY_WINDOW:
                continue
            counters = self._counters(p.pid, p.watcher, p.fit_thread)
            if counters is None:
                continue
            if start is not None and ("cpu" in counters) == ("cpu" in start[1]):  # else: a new window
                demand = max((value - start[1].get(key, 0.0) for key, value in counters.items()), default=0.0)
                fraction = BUSY_CPU_FRACTION if "cpu" in counters else BUSY_FRACTION
                busy = busy or demand >= fraction * (now - start[0])
            self.since[p.pid] = (now, counters)
        return busy

    def _counters(self, pid: int, watcher: int, fit_thread: int = 0) -> dict[str, float] | None:
        """Seconds each thread but the watcher ran or waited to run; {"cpu": utime + stime} where
        schedstat cannot be read (or reads all zeros: a kernel without schedstats and delay
        accounting; every live thread has run); None when the process is gone."""
        try:
            threads = [tid for tid in os.listdir(f"/proc/{pid}/task") if tid != str(watcher)]
        except OSError:
            return None
        counters: dict[str, float] = {}
        started = _descendant_threads(pid, fit_thread) if fit_thread else []
        for process, tid in [*((pid, tid) for tid in threads), *started]:
            try:
                ran, waited = Path(f"/proc/{process}/task/{tid}/schedstat").read_text().split()[:2]
            except (OSError, ValueError):
                continue  # the thread ended, or no schedstat here
            counters[tid if process == pid else f"{process}/{tid}"] = (int(ran) + int(waited)) / 1e9
        if any(counters.values()) or not threads:
            return counters
        cpu = cpu_seconds(pid)
        return None if cpu is None else {"cpu": cpu}


def _descendant_threads(pid: int, thread: int, most: int = 64) -> list[tuple[int, str]]:
    """(process, thread) of every process thread `thread` of `pid` started, and of theirs: work the fit waits for
    in a child (a cold torch.compile runs g++, whose cc1plus computes, while the fit's thread sleeps) is the rank's.
    Only the fit's thread's: another thread's child (a logger, a prefetch server) says nothing of the fit."""
    found: list[tuple[int, str]] = []
    parents = _children(pid, str(thread))
    while parents and len(found) < most:
        process = parents.pop()
        try:
            tasks = os.listdir(f"/proc/{process}/task")
        except OSError:
            continue  # gone
        for tid in tasks:
            found.append((process, tid))
            parents += _children(process, tid)
    return found


def _children(pid: int, tid: str) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except (OSError, ValueError):
        return []  # gone, or a kernel without the children file


def _watch(ctx: CheckContext, observer: ProgressObserver, thread: threading.Thread, steps: int,
           label: str = "") -> list[Progress]:
    __tracebackhide__ = hide_on_verdict
    seen: list[int] = []
    last_change = time.monotonic()
    beat = RunnableBeat()
    own_record = collectives.record_path(observer.path.parent, observer.progress.rank)
    recorded = False  # this rank's collectives dumped in the present stall
    while True:
        thread.join(POLL_SECONDS)
        # asked before the flush: a fit that ended after a flush and before this question would be
        # answered from memory with its end never written, and the ranks that read its file for it
        # (nonfinite_loss's `_every_rank_raised`) would wait for an end they never see
        ended = not thread.is_alive()
        observer.flush()
        if label and ctx.rank == 0:  # on the terminal once the fit runs long (`ddp.status`, rate-limited there)
            done = (observer.progress.last or {}).get("global_step", 0)
            ctx.ddp.status(f"{ctx.check_id}: fit '{label}', step {done} of {steps}")
        progress = read_all(observer.path.parent, ctx.world_size)
        if ended and (observer.progress.state == "error" or all(p is not None and p.stopped for p in progress)):
            # a fit that raised is reported with its own error at once; the ranks it leaves waiting
            # say so themselves (FAILED_PEER_STALL), before the runner counts them as stuck
            failed = [p for p in progress if p is not None and p.state == "error"]
            if observer.progress.state != "error" and failed:
                # a peer raised after the fit's last collective: going on would take this rank alone into
                # the check's next collective, where it would wait for a rank that never comes
                raise PeerFitFailed(failed[0])
            return [p for p in progress if p is not None]
        if ended:  # join returns at once now: without a pause this loop would spin a core
            time.sleep(POLL_SECONDS)
        seqs = [p.seq if p is not None else 0 for p in progress]
        now = time.monotonic()
        if seqs != seen or beat.busy(progress, now):
            seen, last_change = seqs, now
            if recorded:  # the stall is over: its record would place the next one wrong
                own_record.unlink(missing_ok=True)
                recorded = False
        idle = now - last_change
        some_stopped = any(p is not None and p.stopped for p in progress)
        peer_failed = any(p is not None and p.state == "error" for p in progress)
        if idle >= min(ctx.stall_after, PARTED_STALL) and not recorded:
            recorded = collectives.dump(own_record)
        # every rank blocked in a collective: a hang, told in the stall window and not four of them; and where
        # their records part (a collective some rank runs that the others never join), in PARTED_STALL
        blocked, parted = collectives.stuck(
            collectives.read_all(own_record.parent, ctx.world_size) if recorded else [],
            [p is not None and p.stopped for p in progress])
        threshold = (min(ctx.stall_after, FAILED_PEER_STALL) if peer_failed
                     else min(ctx.stall_after, PARTED_STALL) if parted
                     else ctx.stall_after if some_stopped or blocked else 4 * ctx.stall_after)
        if idle >= threshold:
            observer.declare_hung()
            ctx.ddp.mark_group_unusable(f"a conformance fit hung ({ctx.check_id}); a thread is blocked")
            raise ctx.fail(stall_verdict(progress, threshold, steps, *_located(own_record, progress, ctx.world_size)),
                           hung=True)


def _located(own_record: Path, progress: list[Progress | None], world_size: int) -> tuple[str, str]:
    """Where each rank waits and where their collectives parted (`collectives.py`); "" where torch recorded none.
    Waits up to RECORDS_SECONDS for the ranks still watching to dump theirs."""
    if not collectives.dump(own_record):
        return collectives.unrecorded(), ""
    deadline = time.monotonic() + RECORDS_SECONDS
    dumps = collectives.read_all(own_record.parent, world_size)
    while any(d is None and p is not None and p.state != "error" for d, p in zip(dumps, progress, strict=True)) \
            and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
        dumps = collectives.read_all(own_record.parent, world_size)
    micro = [p.begun - 1 if p is not None and p.begun else None for p in progress]
    return collectives.where(dumps, micro), collectives.first_parting(dumps)


def epoch_steps(ctx: CheckContext, probe: FitRecord, *, lengths_are_mine: bool = True) -> int | None:
    """Optimizer steps in one epoch of the trainer's real training loader, from the record of a
    one-step fit (`shared_fit.probe`): its loader's length over the micro-batches per optimizer step.
    Every rank must agree (collective): unequal lengths leave ranks waiting in DDP's all-reduce,
    which is sampler_disjointness's verdict (`lengths_are_mine`); for any other check they are a
    precondition it cannot judge without, so a skip naming sampler_disjointness. None when the
    loader has no length."""
    __tracebackhide__ = hide_on_verdict

    passes = probe.training_passes()
    lengths = all_gather(passes[0].length if passes else None)
    if any(n is None for n in lengths):
        return None
    if len(set(lengths)) > 1:
        uneven = f"the ranks' training loaders have different lengths ({lengths} batches)"
        if not lengths_are_mine:
            pytest.skip(f"{uneven}, so their epochs end at different steps and no one checkpoint step is the same "
                        "point of every rank's epoch: not judged here; sampler_disjointness judges the batch counts")
        raise ctx.fail(f"{uneven}: uneven batch counts leave ranks waiting in DDP's all-reduce at the end of every "
                       "epoch (the batching differs between ranks)", batches_per_rank=lengths)
    accumulate = max(1, probe.micro_batches // max(1, probe.optimizer_steps))
    return max(1, math.ceil(lengths[0] / accumulate))
