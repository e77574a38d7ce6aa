"""Every session these tests start (pytester runs, nested suite runs) inherits PYTHONHASHSEED: with it
set, ranks share one str hash secret, as torchrun's ranks would, so a session starts one fork server
instead of two, one `import torch` less in each of the default run's many sessions. The tests that
need each rank's own secret, the hash mutants' nested session (tests/checks/test_suite.py) and
tests/runner/rank/test_seeds.py, remove it.

Nor do they inherit PYTHONDONTWRITEBYTECODE (set on some CI images): each would compile the package, its tests and
fixtures from source again, in its pytest, fork servers and ranks."""

import os

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
