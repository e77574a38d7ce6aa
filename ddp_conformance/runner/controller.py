"""The one interface between the pytest hooks and a mode of running distributed tests.

`plugin.pytest_configure` picks one controller per pytest process, as pytest-xdist picks its
`DSession` only when distributing: `spawned.PoolController` (the plugin starts warm rank pools) or
`launched.LauncherController` (torchrun or srun started pytest itself once per rank). The hooks hand
every marked test to it and decide nothing themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from ..marker import DdpTest


class Controller(Protocol):
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
