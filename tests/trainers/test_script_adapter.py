"""script: SPECs: the placeholders real scripts need, steps counted against the steps asked, every fit
in a fresh working directory, and every SPEC mistake one line. The scripts run in-process in a world
of one (fixtures/scripts: each in the shape a public or independently written trainer has)."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from ddp_conformance.adapter import NotProvided, RankContext, TrainerBuildError
from ddp_conformance.config import RunConfig
from ddp_conformance.trainers.script_adapter import ScriptAdapter, parse_script_spec
from ddp_conformance.trainers.spec import SpecError, resolve_spec

SCRIPTS = Path(__file__).resolve().parents[2] / "fixtures" / "scripts"


def adapter_for(spec: str, base: Path, workdir: Path) -> ScriptAdapter:
    adapter = ScriptAdapter(spec, base)
    adapter.setup(RunConfig(), RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cpu",
                                           workdir=workdir))
    return adapter


def repo_with(tmp_path: Path, *scripts: str) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for script in scripts:
        shutil.copy(SCRIPTS / script, repo / script)
    return repo


def fit_dirs(workdir: Path) -> list[Path]:
    return [p for p in (workdir / "script-fits").iterdir() if p.name.startswith("rank")]


# -- every fit in a fresh working directory ---------------------------------------------------------

def test_a_snapshot_in_the_cwd_stays_with_its_fit_and_its_resume_finds_it(tmp_path):
    """The DDP tutorial's multigpu_torchrun.py resumes from ./snapshot.pt whenever it exists: run
    in the SPEC's folder, the second fit resumed the first's (and trained 0 steps), and the file
    stayed there for the next session. Its working directory is its checkpoint directory now."""
    repo = repo_with(tmp_path, "snapshot_in_cwd.py")
    (repo / "data").mkdir()
    (repo / "data" / "scale.txt").write_text("2.0")  # read relative to the cwd: still found
    adapter = adapter_for("script:snapshot_in_cwd.py {steps} | snapshot_in_cwd.py {steps}", repo,
                          tmp_path / "work")
    for _ in range(2):
        adapter.fit(3)  # each trains 3 steps: the steps check would stop a fit that resumed the other's
    assert sorted(p.name for p in repo.iterdir()) == ["data", "snapshot_in_cwd.py"]
    assert [sorted(p.name for p in d.iterdir()) for d in fit_dirs(tmp_path / "work")] == [["snapshot.pt"]] * 2
    checkpoint_dir = tmp_path / "work" / "ckpt"
    adapter.fit(2, checkpoint_dir=checkpoint_dir, checkpoint_at=2)
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == ["snapshot.pt"]  # the links to data/ are gone
    adapter.resume(checkpoint_dir / "snapshot.pt", 5)  # 3 steps from its snapshot, else the steps check says 5
    assert adapter.conformance_notes == []


WRITES_INTO_DATA = """
    from pathlib import Path

    import torch

    Path("data/cache.txt").write_text("written through the link")
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
"""


def test_files_written_into_the_spec_folder_are_named(tmp_path):
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "train.py").write_text(textwrap.dedent(WRITES_INTO_DATA))
    adapter = adapter_for("script:train.py", repo, tmp_path / "work")
    adapter.fit(1)
    assert adapter.conformance_notes == [f"train.py (fit line) wrote data/cache.txt in {repo}, outside "
                                         "{checkpoint_dir}: files a later fit or session may read"]


WRITES_OVER_LINKED_FILES = """
    import os
    import sys

    import torch

    out = sys.argv[1]  # the output directory, as the Trainer's --output_dir: the fit's working directory
    with open(os.path.join(out, "README.md"), "w") as card:  # the Trainer's model card
        card.write("model card")
    with open("notes.txt", "a") as notes:  # appended to: the script's own copy of the base's file grows
        notes.write(" and more")
    fd = os.open("config.json", os.O_WRONLY | os.O_TRUNC)  # os.open, as a library may
    os.write(fd, b"{}")
    os.close(fd)
    with open("vocab.txt") as vocab:  # read: still the base's, through its link
        assert vocab.read() == "a b c"
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
"""


def test_a_file_the_script_writes_over_a_linked_base_file_is_its_own_and_the_base_s_is_unchanged(tmp_path):
    """The transformers Trainer writes its model card to `output_dir/README.md`; the fit's working directory (its
    output directory) held a link to the script folder's README.md, so the card replaced the user's README.
    Every write through a file link, by `open` or `os.open`, truncating or appending, now goes to a file of the
    working directory's own, and a note says so."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(textwrap.dedent(WRITES_OVER_LINKED_FILES))
    originals = {"README.md": "the user's README", "notes.txt": "notes", "config.json": '{"a": 1}',
                 "vocab.txt": "a b c"}
    for name, text in originals.items():
        (repo / name).write_text(text)
    adapter = adapter_for("script:train.py {checkpoint_dir}", repo, tmp_path / "work")
    adapter.fit(1)
    [checkpoint_dir] = fit_dirs(tmp_path / "work")
    assert {name: (repo / name).read_text() for name in originals} == originals
    assert {p.name: p.read_text() for p in checkpoint_dir.iterdir()} == {
        "README.md": "model card", "notes.txt": "notes and more", "config.json": "{}"}  # the links are gone
    assert adapter.conformance_notes == [
        f"the script wrote README.md, notes.txt, config.json into {{checkpoint_dir}}, where the harness linked the "
        f"file of that name in {repo} for it to read: it wrote a file of its own there, and {repo}'s is unchanged"]


