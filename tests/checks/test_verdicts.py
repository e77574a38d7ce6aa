"""The pure parts of the checks' verdicts: hang diagnosis from progress records, trainer labels,
and the report's matrix and JSON. No process group; the distributed behaviour is in test_suite.py."""

from __future__ import annotations

import re

from ddp_conformance.checks import CHECK_IDS, stall_seconds
from ddp_conformance.checks.support.progress import Progress, stall_verdict
from ddp_conformance.suite.report import matrix_lines
from ddp_conformance.trainers.spec import trainer_label


def step(epoch: int, position: int, global_step: int) -> dict:
    return {"rank": 0, "epoch": epoch, "global_step": global_step, "position": position, "batch_size": 4,
            "optimizer_step": True, "loss": None}


def test_a_rank_that_returned_early_is_named_with_its_step_and_the_waiting_rank():
    progress = [Progress(rank=0, state="in_step", begun=4, finished=3, last=step(0, 3, 3)),
                Progress(rank=1, state="done", begun=3, finished=3, last=step(0, 2, 2))]
    text = stall_verdict(progress, 3.0, steps=4)
    assert text.startswith("training hangs: rank 1 stopped at micro-batch 3 of a 4-step fit")
    assert "rank 0 waits inside micro-batch 3 (epoch 0, batch 3, optimizer step 3)" in text
    assert "left its training loop early" in text


def test_a_rank_that_failed_is_named_with_its_error_and_only_the_waiting_ranks_hang():
    progress = [Progress(rank=0, state="in_step", begun=1, finished=0, last=step(0, 0, 0)),
                Progress(rank=1, state="error", begun=1, finished=0, error="ValueError: boom"),
                Progress(rank=2, state="in_step", begun=1, finished=0, last=step(0, 0, 0))]
    text = stall_verdict(progress, 3.0, steps=4)
    assert text.startswith("rank 1 failed with ValueError: boom after 0 micro-batch(es) of a 4-step fit; "
                           "ranks 0, 2 hang waiting for it (rank 0 waits")
    assert "training hangs" not in text and "rank 1 stopped" not in text
    assert "rank 2 waits" in text and "a rank that failed" in text


def test_without_a_stopped_rank_the_rank_behind_is_named():
    progress = [Progress(rank=0, state="in_step", begun=5, finished=4, last=step(0, 4, 4)),
                Progress(rank=1, state="between", begun=3, finished=3, last=step(0, 2, 2))]
    text = stall_verdict(progress, 12.0, steps=8)
    assert text.startswith("training hangs: rank 1 stopped at micro-batch 3") and "fell behind" in text


def test_all_ranks_stuck_alike_is_a_deadlock():
    progress = [Progress(rank=r, state="in_step", begun=2, finished=1, last=step(0, 1, 1)) for r in range(2)]
    assert "collective deadlock" in stall_verdict(progress, 12.0, steps=4)


def test_stall_threshold_follows_the_timeout_within_bounds():
    assert stall_seconds(120) == 12.0
    assert stall_seconds(10) == 2.0
    assert stall_seconds(1000) == 15.0


def test_trainer_labels_are_short_and_readable():
    assert trainer_label("torch") == "torch"
    assert trainer_label("/abs/fixtures/mutants/no_set_epoch.py:Trainer") == "no_set_epoch"
    assert trainer_label("adapters.py:MyTrainer") == "adapters.MyTrainer"
    assert trainer_label("pkg.module:Trainer") == "module"


def _session(checks: tuple[str, ...]) -> list[dict]:
    results = [{"trainer": t, "check": c, "outcome": "passed", "figures": {"summary": "ok"}, "message": ""}
               for t in ("torch", "x") for c in checks]
    grads = checks.index("gradient_equivalence")
    results[len(checks) + grads] = {"trainer": "x", "check": checks[grads], "outcome": "failed", "figures": {},
                                    "message": "gradients are exactly 1/2 of the single-process gradients: ..."}
    return results


