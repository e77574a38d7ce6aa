"""Every session these tests start (pytester runs, nested suite runs) inherits PYTHONHASHSEED: with it
set, ranks share one str hash secret, as torchrun's ranks would, so a session starts one fork server
instead of two (one `import torch` less per session: ~50 s of the default run on a 2-core machine,
measured in .ci/run on a fresh clone). The tests that need each rank's own secret, the hash mutants'
nested session (tests/checks/test_suite.py) and tests/runner/test_rank_rng.py, remove it."""

import os

os.environ.setdefault("PYTHONHASHSEED", "0")
