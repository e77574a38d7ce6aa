"""Project-wide test setup: pytester for the plugin's own tests, and the orphan guard.

The plugin itself is loaded through its pytest11 entry point (the package is installed), exactly as
a user's repo loads it; it is not listed here, or it would be registered twice.
"""

from __future__ import annotations

import pytest

from tests.helpers import live_ranks

pytest_plugins = ["pytester"]


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