MATRIX_CHECKS = CHECK_IDS[:6]  # a session that selects some checks (-k): their matrix fits 120 columns


def test_matrix_has_a_row_per_trainer_and_lists_failures_with_their_verdict():
    lines = matrix_lines({"world_size": 2, "backend": "gloo", "results": _session(MATRIX_CHECKS)})
    # a check id too wide for its column goes on as many lines as it needs, broken after its underscores
    header = lines[:lines.index("")]
    starts = [m.start() for m in re.finditer(r"\S+", header[0])]
    assert header[0].split()[0] == "trainer"
    names = ["".join(line[start:].split(maxsplit=1)[0] if line[start:start + 1].strip() else "" for line in header)
             for start in starts[1:]]
    assert names == list(MATRIX_CHECKS), header
    torch_row = lines.index(next(line for line in lines if line.startswith("torch")))
    n = len(MATRIX_CHECKS)
    assert lines[torch_row].count("PASS") == n and lines[torch_row + 1].split() == ["ok"] * n
    x_row = next(line for line in lines if line.startswith("x "))
    expected = [w for c in MATRIX_CHECKS for w in (["FAIL", "[1]"] if c == "gradient_equivalence" else ["PASS"])]
    assert x_row.split() == ["x", *expected]
    assert lines[-1] == ("[1] x / gradient_equivalence failed: "
                         "gradients are exactly 1/2 of the single-process gradients: ...")


def test_checks_too_many_to_stand_side_by_side_become_the_rows():
    lines = matrix_lines({"world_size": 2, "backend": "gloo", "results": _session(CHECK_IDS)})
    assert lines[0].split() == ["check", "torch", "x"] and all(len(line) <= 120 for line in lines)
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:] if line and not line.startswith((" ", "["))}
    assert list(rows) == list(CHECK_IDS)
    assert all(cells == (["PASS", "FAIL", "[1]"] if check == "gradient_equivalence" else ["PASS", "PASS"])
               for check, cells in rows.items()), rows
    assert lines[-1] == ("[1] x / gradient_equivalence failed: "
                         "gradients are exactly 1/2 of the single-process gradients: ...")


def test_a_session_too_wide_either_way_is_listed_a_line_per_trainer_and_check():
    trainers = [f"LightningTransformerNumber{n}" for n in range(8)]  # no place to break a name
    results = [{"trainer": t, "check": c, "outcome": "passed", "figures": {"summary": "ok"}, "message": ""}
               for t in trainers for c in CHECK_IDS]
    lines = matrix_lines({"world_size": 2, "backend": "gloo", "results": results})
    assert lines[0] == trainers[0] and f"  {CHECK_IDS[-1]}: PASS ok" in lines
    assert len(lines) == len(trainers) * (1 + len(CHECK_IDS))


def test_bucket_view_verdicts_and_the_saving_threshold():
    from types import SimpleNamespace

    from ddp_conformance.checks.bucket_view_memory import layout_problem, saving_problem, within_noise

    good = SimpleNamespace(is_ddp=True, wrapped_type="DistributedDataParallel", ddp_flag=True, all_views=True,
                           grad_storages=2, buckets=2, grads=6)
    assert layout_problem(good) is None
    assert "not wrapped" in layout_problem(SimpleNamespace(**{**vars(good), "is_ddp": False}))
    assert "never reaches DDP" in layout_problem(SimpleNamespace(**{**vars(good), "ddp_flag": False}))
    assert "a clone?" in layout_problem(SimpleNamespace(**{**vars(good), "all_views": False}))
    assert "a clone?" in layout_problem(SimpleNamespace(**{**vars(good), "grad_storages": 6}))
    grad_bytes = 1 << 20
    assert saving_problem(1.0 * grad_bytes, grad_bytes) is None
    assert saving_problem(0.91 * grad_bytes, grad_bytes) is None
    assert "saves less than 90%" in saving_problem(0.5 * grad_bytes, grad_bytes)
    assert "saves less than 90%" in saving_problem(0, grad_bytes)
    assert not within_noise(grad_bytes, 4096)  # CPU heap counters: KiB of noise on MiB of gradients
    assert within_noise(grad_bytes, 0.2 * grad_bytes)  # nccl at world size 1, seen: 9x the gradients