SPLITS_THEN_SEEDS = """
    import torch

    drawn = torch.randperm(1000)[:8].tolist()  # an unseeded random_split's draw
    with open("drawn.txt", "w") as out:
        out.write(repr(drawn))
    torch.manual_seed(0)  # seeded only after it, as the model is
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
"""


def test_every_fit_starts_from_fresh_seeds_as_a_new_torchrun_process(tmp_path):
    """A script that seeds after an unseeded draw left its seed to the next fit in the same rank, so
    the next fit's draw was the same on every rank (a per-rank random_split went unseen)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(textwrap.dedent(SPLITS_THEN_SEEDS))
    adapter = adapter_for("script:train.py", repo, tmp_path / "work")
    draws = []
    for _ in range(3):
        adapter.fit(1)
        newest = max(fit_dirs(tmp_path / "work"), key=lambda d: d.stat().st_mtime_ns)
        draws.append((newest / "drawn.txt").read_text())
    assert len(set(draws)) == 3, draws


def test_a_snapshot_an_earlier_run_left_in_the_spec_folder_is_not_shown(tmp_path):
    repo = repo_with(tmp_path, "snapshot_in_cwd.py")
    (repo / "data").mkdir()
    (repo / "data" / "scale.txt").write_text("2.0")
    (repo / "snapshot.pt").write_bytes(b"left by a run here")  # torch.load would fail on it
    adapter = adapter_for("script:snapshot_in_cwd.py {steps}", repo, tmp_path / "work")
    adapter.fit(2)
    assert (repo / "snapshot.pt").read_bytes() == b"left by a run here"
    assert any(n.startswith("not shown to the script: snapshot.pt in ") for n in adapter.conformance_notes)


# -- directory placeholders and "no checkpoint" ------------------------------------------------------

NANOGPT = ("script:out_dir.py --out_dir={checkpoint_dir} --max_iters={steps} --eval_interval={checkpoint_at:-100000}"
           " | out_dir.py --out_dir={checkpoint_dir} --max_iters={steps} --eval_interval=100000 --init_from=resume")


def test_a_script_that_resumes_from_its_out_dir(tmp_path):
    """nanoGPT resumes from --out_dir (a directory holding ckpt.pt): the resume line's
    {checkpoint_dir} is a fresh copy of the checkpoint's directory; an eval interval of {checkpoint_at}
    without a checkpoint was 0 and divided by zero."""
    import torch

    repo = repo_with(tmp_path, "out_dir.py")
    adapter = adapter_for(NANOGPT, repo, tmp_path / "work")
    adapter.fit(3)  # no checkpoint: --eval_interval=100000, not 0
    checkpoint_dir = tmp_path / "work" / "ckpt"
    adapter.fit(2, checkpoint_dir=checkpoint_dir, checkpoint_at=2)  # saved at the top of iteration 2, then ended
    saved = torch.load(checkpoint_dir / "ckpt.pt")
    assert saved["iter_num"] == 2 and saved["weight"].tolist() == pytest.approx([0.8, 0.8])
    for _ in range(2):  # resume_fidelity resumes one checkpoint twice: each reads it as the fit wrote it
        adapter.resume(checkpoint_dir / "ckpt.pt", 5)  # counted from step 2: 3 steps, else one line
    assert torch.load(checkpoint_dir / "ckpt.pt")["iter_num"] == 2


def test_without_a_resume_line_a_checkpointing_fit_is_not_provided(tmp_path):
    """resume_fidelity's fit to the checkpoint step skips naming the missing resume line, rather than
    failing because a script with nothing to resume from wrote no checkpoint."""
    repo = repo_with(tmp_path, "counts_iters.py")
    adapter = adapter_for("script:counts_iters.py --max_iters {steps}", repo, tmp_path / "work")
    with pytest.raises(NotProvided, match="has no resume command line"):
        adapter.fit(2, checkpoint_dir=tmp_path / "ckpt", checkpoint_at=2)


# -- steps taken against steps asked -----------------------------------------------------------------

def test_a_script_that_begins_more_steps_is_ended_at_the_steps_asked_and_the_flag_named(tmp_path):
    """nanoGPT's --max_iters counts from 0 inclusive (fit(4) trained 5 steps and passed silently): the
    harness ends it after step 4, and says which argument to look at."""
    repo = repo_with(tmp_path, "out_dir.py")
    adapter = adapter_for(NANOGPT, repo, tmp_path / "work")
    adapter.fit(4)
    assert adapter.conformance_notes == [
        "fit(4): the script began optimizer step 5 and was ended after step 4: does the argument "
        "'--max_iters={steps}' count from 0, or count something else than optimizer steps?"]


@pytest.mark.parametrize(("spec", "message"), [
    ("script:counts_iters.py --max_iters {steps}",
     "fit(4) took 2 optimizer steps, not 4: the argument '--max_iters {steps}' does not give the script its "
     "optimizer steps (does that flag count micro-batches, or epochs?)"),
    ("script:counts_iters.py --max_iters={steps}",
     "fit(4) took 2 optimizer steps, not 4: the argument '--max_iters={steps}' does not give the script its "
     "optimizer steps"),
    # hard-coded steps: ended at its 5th step, not left to run 30
    ("script:out_dir.py --out_dir {checkpoint_dir} --max_iters 30 --eval_interval {checkpoint_at:-100}",
     "fit(4) took more than 4 optimizer steps, not 4: no argument of its fit line carries {steps} or {epochs}"),
    ("script:counts_iters.py --max_iters 2 --accumulate 1",
     "fit(4) took 2 optimizer steps, not 4: no argument of its fit line carries {steps} or {epochs}"),
])
def test_steps_taken_other_than_asked_stop_the_checks_naming_the_argument(tmp_path, spec, message):
    repo = repo_with(tmp_path, "counts_iters.py", "out_dir.py")
    adapter = adapter_for(spec, repo, tmp_path / "work")
    with pytest.raises(TrainerBuildError) as caught:
        adapter.fit(4)
    text = str(caught.value)
    assert text.startswith(f"trainer SPEC {spec!r}: ") and "\n" not in text
    assert message in text, text



@pytest.mark.parametrize("overflow_at", [1, 2, 3])
def test_a_step_its_grad_scaler_skips_counts_as_the_script_counts_it(tmp_path, overflow_at):
    """minGPT with AMP: a NaN loss made every rank's GradScaler skip that step (no optimizer.step() runs), which
    its loop counts as a step; counting only optimizer.step() refused the run as "fit(3) took 2 optimizer
    steps, not 3". The first step skipped too (the main optimizer is first seen in scaler.step), or the last."""
    from ddp_conformance.checks.support.observe import FitRecorder

    repo = repo_with(tmp_path, "grad_scaler_skips.py")
    adapter = adapter_for(f"script:grad_scaler_skips.py --max_iters {{steps}} --overflow-at {overflow_at}", repo,
                          tmp_path / "work")
    with FitRecorder() as recorder:  # as a check records it: its GradScaler wrapper under the counter's
        adapter.fit(3)
    assert recorder.record.optimizer_steps == 3 and adapter.conformance_notes == []


