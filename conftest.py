"""Project-wide test setup: pytester for the plugin's own tests, the orphan guard, and nested
sessions started without hypothesis's pytest plugin.

The plugin itself is loaded through its pytest11 entry point (the package is installed), exactly as
a user's repo loads it; it is not listed here, or it would be registered twice.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import live_ranks

pytest_plugins = ["pytester"]

# Every nested pytest these tests start (about 70 in a default run: the suite, the examples, the
# runner's pytester sessions) would import hypothesis's pytest plugin at startup: 1.5 CPU-s each
# (`pytest --co` of an empty directory, 2.3 against 0.8 CPU-s), for a plugin none of them uses. This
# run itself keeps it (the scenario generator). Subprocesses inherit the variable; pytester removes it
# for its runs, so the `pytester` fixture below puts it back.
NESTED_ADDOPTS = " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS", ""), "-p no:hypothesispytest"]))
os.environ["PYTEST_ADDOPTS"] = NESTED_ADDOPTS


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTEST_ADDOPTS", NESTED_ADDOPTS)
    return pytester


@pytest.fixture(autouse=True, scope="session")
def _no_rank_outlives_the_session():
    """After the whole run, no rank started by a nested pytest may still be alive."""
    before = set(live_ranks())
    yield
    leftover = [pid for pid in live_ranks(exclude_parent=None) if pid not in before]
    # ranks of this session's own pools are closed at unconfigure, after this fixture; only ranks whose
    # parent pytest is gone are orphans
    orphans = [pid for pid in leftover if live_ranks.parent_gone(pid)]
    assert not orphans, f"orphan rank processes left behind: {orphans}"