def test_a_summed_loss_is_named_with_accumulation_too():
    import torch

    from ddp_conformance.checks.gradient_equivalence import Setting, StepGradients, Worst, _verdict

    single = {"w": torch.ones(4)}
    own = {"w": torch.full((4,), 7.0)}
    text = _verdict(StepGradients({"w": single["w"] / 2}, single, own, []), Worst("w", 0.5, 1e-5), Setting(1e-5, 2))
    assert "exactly 1/2" in text and "summed" in text
    text = _verdict(StepGradients({"w": single["w"] / 4}, single, own, []), Worst("w", 0.75, 1e-5),
                    Setting(1e-5, 2, accumulate=2))
    assert "exactly 1/4" in text and "summed" in text


def test_training_that_changes_nothing_is_named_by_what_was_observed():
    from ddp_conformance.checks.support.vacuity import vacuity_verdict

    def rank(grad_steps=4, nonzero=4, losses=(0.9, 0.7, 0.8, 0.6), changed=True):
        return {"grad_steps": grad_steps, "nonzero_grad_steps": nonzero, "losses": list(losses),
                "params_changed": changed}

    assert vacuity_verdict([rank(), rank()], "fit(4)") == ""
    assert vacuity_verdict([None, None], "fit(4)") == ""  # nothing observed: no claim
    zero = vacuity_verdict([rank(nonzero=0, losses=[0.0] * 4), rank(nonzero=0, losses=[0.0] * 4)], "fit(4)")
    assert zero.startswith("training does not change the model: every gradient is exactly zero at each of the 8 "
                           "optimizer steps of fit(4) on 2 ranks; every loss was exactly 0")
    # one rank with one nonzero gradient is training: no claim about "every gradient"
    assert "every gradient" not in vacuity_verdict([rank(nonzero=0), rank(nonzero=1)], "fit(4)")
    # gradients never seen (set to None before after_step): the parameters decide
    frozen = vacuity_verdict([rank(grad_steps=0, nonzero=0, changed=False)] * 2, "fit(4)")
    assert frozen.startswith("training does not change the model: the parameters after fit(4) are bitwise the "
                             "initial ones on 2 ranks")
    assert vacuity_verdict([rank(changed=None), rank(changed=False)], "fit(4)") == ""
    constant = vacuity_verdict([rank(losses=[2.5] * 4), rank(losses=[1.5] * 4)], "fit(4)")
    assert constant.startswith("the loss never changes: on each of 2 ranks, every micro-batch loss of fit(4) is one "
                               "constant (1.5, 2.5)")
    assert vacuity_verdict([rank(losses=[2.5])], "fit(1)") == ""  # one loss is no sequence


def test_zero_gradients_on_both_sides_are_not_equivalence():
    import torch

    from ddp_conformance.checks.gradient_equivalence import _vacuous

    zero = {"w": torch.zeros(3), "b": None}
    assert _vacuous(zero, zero, 0.0).startswith("training does not change the model: every gradient is exactly zero")
    assert _vacuous(zero, {"w": torch.tensor([0.0, 1e-30, 0.0]), "b": None}, 0.3) == ""