def test_a_skipped_step_past_the_steps_asked_ends_the_script_there(tmp_path):
    repo = repo_with(tmp_path, "grad_scaler_skips.py")
    adapter = adapter_for("script:grad_scaler_skips.py --max_iters 4 --overflow-at 4", repo, tmp_path / "work")
    with pytest.raises(TrainerBuildError, match=r"fit\(3\) took more than 3 optimizer steps, not 3: no argument"):
        adapter.fit(3)


# -- epoch-based scripts -----------------------------------------------------------------------------

EPOCHS = ("script:epochs.py --epochs {epochs} --save-dir {checkpoint_dir}"
          " | epochs.py --epochs {epochs} --resume {checkpoint}")


def test_an_epoch_script_runs_for_the_steps_asked_and_checkpoints_at_epoch_ends(tmp_path):
    import torch

    repo = repo_with(tmp_path, "epochs.py")
    adapter = adapter_for(EPOCHS, repo, tmp_path / "work")
    assert adapter.checkpoint_every == "epoch"  # resume_fidelity checkpoints it at an epoch's end
    adapter.fit(4)  # 3 steps an epoch: ended after step 4, mid-epoch
    checkpoint_dir = tmp_path / "work" / "ckpt"
    checkpoint_dir.mkdir()
    adapter.fit(6, checkpoint_dir=checkpoint_dir, checkpoint_at=6)  # ended after its second epoch's save
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == ["epoch0.pt", "epoch1.pt"]
    adapter.resume(checkpoint_dir / "epoch1.pt", 8)  # 2 steps from step 6: the steps check counts them
    assert torch.load(checkpoint_dir / "epoch1.pt")["epoch"] == 1


