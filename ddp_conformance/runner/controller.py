"""The one interface between the pytest hooks and a mode of running distributed tests, and its inputs.

`plugin.pytest_configure` picks one controller per pytest process, as pytest-xdist picks its
`DSession` only when distributing: `parent.pool_controller.PoolController` (the plugin starts warm
rank pools) or `launched.LauncherController` (torchrun or srun started pytest itself once per rank).
The hooks hand every marked test to it and decide nothing themselves.

The controller's inputs are defined here, in the runner, so that the runner imports nothing above
it: the plugin face builds a `DdpTest` from each test's marker (`marker.ddp_test`) and one
`RunnerSettings` from the session's options (`options.Settings.runner`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pytest


@dataclass(frozen=True)
class DdpTest:
    """What the `ddp` marker of one test asks for."""

    world_size: int  # the ranks it runs on: its own size (or parametrized one), else --ddp-world-size
    requested_size: int | None  # the size it named itself; None when it takes the session's
    timeout: float  # its own limit in seconds, else --ddp-timeout
    # modules imported once, in the fork server, before it forks the session's first ranks: a module
    # every rank imports itself costs its CPU once per rank (torch._dynamo, at a rank's first optimizer or
    # DDP: seconds, benchmarks/RESULTS.md), and the ranks of a small machine import it side by side
    preload: tuple[str, ...] = ()
    # modules a rank cannot run this test without (beyond `wire.RANK_IMPORTS`): where the fork server
    # cannot import one, the session stops before its first test with one line naming it, instead of
    # failing every test with the same traceback
    requires: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunnerSettings:
    """The session's options the runner acts on (validated by the plugin face)."""

    backend: str  # auto, gloo or nccl
    timeout: float  # a distributed test's default limit in seconds
    start_timeout: float  # the limit for a pool's ranks to start and meet
    rank_threads: int | None  # intra-op threads per rank; None: the inherited OMP_NUM_THREADS
    device: str = "auto"  # auto, cpu or cuda: where ranks work (`parent.backend.choose_backend`)


class Controller(Protocol):
    def expect(self, preload: tuple[str, ...]) -> None:
        """Distributed tests will follow (the session names trainers to check): start now what every
        one needs, importing `preload` there, while pytest goes on configuring and collecting."""

    def call_where_ranks_start(self, target: str, argument: str) -> str | None:
        """What `target(argument)` ("module:function", returning a str) returns, run in a process that
        starts as this session's ranks do, their imports already made, so that pytest's process need not
        make them too; None where there is none (the caller runs it itself)."""

    def collection_finished(self, tests: Sequence[DdpTest]) -> None:
        """The marked tests of the session are known (start what they will need)."""

    def session_started(self, config: pytest.Config) -> None: ...

    def setup(self, item: pytest.Item, test: DdpTest) -> None:
        """Before the fixtures of a marked test: decide where it runs, or skip it."""

    def fixture_value(self, item: pytest.Item, test: DdpTest | None) -> Any:
        """The value of the `ddp` fixture for the test being set up."""

    def call(self, item: pytest.Function, test: DdpTest) -> bool | None:
        """Run a marked test (True), or leave it to pytest (None)."""

    def teardown(self, item: pytest.Item, test: DdpTest) -> None: ...

    def report(self, item: pytest.Item, test: DdpTest, call: pytest.CallInfo[None],
               report: pytest.TestReport) -> None:
        """Amend a marked test's report of one phase."""

    def session_finished(self) -> None:
        """The session's tests are over (pytest_sessionfinish): release what only tests need."""

    def close(self) -> None:
        """The session is over: release every process."""


def skip_at_item(reason: str) -> None:
    """Skip reported at the test's location (as a skip marker is), not at this plugin's line."""
    try:
        raise pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:  # a pytest without the keyword
        pytest.skip(reason)