def test_dataset_items_are_compared_by_content_at_fixed_indices():
    import numpy as np
    import torch

    from ddp_conformance.checks.data_consistency import _read, sample_indices
    from ddp_conformance.checks.support.model_state import item_digest

    assert sample_indices(64) == sample_indices(64) and {0, 63} <= set(sample_indices(64))
    assert len(sample_indices(64)) >= 16 and sample_indices(3) == [0, 1, 2] and sample_indices(0) == []
    item = (5, torch.arange(4.0), {"label": np.int64(2), "name": "x"})
    same = (5, torch.arange(4.0).clone(), {"name": "x", "label": np.int64(2)})
    assert item_digest(item) == item_digest(same)
    assert item_digest(item) != item_digest((5, torch.arange(4.0) + 1e-7, item[2]))
    assert item_digest(torch.ones(2, dtype=torch.bfloat16)) != item_digest(torch.ones(2, dtype=torch.float16))
    assert item_digest(torch.zeros(2, 3)) != item_digest(torch.zeros(3, 2))
    # an item that is random on every read (augmentation) is left out, a fixed one is compared
    data = [torch.ones(3), None]
    data_reads = type("Augmented", (), {"__getitem__": lambda self, i: data[0] if i == 0 else torch.rand(3)})()
    found = _read(data_reads, [0, 1])
    assert found[0] == item_digest(torch.ones(3)) and found[1] is None


def test_batches_without_indices_are_judged_by_what_each_rank_was_fed():
    from ddp_conformance.checks.sampler_disjointness.loader_schemes import ORDER_MIN_BATCHES, inputs_verdict

    batches = [f"b{i}" for i in range(2 * ORDER_MIN_BATCHES)]
    mine, theirs = batches[:ORDER_MIN_BATCHES], batches[ORDER_MIN_BATCHES:]
    sound = [[mine, mine[::-1]], [theirs, theirs[::-1]]]  # everyone[rank][epoch]
    figures = {"indices_from": "the fit's inputs", "batches_seen_per_rank": [8, 8], "order_changes": True,
               "summary": "inputs differ by rank"}
    assert inputs_verdict(sound, True, "Mine") == (figures, "")
    unsharded = [[mine, mine[::-1]], [mine, mine[::-1]]]
    assert inputs_verdict(unsharded, True, "Mine")[1].startswith(
        "ranks 0 and 1 train on the same batch in epoch 0 (batch 0 of rank 1, inputs identical): the batches (Mine) "
        "are not sharded by rank")
    padded = [[mine, mine[::-1]], [[*theirs[:-1], mine[0]], theirs[::-1]]]  # a last batch repeats rank 0's
    assert inputs_verdict(padded, True, "Mine")[1] == ""
    replayed = [[mine, mine], [theirs, theirs[::-1]]]
    assert "rank 0 trains on the same batches in the same order in epoch 0 and epoch 1" in inputs_verdict(
        replayed, True, "Mine")[1]
    assert inputs_verdict(replayed, False, "Mine")[1] == ""  # a loader that does not shuffle may replay
    every_other = [[mine, mine[::-1], mine], [theirs, theirs[::-1], theirs[1:] + theirs[:1]]]
    assert "rank 0 trains on the same batches in the same order in epoch 0 and epoch 2" in inputs_verdict(
        every_other, True, "Mine")[1]
    few = [[mine[:3], mine[:3]], [theirs[:3], theirs[:3]]]  # 3 fixed batches replay by chance 1 time in 6
    assert inputs_verdict(few, True, "Mine") == (dict(figures, batches_seen_per_rank=[3, 3], order_changes=None), "")


def test_inputs_that_hold_no_positional_tensor_are_not_taken_for_one_batch():
    import dataclasses

    import numpy as np
    import torch

    from ddp_conformance.checks.support.digests import fed_digest

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    assert fed_digest(((), {})) is None and fed_digest((3, "a")) is None  # model(input_ids=x): args are ()
    one, two = torch.ones(2), torch.zeros(2)
    assert fed_digest((Batch(one),)) != fed_digest((Batch(two),)) is not None
    assert fed_digest(({"ids": one},)) != fed_digest(({"ids": two},))
    assert fed_digest((np.ones(2),)) != fed_digest((np.zeros(2),)) is not None


