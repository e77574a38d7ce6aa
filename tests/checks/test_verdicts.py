"""The pure parts of the checks' verdicts: hang diagnosis from progress records, trainer labels,
and the report's matrix and JSON. No process group; the distributed behaviour is in test_suite.py."""

from __future__ import annotations

from ddp_conformance.checks import CHECK_IDS, stall_seconds, trainer_label
from ddp_conformance.checks.progress import Progress, stall_verdict
from ddp_conformance.report import matrix_lines


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


def test_a_rank_that_failed_is_named_with_its_error():
    progress = [Progress(rank=0, state="in_step", begun=1, finished=0, last=step(0, 0, 0)),
                Progress(rank=1, state="error", begun=1, finished=0, error="ValueError: boom"),
                Progress(rank=2, state="in_step", begun=1, finished=0, last=step(0, 0, 0))]
    text = stall_verdict(progress, 3.0, steps=4)
    assert text.startswith("training hangs: rank 1 stopped at micro-batch 0")
    assert "ValueError: boom" in text and "a rank that failed" in text
    assert "rank 0 waits" in text and "rank 2 waits" in text


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


def test_matrix_has_a_row_per_trainer_and_lists_failures_with_their_verdict():
    results = [{"trainer": t, "check": c, "outcome": "passed", "figures": {"summary": "ok"}, "message": ""}
               for t in ("torch", "x.py:Trainer") for c in CHECK_IDS]
    results[5 + 2] = {"trainer": "x.py:Trainer", "check": CHECK_IDS[2], "outcome": "failed", "figures": {},
                      "message": "gradients are exactly 1/2 of the single-process gradients: ..."}
    lines = matrix_lines({"world_size": 2, "backend": "gloo", "results": results})
    assert lines[0].split() == ["trainer", *CHECK_IDS]  # short labels leave room for whole check ids
    torch_row = lines.index(next(line for line in lines if line.startswith("torch")))
    assert lines[torch_row].count("PASS") == 5 and lines[torch_row + 1].split() == ["ok"] * 5
    x_row = next(line for line in lines if line.startswith("x "))
    assert x_row.split() == ["x", "PASS", "PASS", "FAIL", "[1]", "PASS", "PASS"]
    assert lines[-1] == ("[1] x / gradient_equivalence failed: "
                         "gradients are exactly 1/2 of the single-process gradients: ...")


def test_bucket_view_verdicts_and_the_saving_threshold():
    from types import SimpleNamespace

    from ddp_conformance.checks.bucket_view_memory import layout_problem, saving_problem

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


def test_a_summed_loss_is_named_with_accumulation_too():
    import torch

    from ddp_conformance.checks.gradient_equivalence import _verdict

    single = {"w": torch.ones(4)}
    own = {"w": torch.full((4,), 7.0)}
    text = _verdict({"w": single["w"] / 2}, single, own, [], "w", 0.5, 1e-5, 1e-5, world=2)
    assert "exactly 1/2" in text and "summed" in text
    text = _verdict({"w": single["w"] / 4}, single, own, [], "w", 0.75, 1e-5, 1e-5, world=2, accumulate=2)
    assert "exactly 1/4" in text and "summed" in text
