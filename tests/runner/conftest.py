from __future__ import annotations

import pytest

from tests.helpers import live_ranks


@pytest.fixture
def no_orphans():
    """Assert, after the test, that no rank whose pytest is gone is still alive."""
    yield
    import time

    deadline = time.monotonic() + 5
    while True:
        orphans = [pid for pid in live_ranks() if live_ranks.parent_gone(pid)]
        if not orphans or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not orphans, f"rank processes outlived their pytest: {orphans}"
