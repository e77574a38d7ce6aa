"""Every rank starts each test with its own fresh RNG seeds (torch, random, numpy), as a process that
torchrun starts would: not the zygote's state shared by every fork, not what the previous test left."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("no_orphans")

TESTS = """
import json, random
import numpy as np
import pytest
import torch

def record(ddp, tmp_path, name):
    values = [torch.rand(1).item(), random.random(), float(np.random.rand())]
    (tmp_path.parent.parent / f"{name}-rank{ddp.rank}.json").write_text(json.dumps(values))

@pytest.mark.ddp(world_size=2)
def test_1_first(ddp, tmp_path):
    record(ddp, tmp_path, "first")

@pytest.mark.ddp(world_size=2)
def test_2_seeds_every_rank_alike(ddp):
    torch.manual_seed(0); random.seed(0); np.random.seed(0)

@pytest.mark.ddp(world_size=2)
def test_3_same_pool_after_a_seeding_test(ddp, tmp_path):
    record(ddp, tmp_path, "same-pool")
    ddp.mark_group_unusable("this test asks for a new pool")

@pytest.mark.ddp(world_size=2)
def test_4_rebuilt_pool(ddp, tmp_path):
    record(ddp, tmp_path, "rebuilt")
"""


@pytest.mark.parametrize("spawn", ["zygote", pytest.param("exec", marks=pytest.mark.slow)])  # exec: the fallback
def test_ranks_draw_different_numbers_in_every_test_and_pool(pytester: pytest.Pytester, spawn: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if spawn == "exec":
        monkeypatch.setenv("DDP_CONFORMANCE_SPAWN", "exec")
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--basetemp={pytester.path / 'tmp'}")
    result.assert_outcomes(passed=4)
    drawn = {(name, rank): tuple(json.loads((pytester.path / f"{name}-rank{rank}.json").read_text()))
             for name in ("first", "same-pool", "rebuilt") for rank in (0, 1)}
    for name in ("first", "same-pool", "rebuilt"):
        for generator in range(3):  # torch, random, numpy: each differs between the two ranks
            assert drawn[(name, 0)][generator] != drawn[(name, 1)][generator], (name, drawn)
    assert len(set(drawn.values())) == len(drawn), drawn  # and no test or pool repeats another's numbers
