"""accumulation_equivalence's claim against the observed window, and its reference held at k = 1
(`ddp_conformance.checks.support.accumulation_watch`). Pure and local: no process group."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ddp_conformance.adapter import RankContext
from ddp_conformance.checks.support.accumulation_watch import (
    HeldWatch,
    at_k,
    at_one_micro_batch,
    claim_disagrees,
    over_ranks_note,
    own_setting,
    thrown_away,
    window_per_step,
    window_text,
)
from ddp_conformance.config import RunConfig


def test_a_window_is_said_once_where_every_rank_took_it():
    assert window_text([4, 4]) == "4 micro-batches per rank"
    assert window_text([1, 1]) == "1 micro-batch per rank"
    assert window_text([2, 3]) == "per rank 2, 3"


@pytest.mark.parametrize(("claimed", "windows"), [(1, [1, 1]), (1, [4, 4]), (4, [4, 4]), (0, [2, 2])])
def test_a_claim_the_ranks_kept_or_the_default_is_no_disagreement(claimed, windows):
    for script in (False, True):
        assert claim_disagrees(claimed, windows, script, carried=script) == ""


def test_a_class_trainer_that_steps_every_micro_batch_is_named_as_such():
    text = claim_disagrees(2, [1, 1], script=False)
    assert text.startswith("the fit steps after every micro-batch although accumulate_grad_batches is 2")
    assert "1/2 of the configured batch" in text
    assert "another window than the config's" in claim_disagrees(3, [2, 2], script=False)


def test_a_script_names_the_claim_and_what_it_took_and_where_the_k_comes_from():
    own = claim_disagrees(4, [2, 2], script=True)
    assert "claims accumulate_grad_batches 4" in own and "took 2 micro-batches per rank" in own
    assert "by its own setting" in own and "{accumulate_grad_batches}" in own
    carried = claim_disagrees(6, [2, 2], script=True, carried=True)
    assert "got accumulate_grad_batches 6 from the config" in carried and "divided by the world size" in carried


def test_a_script_argument_that_counts_over_all_ranks_is_a_note_not_a_failure():
    """nanoGPT divides its gradient_accumulation_steps by the world size: 4 at world size 2 is 2 a rank."""
    assert claim_disagrees(4, [2, 2], script=True, carried=True) == ""
    assert "over all 2 ranks" in over_ranks_note(4, [2, 2]) and "2 per rank" in over_ranks_note(4, [2, 2])
    assert over_ranks_note(4, [4, 4]) == "" and over_ranks_note(2, [2]) == ""
    assert "claims accumulate_grad_batches 4" in claim_disagrees(4, [2, 2], script=True)  # not carried: a claim


def test_accumulating_by_an_own_setting_is_a_note_only_where_the_config_claims_none():
    assert own_setting(1, [4, 4], script=True).startswith("the fit accumulates 4 micro-batches per rank a step by "
                                                         "the script's own setting")
    assert "a setting of its own" in own_setting(1, [2, 2], script=False)
    assert own_setting(4, [4, 4], script=False) == "" and own_setting(1, [1, 1], script=True) == ""


class _SetsItsOwnK:
    """A class trainer whose setup sets its own accumulation, as the accum_* fixtures do."""

    def setup(self, config: RunConfig, ctx: RankContext) -> None:
        self.config, self.ctx = at_k(config, 3), ctx


class _Ctx:
    """What `at_one_micro_batch` asks of a CheckContext."""

    def __init__(self, tmp_path: Path) -> None:
        self.rank_ctx = RankContext(rank=1, local_rank=1, world_size=2, backend="gloo", device="cpu",
                                    workdir=tmp_path)
        self.world_size, self.config, self.notes = 2, at_k(RunConfig(), 4), []

    def adapter(self, config: RunConfig | None = None, rank_ctx: RankContext | None = None) -> Any:
        built = _SetsItsOwnK()
        built.setup(config or self.config, rank_ctx or self.rank_ctx)
        return built

    def note(self, text: str) -> None:
        self.notes.append(text)


def test_the_reference_runs_at_one_micro_batch_whatever_the_trainer_sets_in_its_setup(tmp_path):
    ctx = _Ctx(tmp_path)
    reference = at_one_micro_batch(ctx, ctx.config)
    assert reference.config.trainer.accumulate_grad_batches == 1
    assert (reference.ctx.world_size, reference.ctx.rank) == (1, 0)  # as in a world of one
    assert replace(reference.config, trainer=ctx.config.trainer) == ctx.config  # nothing else changed


def _window(zero_grad_inside: bool, micro_batches: int = 3) -> int | None:
    """What a HeldWatch sees of a plain loop's first window (then a second one, which it no longer watches)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = HeldWatch()
    watch.on_wrapped(model)
    try:
        for _ in range(2):
            for _ in range(micro_batches):
                if zero_grad_inside:
                    optimizer.zero_grad()
                (model(torch.randn(2, 4)).sum() / micro_batches).backward()
            optimizer.step()
            optimizer.zero_grad()  # between windows, as it should be
    finally:
        watch.close()
    return watch.first_thrown(micro_batches)


def test_a_window_that_keeps_its_gradients_throws_nothing_away():
    assert _window(zero_grad_inside=False) is None


def test_zero_grad_inside_the_window_is_seen_at_its_second_backward_pass():
    assert _window(zero_grad_inside=True) == 2
    verdict = thrown_away(3, [None, 2])
    assert verdict.startswith("only the last micro-batch of each 3-batch accumulation window counts")
    assert "rank 1's backward pass 2" in verdict
    assert thrown_away(3, [None, None]) == "" and thrown_away(1, [2, 2]) == ""


def test_a_pass_that_begins_a_window_may_find_the_gradients_gone():
    """A GradScaler-skipped step before the first applied one: its window ended with zero_grad, rightly."""
    watch = HeldWatch()
    watch.gone = {3}
    assert watch.first_thrown(2) is None and watch.first_thrown(3) == 3


def test_a_step_that_took_the_skipped_steps_micro_batches_too_is_cut_into_windows():
    assert window_per_step(8, 1) == 4 and window_per_step(4, 0) == 4 and window_per_step(5, 1) is None
