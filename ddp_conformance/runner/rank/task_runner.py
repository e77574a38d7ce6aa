"""What a rank does with one task: prepare the rank, import and call the test, reply once, restore.

The reply always goes back, whatever the test did: its outcome, its figures, and whether this rank's
group can serve the next test (the parent rebuilds the pool when it cannot).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

import pytest

from ..frames import is_harness
from ..wire import FAILED, PASSED, SKIPPED, WARMUP, XFAILED, DdpPlan, RankReply, StandIn, Task
from .assertion_explanations import RankAssertions
from .builtin_fixtures import materialize
from .ddp_context import DdpContext, context_from_env
from .failure_format import format_failure
from .module_importer import know_local_modules, load_module, resolve
from .seeds import fresh_seeds


def quiet_harness_warnings() -> None:
    """Leave out of the rank's output every warning raised by the plugin's own code (a line of the
    harness is where torch attributes a warning its call caused): the output is the user's, shown
    as theirs. The user's warnings, and libraries' warnings about the user's calls, still show."""
    shown = warnings.showwarning
    if getattr(shown, "harness_quiet", False):
        return

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: TextIO | None = None, line: str | None = None) -> None:
        if not is_harness(filename):
            shown(message, category, filename, lineno, file, line)

    showwarning.harness_quiet = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def leave_group() -> None:
    import torch.distributed as dist  # deferred: torch is heavy to import, and the fork server has it

    if dist.is_initialized():
        dist.destroy_process_group()


_assertions = RankAssertions()


def _explained(task: Task) -> contextlib.AbstractContextManager[None]:
    """pytest's assertion explanations around the test, as a plain test gets them."""
    if task.pytest_config is None:
        return contextlib.nullcontext()
    names = {file: name for name, (file, _) in task.local_modules.items()}
    conftests = {file: names.get(file, "") for file in task.conftests}
    return _assertions.around(task.pytest_config, task.module_path, conftests)


def _health(threads_before: set[int]) -> tuple[bool, str, int | None]:
    """Whether this rank's group can serve the next test, and its collective sequence number (ranks
    that disagree on it are out of step, so the parent rebuilds the pool)."""
    import torch.distributed as dist  # deferred: torch is heavy to import, and the fork server has it

    world = dist.group.WORLD  # None once the test destroyed the default group
    if world is None:
        return False, "the test destroyed the default process group", None
    # a thread the test left behind may be blocked in a collective of this group, or may kill the
    # rank during the next test; a rebuild from the fork server costs a tenth of a second
    leftover = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    if leftover:
        return False, f"the test left {len(leftover)} thread(s) running", None
    sequence = None
    with contextlib.suppress(Exception):  # private API: without it, the other rules still hold
        sequence = world._get_sequence_number_for_group()
    return True, "", sequence


def _raw_environ() -> dict[bytes, bytes] | None:
    """CPython's own bytes copy of the environment behind `os.environ` (compared in C, 100x faster
    than the mapping), or None where it is not there; `test_environ_fast_path` says if it goes."""
    raw = getattr(os.environ, "_data", None)
    return raw if isinstance(raw, dict) else None


class PoolEnviron:
    """The environment the pool gave this rank, put back after every test (Lightning's teardown
    deletes WORLD_SIZE, for one). Compared before anything is rewritten: rewriting ~50 variables
    cost a rank more than the rest of a warm test's own work (benchmarks/RESULTS.md), on the critical path of
    every distributed test."""

    def __init__(self) -> None:
        raw = _raw_environ()
        self._raw = dict(raw) if raw is not None else None
        self._text = dict(os.environ)

    def changed(self) -> bool:
        raw = _raw_environ()
        if raw is not None and self._raw is not None:
            return raw != self._raw
        return os.environ != self._text

    def restore(self) -> None:
        if not self.changed():
            return
        for key in [key for key in os.environ if key not in self._text]:
            del os.environ[key]
        for key, value in self._text.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


_pool_environ: PoolEnviron | None = None


