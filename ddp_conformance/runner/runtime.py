"""What a rank does with a test: import its module the way pytest would, call it, report once.

Test modules are imported with pytest's assertion rewriting so a failing `assert` inside rank code
explains itself ("At index 2 diff: 3 != 4") exactly as it would in the parent.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import pickle
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

import pytest

from .builtin_fixtures import StandIn
from .context import DdpContext, DdpPlan
from .frames import is_harness
from .introspection import RankAssertions
from .protocol import FAILED, PASSED, SKIPPED, WARMUP, XFAILED, RankReply, Task
from .seeds import fresh_seeds

_modules: dict[str, tuple[float, types.ModuleType]] = {}


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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def load_module(path: str, name: str) -> types.ModuleType:
    """Import a test module with asserts rewritten; reimported only when the file changed."""
    mtime = os.stat(path).st_mtime
    cached = _modules.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    _ensure_parents(name, path)
    module = types.ModuleType(name)
    module.__file__ = path
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module  # so objects defined there pickle and import by name
    exec(_compile(path, rewrite=True), module.__dict__)
    _modules[path] = (mtime, module)
    return module


def resolve(module: types.ModuleType, qualname: str, instance: Any = None) -> Any:
    if instance is not None:  # the parent's instance, with whatever setup_method and fixtures put there
        return getattr(instance, qualname.rsplit(".", 1)[-1])
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    if isinstance(owner, type):
        owner = owner()
    return getattr(owner, parts[-1])


class _LocalModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports, by name, the modules of the user's tree that the parent imported (conftests, test
    helpers, packages), from the files the parent used, rewriting asserts where pytest did."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, bool]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.files:
            return None
        file, _ = self.files[name]
        is_package = os.path.basename(file) == "__init__.py"
        spec = importlib.util.spec_from_file_location(
            name, file, loader=self, submodule_search_locations=[os.path.dirname(file)] if is_package else None)
        return spec

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        file, rewritten = self.files[module.__name__]
        exec(_compile(file, rewritten), module.__dict__)


_local_modules = _LocalModules()


def _compile(path: str, rewrite: bool) -> Any:
    with open(path, "rb") as handle:
        source = handle.read()
    tree = ast.parse(source, filename=path)
    if rewrite:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path, None)
    return compile(tree, path, "exec", dont_inherit=True)


def know_local_modules(files: dict[str, tuple[str, bool]]) -> None:
    if files and not files.items() <= _local_modules.files.items():
        _local_modules.files.update(files)
    if files and _local_modules not in sys.meta_path:
        sys.meta_path.insert(0, _local_modules)


def _ensure_parents(name: str, path: str) -> None:
    """Make `a` and `a.b` importable for a module `a.b.c` (relative imports need them), from the
    parent's files where it had them, else as bare packages over the matching directories."""
    parts = name.split(".")
    directory = os.path.dirname(path)
    for depth in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            try:
                importlib.import_module(parent)
            except ImportError:
                package = types.ModuleType(parent)
                package.__path__ = [directory]
                sys.modules[parent] = package
        directory = os.path.dirname(directory)


def _walk(tb: types.TracebackType | None) -> Iterator[str]:
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename
        tb = tb.tb_next


def shown_exception(exc: BaseException) -> BaseException:
    """The exception whose traceback a user should read. A harness exception raised `from` the
    user's (an adapter call that raised, a trainer that could not be built) has only the plugin's
    frames: its message is the verdict's headline, and its cause holds the user's frames."""
    while exc.__cause__ is not None and not any(not is_harness(path) for path in _walk(exc.__traceback__)):
        exc = exc.__cause__
    return exc


def _message_lines(exc: BaseException) -> str:
    """pytest's `E` lines of an exception without its traceback."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return "\n".join(f"E   {line}" for line in text.splitlines())


def format_failure(exc: BaseException, func: Any, style: str) -> tuple[str, str]:
    """pytest's own representation of a rank's failure in `style`, with the user's frames only, and
    where it was raised ("path:line"; "" when no frame is the user's): cut to start at the test
    function as pytest does, then every frame of the plugin itself left out (`frames.is_harness`).
    A failure with no frame of the user's (a check's verdict, raised by the harness) is its message."""
    from _pytest._code import Code, ExceptionInfo

    shown = shown_exception(exc)
    start: tuple[Any, int] | None = None
    with contextlib.suppress(Exception):
        code = Code.from_function(inspect.unwrap(func))
        start = (code.path, code.firstlineno)

    def users_frames(info: ExceptionInfo[BaseException]) -> Any:
        traceback = info.traceback
        if start is not None and info.value is shown:
            cut = traceback.cut(path=start[0], firstlineno=start[1])
            traceback = cut if cut != traceback else cut.cut(path=start[0])
        return traceback.filter(info).filter(lambda entry: not is_harness(entry.path))

    info = ExceptionInfo.from_exception(shown)
    own = users_frames(info)
    if not own:
        return _message_lines(shown), ""
    where = f"{own[-1].path}:{own[-1].lineno + 1}"
    import io

    from _pytest._io import TerminalWriter

    style = style if style in ("long", "short", "no", "native") else "short"
    buffer = io.StringIO()
    writer = TerminalWriter(file=buffer)
    writer.hasmarkup = False
    # not str(): TerminalRepr.__str__ strips, eating the first source line's indentation
    info.getrepr(style=style, funcargs=False, truncate_locals=True, tbfilter=users_frames).toterminal(writer)
    return buffer.getvalue().rstrip(), where


_assertions = RankAssertions()


def _explained(task: Task) -> contextlib.AbstractContextManager[None]:
    """pytest's assertion explanations around the test, as a plain test gets them."""
    if task.pytest_config is None:
        return contextlib.nullcontext()
    names = {file: name for name, (file, _) in task.local_modules.items()}
    conftests = {file: names.get(file, "") for file in task.conftests}
    return _assertions.around(task.pytest_config, task.module_path, conftests)


@functools.cache
def _identity() -> tuple[int, int, int, str, str]:
    """(rank, local_rank, world_size, backend, device) from the pool's environment, read once: a
    rank keeps them for life, and the environment is put back after every test anyway."""
    from .backend import rank_device

    backend = os.environ["DDP_CONFORMANCE_BACKEND"]
    local_rank = int(os.environ["LOCAL_RANK"])
    return (int(os.environ["RANK"]), local_rank, int(os.environ["WORLD_SIZE"]), backend,
            rank_device(backend, local_rank))


def context_from_env() -> DdpContext:
    """A fresh context for one test (its figures start empty)."""
    rank, local_rank, world_size, backend, device = _identity()
    return DdpContext(rank=rank, local_rank=local_rank, world_size=world_size, backend=backend, device_name=device)


def _health(threads_before: set[int]) -> tuple[bool, str, int | None]:
    """Whether this rank's group can serve the next test, and its collective sequence number (ranks
    that disagree on it are out of step, so the parent rebuilds the pool)."""
    import torch.distributed as dist

    world = dist.group.WORLD  # None once the test destroyed the default group
    if world is None:
        return False, "the test destroyed the default process group", None
    # a thread the test left behind may be blocked in a collective of this group, or may kill the
    # rank during the next test; a rebuild from the zygote costs a tenth of a second
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
    cost a rank 0.3 ms a test, on the critical path of every distributed test."""

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
                kwargs[name] = value.materialize(stack)
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
        import traceback

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
