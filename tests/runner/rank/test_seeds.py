"""Every rank starts each test with its own fresh RNG seeds (torch, random, numpy), as a process that
torchrun starts would: not the fork server's state shared by every fork, not what the previous test left."""

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


@pytest.mark.parametrize("spawn", ["fork_server", pytest.param("exec", marks=pytest.mark.slow)])  # exec: the fallback
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


def test_fresh_seeds_draws_new_entropy_for_every_generator() -> None:
    import random

    import numpy as np
    import torch

    from ddp_conformance.runner.rank.seeds import fresh_seeds

    def draws() -> tuple[int, float, float, float]:
        return torch.initial_seed(), torch.rand(1).item(), random.random(), float(np.random.rand())

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    seeded = draws()
    fresh_seeds()
    first = draws()
    fresh_seeds()
    second = draws()
    for index in range(4):  # each generator moved off the fixed seed, and moves again next time
        assert len({seeded[index], first[index], second[index]}) == 3, (index, seeded, first, second)


@pytest.mark.parametrize("cpu_only", [True, False])
def test_fresh_seeds_leaves_accelerator_seeding_to_torch_seed_unless_there_is_none(
        monkeypatch: pytest.MonkeyPatch, cpu_only: bool) -> None:
    """The cheap path (the CPU generator alone) only where torch has no other generator to seed."""
    import torch

    from ddp_conformance.runner.rank import seeds

    called: list[int] = []
    monkeypatch.setattr(seeds, "_cpu_only_torch", lambda: cpu_only)
    monkeypatch.setattr(torch, "seed", lambda: called.append(1) or 7)
    before = torch.initial_seed()
    seeds.fresh_seeds()
    assert called == ([] if cpu_only else [1])
    assert (torch.initial_seed() != before) is cpu_only  # the stand-in torch.seed seeds nothing


def test_this_torch_is_recognised_as_cpu_only_exactly_when_it_has_no_accelerator() -> None:
    import torch

    from ddp_conformance.runner.rank.seeds import _cpu_only_torch

    assert _cpu_only_torch() is (not torch.backends.cuda.is_built() and not torch.backends.mps.is_built()
                                 and not torch.xpu._is_compiled() and not torch.mtia._is_compiled())


HASHES = """
import pytest
import torch.distributed as dist

@pytest.mark.ddp(world_size=3)
def test_hashes(ddp):
    hashes = [None] * ddp.world_size
    dist.all_gather_object(hashes, (hash("label_7"), list({"a", "b", "c", "d", "e", "f", "g", "h"})))
    if ddp.rank == 0:
        print("HASHES", hashes)
        assert {HOW} hashes[0] != hashes[1], hashes
"""


@pytest.mark.parametrize("hash_seed", [None, pytest.param("0", marks=pytest.mark.slow)])  # the set seed: -m slow
def test_rank_zero_hashes_strings_as_another_interpreter_unless_pythonhashseed_is_set(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, hash_seed: str | None) -> None:
    """torchrun's ranks are separate interpreters, each with its own str hash secret: a vocabulary built
    from a set of label names, or a file list sharded by hash(), differs per rank there, and must here."""
    if hash_seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", hash_seed)  # inherited by every rank, under torchrun too
    pytester.makepyfile(HASHES.replace("{HOW}", "" if hash_seed is None else "not"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
