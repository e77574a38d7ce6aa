"""The controller of spawned mode (pytest-xdist's `DSession`): one per pytest process, owning its
warm pools.

It has a collected test built into a `Task` (`task_builder`), hands it to the pool of the test's
(world size, backend), judges the answers, and rebuilds a pool whenever a test may have poisoned its
group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from ..controller import DdpTest, RunnerSettings, skip_at_item
from ..wire import FAILED, RANK_IMPORTS, SKIPPED, XFAILED, DdpPlan
from . import status_line
from .backend import Hardware, Placement, choose_backend, probe_hardware, worker_gpu_share, xdist_worker
from .fork_server import ForkServer
from .rank_pool import PoolStartError, RankDevices, RankPool
from .task_builder import UnpicklableFixture, make_task
from .verdict import DistributedTestFailure, Verdict, failure_exception, judge, line_repr, prefixed_output

MAX_WARM_POOLS = 3  # distinct world sizes kept warm at once; each rank holds a torch import (its RSS: RESULTS.md)


@dataclass
class JudgedRun:
    """One distributed test's run, judged: its verdict, the ranks' output and the pool's notes."""

    verdict: Verdict
    output: str
    notes: list[str] = field(default_factory=list)


PLAN_KEY = pytest.StashKey[DdpPlan]()


