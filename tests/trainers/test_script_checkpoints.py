"""Checkpoints as Hugging Face tools write them, for `script:` SPECs: named by their step on the resume
line, the latest under the directory, every rank's own files merged into the resume's copy, per-rank
files told from a shared path, `accelerate launch` as the line's launcher; and the learning-rate trail
that tells a schedule set by the total steps from an unreproducible fit. No ranks: each piece alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ddp_conformance.checks.support import lr_trail
from ddp_conformance.checks.support.per_rank_files import shared_writes
from ddp_conformance.trainers import script_checkpoints as sc
from ddp_conformance.trainers.script_adapter import ScriptAdapter, ScriptSpecError, parse_script_spec
from ddp_conformance.trainers.spec import trainer_label

FIT = "script:train.py --max_steps {steps} --output_dir {checkpoint_dir} --save_steps {checkpoint_at}"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


@pytest.mark.parametrize("resume", ["{checkpoint_dir}/checkpoint-{checkpoint_at}",
                                    "{checkpoint_dir}/step_{checkpoint_at}", "{checkpoint_latest}"])
def test_the_resume_line_names_a_checkpoint_by_its_step_or_as_the_latest(base: Path, resume: str) -> None:
    spec = f"{FIT} | train.py --max_steps {{steps}} --resume_from_checkpoint {resume}"
    _, command = parse_script_spec(spec, base)
    assert command is not None and command.args[-1] == resume
    # a save after step k goes elsewhere: the fit to n writes the checkpoint on its way
    assert ScriptAdapter(spec, base).checkpoints_once


def test_a_resume_line_with_the_checkpoint_file_alone_checkpoints_in_a_fit_of_its_own(base: Path) -> None:
    assert not ScriptAdapter(f"{FIT} | train.py --max_steps {{steps}} --resume {{checkpoint}}", base).checkpoints_once
    with pytest.raises(ScriptSpecError, match=r"\{checkpoint_lates\} is not a placeholder of the resume line"):
        parse_script_spec(f"{FIT} | train.py --resume {{checkpoint_lates}}", base)
    with pytest.raises(ScriptSpecError, match=r"\{checkpoint_latest\} is not a placeholder of the fit line"):
        parse_script_spec("script:train.py --steps {steps} --out {checkpoint_latest}", base)


def test_accelerate_launch_is_the_lines_launcher_with_its_own_flags(base: Path) -> None:
    pytest.importorskip("accelerate", reason="`accelerate launch` needs accelerate")
    from ddp_conformance.trainers import accelerate_launch

    spec = ("script:accelerate launch --cpu --num_processes 2 train.py --max_train_steps {steps} "
            "| accelerate launch --cpu train.py --max_train_steps {steps} "
            "--resume {checkpoint_dir}/step_{checkpoint_at}")
    fit, resume = parse_script_spec(spec, base)
    assert fit.script == str(base / "train.py") and fit.args == ("--max_train_steps", "{steps}")
    assert fit.launcher == ("--cpu", "--num_processes", "2") and resume is not None and resume.launcher == ("--cpu",)
    assert trainer_label(spec) == "train.py"
    env = accelerate_launch.environment(fit.launcher)
    assert env["ACCELERATE_USE_CPU"] == "True" and "RANK" not in env and "MASTER_PORT" not in env
    assert accelerate_launch.environment(("--mixed_precision", "bf16"))["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with pytest.raises(ScriptSpecError, match="accelerate launch refuses its arguments"):
        parse_script_spec("script:accelerate launch --no_such_flag", base)


def _fit(root: Path, rank: int, files: dict[str, str]) -> sc.FitCheckpoint:
    directory = root / f"rank{rank}"
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    record = sc.FitCheckpoint(directory, 13, rank, sc.entries_of(directory))
    sc.remember(record)
    return record


def test_the_resume_copy_holds_rank_zeros_checkpoint_and_every_ranks_own_files(tmp_path: Path) -> None:
    zero = _fit(tmp_path / "ckpt", 0, {"step_13/model.safetensors": "weights", "step_13/random_states_0.pkl": "r0"})
    _fit(tmp_path / "ckpt", 1, {"step_13/random_states_1.pkl": "r1", "step_13/model.safetensors": "rank 1's"})
    found = sc.fit_of(zero.directory / "step_13" / "random_states_0.pkl")
    assert found is not None and found.directory == zero.directory and found.step == 13
    copy = tmp_path / "copy"
    merged = sc.copy_for_resume(found, copy)
    assert merged == ["step_13/random_states_1.pkl"]
    assert (copy / "step_13" / "model.safetensors").read_text() == "weights"  # rank 0's wins
    assert sorted(p.name for p in (copy / "step_13").iterdir()) == [
        "model.safetensors", "random_states_0.pkl", "random_states_1.pkl"]


def test_the_copy_holds_what_was_there_at_k_and_the_latest_is_by_number(tmp_path: Path) -> None:
    directory = tmp_path / "rank0"
    (directory / "checkpoint-8").mkdir(parents=True)
    (directory / "checkpoint-13").mkdir()
    watch = sc.EntryWatch(directory, 13)
    watch.at_step(12)
    assert watch.entries is None  # step 13 has not been taken yet
    watch.at_step(13)
    (directory / "checkpoint-26").mkdir()  # a save after k
    sc.remember(sc.FitCheckpoint(directory, 13, 0, watch.finish()))
    copy = tmp_path / "copy"
    sc.copy_for_resume(sc.fit_of(directory), copy)  # type: ignore[arg-type]
    assert sorted(p.name for p in copy.iterdir()) == ["checkpoint-13", "checkpoint-8"]
    assert sc.latest(copy) == copy / "checkpoint-13"  # 13 > 8, not by the letters
    assert watch.rewritten() == []


def test_an_entry_rewritten_after_k_is_named(tmp_path: Path) -> None:
    directory = tmp_path / "rank0"
    directory.mkdir()
    (directory / "ckpt.pt").write_text("at 13")
    watch = sc.EntryWatch(directory, 13)
    watch.at_step(13)
    later = time.time_ns() + 10**9
    os.utime(directory / "ckpt.pt", ns=(later, later))
    assert watch.rewritten() == ["ckpt.pt"]


def test_per_rank_files_by_design_are_told_from_a_shared_path() -> None:
    zero = ["step_13/model.safetensors", "step_13/random_states_0.pkl"]
    assert shared_writes([zero, ["step_13/random_states_1.pkl"]]) == ([], ["step_13/random_states_1.pkl"])
    assert shared_writes([["checkpoint-13/rng_state_0.pth"], ["checkpoint-13/rng_state_1.pth"]])[0] == []
    # the same path as rank 0's, or a name that does not carry the rank: a race
    assert shared_writes([zero, ["step_13/model.safetensors"]])[0] == [(1, ["step_13/model.safetensors"])]
    assert shared_writes([["ckpt.pt"], ["ckpt_rank.pt"]])[0] == [(1, ["ckpt_rank.pt"])]
    # a rank-named file with no counterpart of rank 0's is not the per-rank pattern
    assert shared_writes([["ckpt.pt"], ["state_1.pt"]])[0] == [(1, ["state_1.pt"])]


def test_the_learning_rate_trail_names_the_first_step_two_fits_stepped_apart() -> None:
    torch = pytest.importorskip("torch")

    def fit(total: int) -> lr_trail.LrTrail:
        weight = torch.nn.Parameter(torch.ones(1))
        optimizer = torch.optim.SGD([weight], lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 - done / total)
        with lr_trail.watching() as trail:
            for _ in range(3):
                weight.grad = torch.ones(1)
                optimizer.step()
                scheduler.step()
        return trail

    short, long = object(), object()
    lr_trail.remember(short, fit(4))
    lr_trail.remember(long, fit(8))
    assert lr_trail.first_apart(long, short, 3) == (2, (0.875,), (0.75,))
    assert lr_trail.first_apart(long, object(), 3) is None  # a fit not watched