def test_an_epoch_script_that_ignores_its_epochs_is_one_line(tmp_path):
    repo = repo_with(tmp_path, "epochs.py")
    adapter = adapter_for("script:epochs.py --epochs {epochs} --ignore-epochs", repo, tmp_path / "work")
    with pytest.raises(TrainerBuildError, match=r"fit\(5\) took 3 optimizer steps, not 5: the argument "
                                                r"'--epochs \{epochs\}' gave it 5 epochs"):
        adapter.fit(5)


# -- SPEC mistakes: one line each --------------------------------------------------------------------

@pytest.mark.parametrize(("body", "reason"), [
    ("train.py --steps {steps} | train.py --out {checkpoint.parent}",
     "argument '{checkpoint.parent}': {checkpoint.parent} is not a placeholder (expected {name} or "
     "{checkpoint_at:-N}; the directory holding the checkpoint is {checkpoint_dir})"),
    ("train.py --steps {steps} | train.py --at {checkpoint_step}",
     "{checkpoint_step} is not a placeholder of the resume line (known there: {steps}, {epochs}, {checkpoint_dir}, "
     "{checkpoint}, {checkpoint_at}, {checkpoint_latest}"),
    ("train.py --resume {checkpoint}", "{checkpoint} is not a placeholder of the fit line"),
    ("train.py --steps {stepz}", "{stepz} is not a placeholder of the fit line"),
    ("train.py --steps {steps:-4}", "only {checkpoint_at} takes a ':-N' default, {steps} is always given"),
    ("train.py --steps {steps!r}", "{steps!r} is not a placeholder (expected {name} or {checkpoint_at:-N})"),
    ("train.py --steps {0}", "{0} is not a placeholder"),
    ("train.py --steps {", "a lone '{' (write '{{' for a literal brace)"),
    ("train.py --steps }", "a lone '}'"),
    ("train.py --x 'unclosed", "cannot split it into arguments: No closing quotation"),
    ("train.py | train.py | train.py", "more than one '|'"),
    ("train.py || train.py", "more than one '|' outside quotes"),
    ("| train.py", "the fit line names no script"),
    ("train.py |", "the resume line names no script"),
    ("missing.py --steps {steps}", "no such script: "),
])
def test_every_script_spec_mistake_is_one_line(tmp_path, body, reason):
    (tmp_path / "train.py").write_text("")
    spec = f"script:{body}"
    with pytest.raises(SpecError) as caught:
        resolve_spec(spec, tmp_path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"trainer SPEC {spec!r}: ")
    assert reason in message, message


