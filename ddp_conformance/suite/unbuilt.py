"""Trainers that could not be built, or whose fit hangs, remembered for the session: reported once, then
skipped.

A trainer whose class raises in `__init__` (or whose `setup` raises with the run's config) fails
every check the same way; six copies of one traceback bury it. The first check that fails so is
reported with the trainer's own traceback; this plugin remembers it (in the pytest process, which
sees every test's outcome), and the suite skips the trainer's other checks naming that test. A trainer
whose fit hangs (its ranks run different collectives: a rank-0-only evaluation, a `sync_dist` log on one
rank) is the same: every later check's fit would wait in the same hang for its own stall window and
report it again, so the first check whose fit hung (`CheckContext.fail(..., hung=True)`) reports it, and
the others skip naming that test. A rank that dies mid-fit (killed by the OOM killer, a crash in a
kernel) is the same: the first check it fails names the rank and how it died, and the others skip.

Remembered per (trainer SPEC, world size, config): a build that fails at one world size or with one
config says nothing of another. Under pytest-xdist each worker remembers its own. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..checks import RESULT_FIGURE

BUILD_FAILED = ("ddp_conformance.adapter", "TrainerBuildError")  # (module, qualname): a rank's error crosses as names
HUNG_FIGURE = "hung"  # a check's figure, True where its fit hung (`progress.guarded_fit`)
BuildKey = tuple[str, int, str | None]  # (trainer SPEC, world size, config path)


def failed_with(exc: BaseException, named: tuple[str, str]) -> bool:
    """Whether the test failed with the exception class `named` (module, qualname): raised here (torchrun),
    or as the first failing rank's exception type, which the pool's failure carries."""
    raised = {(cls.__module__, cls.__qualname__) for cls in type(exc).__mro__}
    return named in raised or getattr(exc, "rank_exc_type", None) == named


def hung(report: pytest.TestReport) -> bool:
    """Whether the check's result, as the report carries it (whole, or unpacked into figures), says its fit hung."""
    for key, value in report.user_properties:
        if key == HUNG_FIGURE and value is True:
            return True
        if key == RESULT_FIGURE and isinstance(value, dict) and isinstance(value.get("figures"), dict):
            return value["figures"].get(HUNG_FIGURE) is True
    return False


class UnbuiltTrainers:
    """The session's trainers that could not be built or whose fit hangs, each with the test that reported it."""

    def __init__(self) -> None:
        self.reported_by: dict[BuildKey, str] = {}
        self.hung_in: dict[BuildKey, str] = {}
        self.died_in: dict[BuildKey, tuple[str, str]] = {}  # the test, and "rank 1 died (killed by SIGKILL (9))"
        self._keys = pytest.StashKey[BuildKey]()

    def watch(self, item: pytest.Item, key: BuildKey) -> None:
        """Remember `key` for `item`'s outcome (`conformance_options` calls this in the parent)."""
        item.stash[self._keys] = key

    def skip_if_unbuilt(self, key: BuildKey, label: str) -> None:
        reporter = self.reported_by.get(key)
        if reporter is not None:
            pytest.skip(f"trainer {label} could not be built (see test {reporter})")
        reporter = self.hung_in.get(key)
        if reporter is not None:
            pytest.skip(f"trainer {label} hangs (see test {reporter}): this check's fit would wait in the same hang")
        if key in self.died_in:
            reporter, how = self.died_in[key]
            pytest.skip(f"trainer {label}'s {how} in test {reporter}: this check's fit would end the same way")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        report = yield
        key = item.stash.get(self._keys, None)
        if key is not None and call.when == "call" and call.excinfo is not None \
                and failed_with(call.excinfo.value, BUILD_FAILED) and key not in self.reported_by:
            self.reported_by[key] = item.name
        if key is not None and call.when == "call" and report.failed and hung(report) and key not in self.hung_in:
            self.hung_in[key] = item.name
        died = getattr(call.excinfo.value, "rank_died", "") if call.excinfo is not None else ""
        if key is not None and call.when == "call" and died and key not in self.died_in:
            self.died_in[key] = (item.name, died)
        return report  # type: ignore[return-value]


UNBUILT_KEY = pytest.StashKey[UnbuiltTrainers]()


def unbuilt_trainers(config: pytest.Config) -> UnbuiltTrainers:
    return config.stash[UNBUILT_KEY]


def pytest_configure(config: pytest.Config) -> None:
    unbuilt = UnbuiltTrainers()
    config.stash[UNBUILT_KEY] = unbuilt
    config.pluginmanager.register(unbuilt, "ddp-conformance-unbuilt")