def _call(func: Any, kwargs: dict[str, Any], ctx: DdpContext) -> None:
    """Call the test with this rank's values: its DdpContext for the plan, and the rank's own
    built-in fixtures (capsys, caplog...) for their stand-ins, torn down right after the call."""
    stand_ins = False
    for name, value in kwargs.items():
        if isinstance(value, DdpPlan):
            kwargs[name] = ctx
        stand_ins = stand_ins or isinstance(value, StandIn)
    if not stand_ins:
        func(**kwargs)
        return
    with contextlib.ExitStack() as stack:
        for name, value in kwargs.items():
            if isinstance(value, StandIn):
                kwargs[name] = materialize(value, stack)
        func(**kwargs)


def run_task(task: Task) -> RankReply:
    """Run one test on this rank; never raise (a reply must always go back).

    Every line here runs once per test on every rank with cold caches (the ranks share two cores
    with pytest), where it costs several times what a warm loop shows: steps that change nothing
    are skipped."""
    ctx = context_from_env()
    threads_before = {t.ident for t in threading.enumerate() if t.ident is not None}
    with _restored_afterwards():
        reply = _outcome(task, ctx)
    _take_figures(reply, ctx)
    reply.group_healthy, reply.health_note, reply.sequence = _health(threads_before)
    reply.warm = any(name in sys.modules for name in WARMUP)
    if ctx.unusable_group:
        reply.group_healthy, reply.health_note = False, ctx.unusable_group
    return reply


@contextlib.contextmanager
def _restored_afterwards() -> Iterator[None]:
    """The rank as the pool left it, after whatever the test did: its working directory and its
    environment put back, its output flushed into its log."""
    global _pool_environ
    if _pool_environ is None:
        _pool_environ = PoolEnviron()
    cwd = os.getcwd()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(cwd)
        _pool_environ.restore()


def _prepare(task: Task) -> None:
    """The rank as the parent was for this test: fresh seeds, its sys.path, directory and modules."""
    fresh_seeds()  # every test finds each rank's RNG as a fresh torchrun process would: its own seeds
    if sys.path != task.sys_path:
        sys.path[:] = task.sys_path
    if task.cwd != os.getcwd():
        os.chdir(task.cwd)
    know_local_modules(task.local_modules)


def _outcome(task: Task, ctx: DdpContext) -> RankReply:
    """Import the test, call it with this rank's values, and say how it went."""

    reply = RankReply(rank=ctx.rank, outcome=PASSED)
    func = None
    try:
        _prepare(task)
        with _explained(task):  # builds the rank's pytest Config, so conftests load first, as in the parent
            module = load_module(task.module_path, task.module_name)
            func = resolve(module, task.qualname, pickle.loads(task.instance) if task.instance else None)
            _call(func, pickle.loads(task.funcargs), ctx)
    except pytest.skip.Exception as exc:
        reply.outcome, reply.message = SKIPPED, str(exc.msg)
    except pytest.xfail.Exception as exc:
        reply.outcome, reply.message = XFAILED, str(exc.msg)
    except BaseException as exc:
        _record_failure(reply, exc, func, task.tbstyle)
    return reply


def _record_failure(reply: RankReply, exc: BaseException, func: Any, tbstyle: str) -> None:
    reply.outcome = FAILED
    reply.exc_type = (type(exc).__module__, type(exc).__qualname__)
    reply.message = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    try:
        reply.longrepr, reply.location = format_failure(exc, func, tbstyle) if func else (reply.message, "")
        reply.shortrepr = format_failure(exc, func, "short")[0] if func else reply.message
        if isinstance(exc, AssertionError) and _assertions.error:
            reply.longrepr += f"\n(ddp-conformance: pytest's assertion explanations are unavailable in ranks: " \
                              f"{_assertions.error})"
    except Exception:
        reply.longrepr = "".join(traceback.format_exception(exc))


def _take_figures(reply: RankReply, ctx: DdpContext) -> None:
    """The test's `ddp.figures` into the reply; one that cannot travel fails the test, naming it."""
    reply.figures = dict(ctx.figures)
    for key, value in list(reply.figures.items()):
        try:
            pickle.dumps(value)
        except Exception as exc:
            del reply.figures[key]
            reply.outcome = FAILED
            reply.message = f"ddp.figures[{key!r}] cannot be sent back: {type(exc).__name__}: {exc}"
            reply.longrepr = reply.shortrepr = reply.message + " (figures must be picklable: numbers, strings...)"
