"""A plugin for test_suite.py's nested conformance sessions: run only the (trainer SPEC, check) pairs
listed in the JSON file that $DDP_SELECTED_PAIRS names, and report the rest deselected, as `-k`
does. (`-k` matches substrings of test ids, and one mutant's name can end another's.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    listed = os.environ.get("DDP_SELECTED_PAIRS")
    if not listed:
        return
    wanted = {tuple(pair) for pair in json.loads(Path(listed).read_text())}
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        pair = (params.params.get("trainer"), params.params.get("check")) if params is not None else None
        (keep if pair in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
