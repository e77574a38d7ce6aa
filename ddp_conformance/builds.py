"""Trainers that could not be built, remembered for the session: reported once, then skipped.

A trainer whose class raises in `__init__` (or whose `setup` raises with the run's config) fails
every check the same way; six copies of one traceback bury it. The first check that fails so is
reported with the trainer's own traceback; this plugin remembers it (in the pytest process, which
sees every test's outcome), and the suite skips the trainer's other checks naming that test.

Remembered per (trainer SPEC, world size, config): a build that fails at one world size or with one
config says nothing of another. Under pytest-xdist each worker remembers its own. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

BUILD_FAILED = ("ddp_conformance.adapter", "TrainerBuildError")  # (module, qualname): a rank's error crosses as names
BuildKey = tuple[str, int, str | None]  # (trainer SPEC, world size, config path)


def failed_with(exc: BaseException, named: tuple[str, str]) -> bool:
    """Whether the test failed with the exception class `named` (module, qualname): raised here (torchrun),
    or as the first failing rank's exception type, which the pool's failure carries."""
    raised = {(cls.__module__, cls.__qualname__) for cls in type(exc).__mro__}
    return named in raised or getattr(exc, "rank_exc_type", None) == named


class UnbuiltTrainers:
    """The session's trainers that could not be built, each with the test that reported it."""

    def __init__(self) -> None:
        self.reported_by: dict[BuildKey, str] = {}
        self._keys = pytest.StashKey[BuildKey]()

    def watch(self, item: pytest.Item, key: BuildKey) -> None:
        """Remember `key` for `item`'s outcome (`conformance_options` calls this in the parent)."""
        item.stash[self._keys] = key

    def skip_if_unbuilt(self, key: BuildKey, label: str) -> None:
        reporter = self.reported_by.get(key)
        if reporter is not None:
            pytest.skip(f"trainer {label} could not be built (see test {reporter})")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        report = yield
        key = item.stash.get(self._keys, None)
        if key is not None and call.when == "call" and call.excinfo is not None \
                and failed_with(call.excinfo.value, BUILD_FAILED) and key not in self.reported_by:
            self.reported_by[key] = item.name
        return report  # type: ignore[return-value]


UNBUILT_KEY = pytest.StashKey[UnbuiltTrainers]()


def unbuilt_trainers(config: pytest.Config) -> UnbuiltTrainers:
    return config.stash[UNBUILT_KEY]


def pytest_configure(config: pytest.Config) -> None:
    unbuilt = UnbuiltTrainers()
    config.stash[UNBUILT_KEY] = unbuilt
    config.pluginmanager.register(unbuilt, "ddp-conformance-builds")