def test_a_pipe_without_spaces_separates_the_lines_and_quoted_braces_stay(tmp_path):
    (tmp_path / "train.py").write_text("")
    fit, resume = parse_script_spec("script:train.py --steps={steps}|train.py --resume={checkpoint} --sep '|' "
                                    "--fmt '{{x}}'", tmp_path)
    assert fit.argv({"steps": "4"}) == [str(tmp_path / "train.py"), "--steps=4"]
    assert resume is not None
    assert resume.argv({"checkpoint": "c.pt"}) == [str(tmp_path / "train.py"), "--resume=c.pt", "--sep", "|",
                                                   "--fmt", "{x}"]


def test_checkpoint_at_is_zero_or_its_default_without_a_checkpoint(tmp_path):
    (tmp_path / "train.py").write_text("")
    fit, _ = parse_script_spec("script:train.py --every {checkpoint_at} --eval={checkpoint_at:-100000}", tmp_path)
    assert fit.argv({"checkpoint_at": None})[1:] == ["--every", "0", "--eval=100000"]
    assert fit.argv({"checkpoint_at": "6"})[1:] == ["--every", "6", "--eval=6"]



# -- the config's accumulation, where the command line takes it ---------------------------------------

ACCUMULATES = textwrap.dedent("""\
    import argparse, pathlib, torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--grad-accum", type=int, default=8)
    args = parser.parse_args()
    pathlib.Path("accumulation.txt").write_text(str(args.grad_accum))
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(args.steps):
        for _ in range(args.grad_accum):
            (weight.sum() / args.grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad()
""")


def test_accumulate_grad_batches_gives_the_script_the_configs_k(tmp_path):
    """The config's accumulate_grad_batches reaches a script only through the placeholder: then a check can also
    run it at 1 (accumulation_equivalence's reference); without it the config is a claim, compared with the run."""
    from dataclasses import replace

    (tmp_path / "train.py").write_text(ACCUMULATES)
    carried = ScriptAdapter("script:train.py --steps {steps} --grad-accum {accumulate_grad_batches}", tmp_path)
    config = RunConfig()
    carried.setup(replace(config, trainer=replace(config.trainer, accumulate_grad_batches=4)),
                  RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cpu",
                              workdir=tmp_path / "work"))
    assert carried.carries_accumulation
    carried.fit(2, checkpoint_dir=tmp_path / "fit")
    assert (tmp_path / "fit" / "accumulation.txt").read_text() == "4"
    assert not adapter_for("script:train.py --steps {steps}", tmp_path, tmp_path / "work2").carries_accumulation
