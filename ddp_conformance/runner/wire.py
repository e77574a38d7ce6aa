"""The wire types of the runner: what crosses the pipes between the parent and its ranks, and what
the parent learns from one run of a test (`PoolRun`, results keyed by rank). The parent (`parent/`)
and the ranks (`rank/`) import this module and nothing of each other.

A test's fixture values travel inside a `Task` too: the `ddp` fixture's parent value (`DdpPlan`) and
the picklable stand-ins of pytest's built-in fixtures (`StandIn`), which each rank makes real
(`rank.builtin_fixtures.materialize`) because their parent values hold the pytest session.

Data flows one way: the parent sends a test reference (`Task`), every rank runs it and answers once
(`RankReply`). Both are pickled with the standard pickler on purpose: torch registers shared-memory
reductions with multiprocessing's pickler, and a tensor travelling that way would leave file
descriptors and segments behind when a rank is killed.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    import pytest

Outcome = Literal["passed", "failed", "skipped", "xfailed"]
PASSED: Final = "passed"
FAILED: Final = "failed"
SKIPPED: Final = "skipped"
XFAILED: Final = "xfailed"
EndKind = Literal["crashed", "hung"]
# the parent asks a live rank for its Python stacks with this signal; the rank's faulthandler writes
# them to the stack file the pool gave it (DDP_CONFORMANCE_STACK_FILE)
STACK_DUMP_SIGNAL: Final = signal.SIGUSR1
# where rank 0 writes what its test says it is doing (`DdpContext.status`): a file, not the result
# channel, which carries one answer per test; the parent reads it while it waits and prints it
STATUS_FILE_ENV: Final = "DDP_CONFORMANCE_STATUS_FILE"
# what a rank imports late and dearly (torch._dynamo, at its first optimizer or DDP: seconds of CPU).
# Once a rank says it has it, the fork server imports it while idle, so that ranks forked later start
# with it; a session whose tests never need it never pays for it (most of this project's own)
WARMUP: Final = ("torch._dynamo",)
# what every rank needs to join a group and run a test: the fork server imports them before it says it
# is ready, and a session whose ranks cannot import one of them stops before its first test
# (torch.optim and torch.nn.parallel come with torch)
RANK_IMPORTS: Final = ("torch", "torch.distributed", "pytest", "_pytest.assertion.rewrite", "_pytest._code")


@dataclass(frozen=True)
class ConfigRecipe:
    """How a rank rebuilds the parent's pytest Config: its command line, option values and directory."""

    args: tuple[str, ...]
    options: bytes  # pickled dict of the parent's picklable option values
    invocation_dir: str


@dataclass
class Task:
    """A reference to one test: where its function lives and the fixture values it was given."""

    nodeid: str
    module_path: str
    module_name: str
    qualname: str
    funcargs: bytes
    sys_path: list[str]
    cwd: str
    tbstyle: str = "long"
    pytest_config: ConfigRecipe | None = None  # None: no pytest explanations (bare pool benchmarks)
    conftests: tuple[str, ...] = ()  # the parent's conftest files that apply to the test's file
    instance: bytes | None = None  # the pytest-made instance of the test's class (setup_method state)
    # modules of the user's tree the parent imported: name -> (file, asserts rewritten). Lets a rank
    # import what pytest imported its own way (importlib mode, conftests, packages without sys.path)
    local_modules: dict[str, tuple[str, bool]] = field(default_factory=dict)


@dataclass
class Stop:
    """Ask a healthy pool to leave its process group and exit."""


@dataclass
class Hello:
    """A rank's first words on its channel: who it is, before it spends time joining the group."""

    rank: int
    pid: int


@dataclass
class Ready:
    pid: int
    # a fork server's modules that raised on import, each with its error's one line: the pool decides
    # which of them its tests cannot do without
    unimportable: dict[str, str] = field(default_factory=dict)


@dataclass
class Fork:
    """Ask the fork server for one rank process with this environment and log file."""

    env: dict[str, str]
    log_path: str


@dataclass
class Call:
    """Ask the fork server for one short-lived process, not a rank, that imports `target` ("module:function")
    and writes what `target(argument)` returns (a str) to `result_path`: work that needs the fork server's
    imports, done without paying them again in pytest's process. It runs with pytest's `sys_path` and
    `cwd`, as a rank runs a `Task`, so that it imports what the ranks would."""

    target: str
    argument: str
    result_path: str
    log_path: str
    sys_path: list[str]
    cwd: str


@dataclass
class Forked:
    pid: int


@dataclass
class WarmUp:
    """Tell the fork server that ranks use the WARMUP modules: import them while idle."""


@dataclass
class Exited:
    """The fork server reaped one of its ranks; `status` as os.waitpid gives it."""

    pid: int
    status: int