def test_clipping_by_norm_or_value_is_told_from_a_wrong_gradient():
    import torch

    from ddp_conformance.checks.support.gradients import clipping

    single = {"w": torch.tensor([0.5, -2.0, 0.1], dtype=torch.float64), "b": torch.tensor([3.0], dtype=torch.float64)}
    assert clipping({n: g * 0.1 for n, g in single.items()}, single, 1e-5) == (
        "0.1x the single-process gradients, uniformly: gradient clipping by norm (not judged)")
    clamped = {n: g.clamp(-1.0, 1.0) for n, g in single.items()}
    assert clipping(clamped, single, 1e-5) == ("the single-process gradients clamped to +-1: gradient clipping by "
                                               "value (the 2 of 4 elements beyond it are not judged, the others match)")
    wrong = dict(clamped, w=torch.tensor([0.4, -1.0, 0.1], dtype=torch.float64))  # an unclamped element is off
    assert clipping(wrong, single, 1e-5) == ""
    small = {"w": torch.tensor([0.5, -2.0], dtype=torch.float64), "b": torch.tensor([1e-3], dtype=torch.float64)}
    doubled_bias = {"w": small["w"].clamp(-1.0, 1.0), "b": small["b"] * 2}  # off by its own scale, not w's
    assert clipping(doubled_bias, small, 1e-5) == ""
    assert clipping({n: g * 2 for n, g in single.items()}, single, 1e-5) == ""  # larger: no clipping does that
    assert clipping({n: -g for n, g in single.items()}, single, 1e-5) == ""  # a sign flip is no clipping
    assert clipping({n: g * 0 for n, g in single.items()}, single, 1e-5) == ""  # nor are zero gradients


def test_tensors_stepped_outside_the_model_are_compared_only_where_they_start_alike():
    from ddp_conformance.checks.support.model_state import drifted

    replica, shard = "optimizer param_groups[0][4], a scalar", "optimizer param_groups[1][0], shape (8, 4)"
    ranks = [{replica: ("s", "a"), shard: ("r0", "x")}, {replica: ("s", "b"), shard: ("r1", "y")}]
    assert drifted(ranks) == ([replica], [shard])
    assert drifted([{replica: ("s", "a")}, {replica: ("s", "a")}]) == ([], [])
    assert drifted([]) == ([], [])


def test_buffers_lost_only_off_rank_zero_are_named_as_rank_zero_s_buffers_restored_everywhere():
    from ddp_conformance.checks.resume_fidelity import BUFFERS_LOST, _cause, _rank_buffers

    assert _rank_buffers([[], [_cause(f"{BUFFERS_LOST}: after ...")]]).startswith(
        f"{BUFFERS_LOST} on rank 1, while rank 0's are: the ranks keep buffers of their own "
        "(forward_sync_buffers=False")
    every = [[_cause(f"{BUFFERS_LOST}: x")], [_cause(f"{BUFFERS_LOST}: y")]]
    assert _rank_buffers(every) == ""  # every rank: the checkpoint's fault
    assert _rank_buffers([[], []]) == ""


def test_a_sampler_that_cannot_say_draws_with_replacement_when_a_rank_repeats_an_index():
    from ddp_conformance.checks.sampler_disjointness import _draws_with_replacement
    from ddp_conformance.checks.support.fit_record import LoaderPass

    def drew(batches, replacement=None):
        return LoaderPass(length=len(batches), dataset_size=8, sampler="Mine", shuffle=None,
                          replacement=replacement, batches=batches)

    assert not _draws_with_replacement(drew([[0, 2], [4, 6]]))  # a share of a partition
    assert _draws_with_replacement(drew([[0, 2], [2, 6]]))  # index 2 twice in one rank's epoch
    assert not _draws_with_replacement(drew([[0, 2], [2, 6]], replacement=False))  # the sampler says
    assert _draws_with_replacement(drew([[0, 2], [4, 6]], replacement=True))