class PoolController:
    """Spawned mode: marked tests run on warm rank pools this process starts and owns."""

    def __init__(self, settings: RunnerSettings, rank_plugins: tuple[str, ...] = ()) -> None:
        """`rank_plugins`: the pytest plugin modules every rank's Config loads (`config_recipe.installed_plugins`),
        which the fork server imports for them."""
        self.settings = settings
        self.rank_plugins = rank_plugins
        self._previous_sigterm: tuple[Any] | None = None  # (handler,) once ours is installed
        self._active = False
        self.pools: OrderedDict[tuple[int, str], RankPool] = OrderedDict()
        self._hardware: Hardware | None = None
        self._fork_server: ForkServer | None = None
        self.last_test: dict[tuple[int, str], str] = {}
        self.longest_timeout = settings.timeout  # raised to the longest marked test's at collection
        self.preload: tuple[str, ...] = ()  # what the collected tests ask the fork server to import first
        self._fork_server_failed = os.environ.get("DDP_CONFORMANCE_SPAWN") == "exec" or not hasattr(os, "fork")

    # -- the controller's face (see controller.Controller) ----------------------------------------
    def expect(self, preload: tuple[str, ...]) -> None:
        """Start the fork server now: its imports (torch, `preload`) overlap pytest's own start (the
        SPECs it validates import the same frameworks) instead of following collection. Activated first,
        as before any pool: a SIGTERM while pytest still configures must unwind it and close the fork server."""
        self._activate()
        self.preload = tuple(dict.fromkeys((*self.preload, *preload)))
        self.fork_server()

    def call_where_ranks_start(self, target: str, argument: str) -> str | None:
        """In a process forked from the fork server, only where one was started (`expect`): starting one
        here would cost the imports it saves. None when it fails or ends without a result."""
        fork_server = self._fork_server if self._fork_server is not None and self._fork_server.alive else None
        if fork_server is None:
            return None
        try:
            return fork_server.call(target, argument)
        except OSError:
            return None

    def collection_finished(self, tests: Sequence[DdpTest]) -> None:
        """Start the first pools early. Under xdist a worker does not know which tests it will get,
        so it starts only the first shape."""
        sizes: list[int] = []
        for test in tests:
            if test.world_size not in sizes:
                sizes.append(test.world_size)
        if sizes:
            self._activate()
            self.longest_timeout = max([self.longest_timeout, *(test.timeout for test in tests)])
            asked = (name for test in tests for name in (*test.preload, *test.requires))
            self.preload = tuple(dict.fromkeys((*self.preload, *asked)))
            self.refuse_unimportable(tests)
            self.prestart(sizes[:1] if xdist_worker()[1] > 1 else sizes)

    def refuse_unimportable(self, tests: Sequence[DdpTest]) -> None:
        """A module every rank needs that the ranks cannot import (torch, a test's `requires`) is one
        usage error before the first test, not the same traceback from every test. Judged where the fork
        server is (where ranks are exec'd, each test still says it): its imports are the ranks'."""
        runnable = [test for test in tests if self.place(test.world_size).skip_reason is None]
        fork_server = self.fork_server() if runnable else None  # tests that all skip in the parent start nothing
        if fork_server is None:
            return
        needed = tuple(dict.fromkeys((*RANK_IMPORTS, *(name for test in runnable for name in test.requires))))
        try:
            problems = fork_server.import_problems(needed)
        except OSError:
            return  # a fork server that cannot start: the pools fall back to exec'd ranks, and report
        if problems:
            raise pytest.UsageError(unimportable_line(problems, runnable))

    def session_started(self, config: pytest.Config) -> None:
        pass

    def setup(self, item: pytest.Item, test: DdpTest) -> None:
        """Decide the backend, and any skip that can be known here, before fixtures run or ranks spawn."""
        self._activate()
        placement = self.place(test.world_size)
        if placement.skip_reason:
            skip_at_item(placement.skip_reason)
        item.stash[PLAN_KEY] = DdpPlan(world_size=test.world_size, backend=placement.backend)

    def fixture_value(self, item: pytest.Item, test: DdpTest | None) -> DdpPlan:
        """In the parent the `ddp` fixture is the plan; each rank receives its own `DdpContext`."""
        plan = item.stash.get(PLAN_KEY, None)
        if plan is None:
            pytest.fail(f"{item.nodeid}: the ddp fixture needs the test marked @pytest.mark.ddp", pytrace=False)
        return plan

    def call(self, item: pytest.Function, test: DdpTest) -> bool | None:
        plan = item.stash.get(PLAN_KEY, None)
        if plan is None:
            return None
        try:
            judged = self.run(item, plan, test.timeout)
        except UnpicklableFixture as exc:
            problem = str(exc)
        else:
            problem = None
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        if judged.notes:
            item.add_report_section("call", "ddp pool", "\n".join(judged.notes))
        if judged.output:
            item.add_report_section("call", "output (ranks)", judged.output)
        verdict = judged.verdict
        for key, value in verdict.figures.get(0, {}).items():
            item.user_properties.append((key, value))
        if verdict.outcome == SKIPPED:
            skip_at_item(verdict.headline)  # at the test's line, not this plugin's
        if verdict.outcome == XFAILED:
            pytest.xfail(verdict.headline)
        if verdict.failing_ranks or verdict.outcome == FAILED:
            raise failure_exception(verdict)
        return True

    def teardown(self, item: pytest.Item, test: DdpTest) -> None:
        pass

    def report(self, item: pytest.Item, test: DdpTest, call: pytest.CallInfo[None],
               report: pytest.TestReport) -> None:
        """A failed distributed test is reported by its verdict, not by the parent's traceback."""
        if call.excinfo is not None and isinstance(call.excinfo.value, DistributedTestFailure) and report.failed:
            failure = call.excinfo.value
            if item.config.getoption("tbstyle", "auto") == "line" and failure.verdict is not None:
                report.longrepr = line_repr(failure.verdict.headline, failure.verdict.location, item.nodeid)
            else:
                report.longrepr = failure.verdict_text

    def _activate(self) -> None:
        """While ranks run, SIGTERM (a CI runner cancelling the job) ends pytest like Ctrl-C: the
        session unwinds, the pools are killed, pytest exits non-zero with one line instead of dying
        with ranks mid-test. Installed with the first pool, put back at the end of the session."""
        if self._active:
            return
        self._active = True
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous not in (signal.SIG_DFL, None):
            return

        def interrupt(signum: int, _frame: Any) -> None:
            raise KeyboardInterrupt(f"pytest received {signal.Signals(signum).name}")

        signal.signal(signal.SIGTERM, interrupt)
        self._previous_sigterm = (previous,)

    # -- pools -----------------------------------------------------------------------------------
    def fork_server(self) -> ForkServer | None:
        """The session's fork server, started on first need; None means exec each rank (the fallback
        when it cannot start, or when DDP_CONFORMANCE_SPAWN=exec asks for it)."""
        if self._fork_server is not None and not self._fork_server.alive:
            self._fork_server.close()
            self._fork_server = None
        if self._fork_server is None and not self._fork_server_failed:
            try:
                self._fork_server = ForkServer(start_timeout=self.settings.start_timeout,
                                               preload=(*self.preload, *self.rank_plugins))
            except OSError:
                self._fork_server_failed = True
        return self._fork_server

    # -- decisions made in the parent ------------------------------------------------------------
    @property
    def hardware(self) -> Hardware:
        if self._hardware is None:
            found = probe_hardware()
            index, count = xdist_worker()
            share = worker_gpu_share(found.cuda_devices, index, count)
            self._hardware = Hardware(cuda_devices=share, nccl_available=found.nccl_available)
        return self._hardware

    def place(self, world_size: int) -> Placement:
        if self.settings.device == "cpu" or (self.settings.backend == "gloo" and self.settings.device == "auto"):
            return Placement("gloo")  # no need to import torch just to hear "gloo on the CPU"
        return choose_backend(self.settings.backend, world_size, self.hardware, self.settings.device)

    def device_of(self, backend: str) -> str:
        """The device kind of a pool's ranks: one per (world size, backend), since the session's
        --ddp-device is fixed (`choose_backend`)."""
        return "cuda" if backend == "nccl" or self.settings.device == "cuda" else "cpu"

    # -- running ---------------------------------------------------------------------------------
    def pool(self, world_size: int, backend: str) -> RankPool:
        """The warm pool for this shape, started (or finished starting) now if need be."""
        pool = self.launch(world_size, backend)
        try:
            pool.wait_ready()
        except BaseException:
            self.pools.pop((world_size, backend), None)
            raise
        return pool

    def launch(self, world_size: int, backend: str) -> RankPool:
        key = (world_size, backend)
        pool = self.pools.get(key)
        if pool is not None:
            self.pools.move_to_end(key)
            return pool
        while len(self.pools) >= MAX_WARM_POOLS:
            _, oldest = self.pools.popitem(last=False)
            oldest.stop()
        pool = RankPool(
            world_size, backend,
            start_timeout=self.settings.start_timeout,
            devices=RankDevices(self.device_of(backend),
                                self.hardware.cuda_devices if self.device_of(backend) == "cuda" else (),
                                self.settings.rank_threads),
            fork_server=self.fork_server(),
            group_timeout=self.longest_timeout,
        )
        try:
            pool.launch()
        except OSError:
            if pool.fork_server is None:
                raise
            self._fork_server_failed = True  # fall back to exec'ing each rank
            pool.fork_server = None
            pool.launch()
        self.pools[key] = pool
        return pool

    def prestart(self, world_sizes: list[int]) -> None:
        """Get the ranks of the pools the collected tests will need going while pytest is still setting
        up: with the fork server, starting it (its torch import) is the slow part; without, the pools."""
        runnable = [size for size in world_sizes if self.place(size).skip_reason is None]
        if not runnable or self.fork_server() is not None:
            return  # nothing to start (all skip in the parent), or the fork server's start is the slow part
        for world_size in runnable[:MAX_WARM_POOLS]:
            placement = self.place(world_size)
            if placement.skip_reason is None:
                try:
                    self.launch(world_size, placement.backend)
                except OSError:
                    return  # the test that needs the pool will try again and report why

    def discard(self, world_size: int, backend: str) -> None:
        pool = self.pools.pop((world_size, backend), None)
        if pool is not None:
            pool.kill()

    def run(self, item: pytest.Function, plan: DdpPlan, timeout: float) -> JudgedRun:
        task = make_task(item)
        notes: list[str] = []
        try:
            pool = self.pool(plan.world_size, plan.backend)
            dead = pool.dead_ranks()
            if dead:  # died after their last test: not this test's fault, so start afresh
                self.discard(plan.world_size, plan.backend)
                notes.append(f"{', '.join(dead)} of the warm pool died after the previous test "
                             f"({self.last_test.get((plan.world_size, plan.backend), 'unknown')}); "
                             "the pool was rebuilt for this test")
                pool = self.pool(plan.world_size, plan.backend)
        except PoolStartError as exc:
            verdict = Verdict(FAILED, headline=str(exc).splitlines()[0], body="\n".join(str(exc).splitlines()[1:]))
            return JudgedRun(verdict, "", notes)
        progress = status_line.for_item(item, pool.status_path) if pool.status_path else None
        try:
            run = pool.run(task, timeout, progress.poll if progress else None)
        except BaseException:
            self.discard(plan.world_size, plan.backend)  # interrupted mid-test: the group is unknown
            raise
        self.last_test[(plan.world_size, plan.backend)] = item.nodeid
        if run.poisoned:
            self.discard(plan.world_size, plan.backend)
        style = item.config.getoption("tbstyle", "auto")
        return JudgedRun(judge(run, plan.world_size, "long" if style == "auto" else style), prefixed_output(run), notes)

    def session_finished(self) -> None:
        """Release the pools before pytest-xdist hears that this worker finished: from then on xdist
        gives a worker 5 s to end (then SIGINT, then os._exit), and a slow plugin's terminal summary
        (hypothesis' can take as long) would spend them, leaving the pools' directories behind."""
        self.close()

    def close(self) -> None:
        """Stop every pool and the fork server, each even when stopping another was interrupted (Ctrl-C,
        xdist's SIGINT): a pool that is not killed and removed leaves its directory behind."""
        pools, self.pools = list(self.pools.values()), OrderedDict()
        fork_server, self._fork_server = self._fork_server, None
        with contextlib.ExitStack() as closing:  # callbacks run last in, first out: the fork server after its pools
            closing.callback(self._restore_sigterm)
            if fork_server is not None:
                closing.callback(fork_server.close)
            for pool in pools:
                closing.callback(pool.stop)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm[0])
            self._previous_sigterm = None


def unimportable_line(problems: dict[str, str], tests: Sequence[DdpTest]) -> str:
    """What the ranks cannot import, the error, who needs it and where to install it, in one line."""
    name, problem = next(iter(problems.items()))
    if name in RANK_IMPORTS:
        who = "which every distributed test needs"
    else:
        count = sum(name in test.requires for test in tests)
        who = f"which {count} collected test{'s' if count != 1 else ''} require{'' if count != 1 else 's'}"
    others = f" (and {', '.join(list(problems)[1:])})" if len(problems) > 1 else ""
    return (f"ddp-conformance: the rank processes cannot import {name}{others}, {who}: {problem}; "
            f"install it into the environment of {sys.executable}")