@dataclass
class RankReply:
    """One rank's outcome of one task."""

    rank: int
    outcome: Outcome
    longrepr: str = ""
    shortrepr: str = ""
    message: str = ""
    location: str = ""  # "path:line" of the failure's innermost frame of the user's; "" when none is
    figures: dict[str, Any] = field(default_factory=dict)
    exc_type: tuple[str, str] | None = None  # (module, qualname) of a failure's exception
    group_healthy: bool = True
    health_note: str = ""
    sequence: int | None = None
    warm: bool = False  # a WARMUP module is imported here: the fork server should preload it


@dataclass
class RankEnd:
    """How one rank ended a task when it sent no reply: crashed, or stuck and then killed."""

    rank: int
    kind: EndKind
    detail: str
    stack: str = ""


@dataclass
class PoolRun:
    """Everything the pool learned from one task, keyed by rank."""

    replies: dict[int, RankReply] = field(default_factory=dict)
    ends: dict[int, RankEnd] = field(default_factory=dict)
    output: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False
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


def encode(message: object) -> bytes:
    """A message as it crosses a pipe; a pool pickles a task once and sends the bytes to every rank."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, message: object) -> None:
    conn.send_bytes(encode(message))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# -- the fixture values a Task carries ----------------------------------------------------------------
@dataclass(frozen=True)
class DdpPlan:
    """The `ddp` fixture's value in the parent: the world size and backend it decided. Each rank
    replaces it with its own `rank.ddp_context.DdpContext` before the test body runs."""

    world_size: int
    backend: str


class StandIn:
    """A picklable placeholder the parent sends instead of a built-in fixture's value; the rank
    makes the real one (`rank.builtin_fixtures.materialize`)."""


# fixture name -> (capture level, binary, tee): pytest's capture fixtures
CAPTURE_FIXTURES = {
    "capsys": ("sys", False, False),
    "capsysbinary": ("sys", True, False),
    "capteesys": ("sys", False, True),
    "capfd": ("fd", False, False),
    "capfdbinary": ("fd", True, False),
}


@dataclass(frozen=True)
class CaptureStandIn(StandIn):
    level: str  # "sys": sys.stdout/sys.stderr; "fd": file descriptors 1 and 2
    binary: bool = False
    tee: bool = False


@dataclass(frozen=True)
class LogCaptureStandIn(StandIn):
    level: int | None  # --log-level / log_level: the handler's level, and the root logger's floor
    fmt: str
    datefmt: str | None


@dataclass(frozen=True)
class WarningsStandIn(StandIn):
    pass


@dataclass(frozen=True)
class MonkeyPatchStandIn(StandIn):
    """A fresh pytest.MonkeyPatch on each rank, undone after the test. Patches a fixture made with
    the parent's monkeypatch stay in the parent (the ranks are other processes)."""


@dataclass(frozen=True)
class TempPathFactoryStandIn(StandIn):
    basetemp: Path  # the session's, as in the parent
    root: Path  # made by the parent for this test: the ranks' directories go here


UNSET: Final[Any] = object()  # `request.param` of a request that has none


@dataclass(frozen=True)
class CallSpec:
    """`request.node.callspec` of a parametrized test: its parameters and id."""

    params: dict[str, Any]
    id: str


@dataclass(frozen=True)
class RankNode:
    """`request.node` in a rank: names, markers (closest first, as `iter_markers`), keywords and the
    callspec of a parametrized test."""

    name: str
    nodeid: str
    originalname: str
    markers: tuple[pytest.Mark, ...] = ()
    keywords: frozenset[str] = frozenset()
    callspec_: CallSpec | None = None
    left_out: tuple[str, ...] = ()  # markers whose arguments did not pickle

    def iter_markers(self, name: str | None = None) -> Iterator[pytest.Mark]:
        if name is not None and name in self.left_out:
            raise RuntimeError(f"marker {name!r} of {self.nodeid} cannot be read inside a rank: its arguments do "
                               "not pickle")
        return (mark for mark in self.markers if name is None or mark.name == name)

    def get_closest_marker(self, name: str, default: Any = None) -> Any:
        return next(self.iter_markers(name), default)

    @property
    def callspec(self) -> CallSpec:
        if self.callspec_ is None:
            raise AttributeError(f"{self.nodeid} is not parametrized: it has no callspec")
        return self.callspec_


@dataclass(frozen=True)
class RequestStandIn(StandIn):
    node: RankNode
    fixturenames: tuple[str, ...]
    param: Any = UNSET


# -- the conftest files a Task names (`Task.conftests`) ------------------------------------------------
CONFTEST = "conftest.py"


def conftest_files(plugins: Iterable[object]) -> list[str]:
    """The files of the conftest modules among pytest's plugins."""
    files = (getattr(plugin, "__file__", None) for plugin in plugins)
    return [file for file in files if file and os.path.basename(file) == CONFTEST]


def conftest_applies(conftest: str, path: Path) -> bool:
    """Whether a conftest file applies to the test file at `path`: it is in its directory or above."""
    return Path(conftest).parent in path.parents