def test_the_world_of_one_reaches_names_imported_from_torch_distributed_but_not_torch_itself(monkeypatch):
    """`from torch.distributed import get_world_size as ws` in the trainer's module reads 1 in the
    reference, as in a real single-process run; torch's own modules keep the real functions."""
    import sys
    import types

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ddp_conformance.checks.support.one_world import world_of_one

    trainer_module = types.ModuleType("users_training_script")
    exec("from torch.distributed import get_world_size as ws, get_rank", trainer_module.__dict__)
    monkeypatch.setitem(sys.modules, "users_training_script", trainer_module)
    real = c10d.get_world_size
    with world_of_one():
        assert trainer_module.ws() == 1 and trainer_module.get_rank() == 0  # no group: the real ones would raise
        assert dist.get_world_size() == 1
        assert c10d.get_world_size is real  # DDP and the collectives keep reading the real group
    assert trainer_module.ws is real and trainer_module.get_rank is c10d.get_rank


def test_a_gradient_moved_out_of_its_bucket_through_data_is_no_bucket_view():
    """`p.grad.data = f(p.grad.data)` leaves `_is_view()` true: the storages tell (torch's `_base`
    and `_is_view` are private; if either changes meaning, this fails)."""
    import torch

    from ddp_conformance.checks.support.memory import shares_its_base

    bucket = torch.zeros(10)
    grad = bucket[2:5]
    assert shares_its_base(grad)
    grad.data = torch.nan_to_num(grad.data)
    assert grad._is_view() and not shares_its_base(grad)
    assert not shares_its_base(torch.zeros(3))


def test_subsets_drawn_per_rank_are_named_as_such_and_shards_or_one_shared_split_are_not():
    from ddp_conformance.checks.support.sampling import per_rank_split

    drawn = per_rank_split([[0, 1, 2, 4], [1, 2, 3, 5]])  # two random_split parts drawn on each rank
    assert drawn.startswith("each rank draws from its own random_split subset") and "2 of their 4 and 4" in drawn
    assert "seed the split's generator identically on every rank" in drawn
    assert per_rank_split([[0, 2, 4], [1, 3, 5]]) == ""  # each rank's own shard: a scheme of its own
    assert per_rank_split([[0, 1, 3], [0, 1, 3]]) == ""  # one split, seeded alike
    assert per_rank_split([[0, 1, 3], None]) == ""  # only one rank over a Subset: not this cause


def test_mixed_precision_names_fp32_steps_and_loss_scales_and_passes_rounding():
    import torch

    from ddp_conformance.checks.mixed_precision import _verdict, relative_difference

    generator = torch.Generator().manual_seed(0)
    fp32 = {"w": torch.randn(8, 4, generator=generator, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    rounded = {name: grad.to(torch.bfloat16).double() for name, grad in fp32.items()}
    noisy = {name: grad + 0.4 * torch.randn(grad.shape, generator=generator, dtype=torch.float64)
             for name, grad in fp32.items()}  # half the step's norm away, as bf16 over tiny BatchNorm batches
    for step in (rounded, noisy):
        assert _verdict("bf16-mixed", step, fp32, relative_difference(step, fp32)[0]) == ""
    assert "never reaches the model" in _verdict("bf16-mixed", dict(fp32), fp32, 0.0)
    scaled = {name: 128 * grad for name, grad in rounded.items()}
    text = _verdict("bf16-mixed", scaled, fp32, relative_difference(scaled, fp32)[0])
    assert text.startswith("the bf16-mixed gradients are 128x the fp32 gradients: a loss scale is never divided out")
    relative, worst = relative_difference({"w": fp32["w"], "b": 2 * fp32["b"]}, fp32)
    assert worst == "b" and 0 < relative < 1
