"""The PyTorch DDP tutorial's multigpu_torchrun.py shape (fixtures/scripts/ddp_tutorial.py) checked by
its command line: an epoch-only script that snapshots to ./snapshot.pt and resumes from it whenever it
exists. Every fit gets its own working directory (its {checkpoint_dir}), so no fit resumes another's
and nothing stays for the next session; the same script with its epochs hard-coded in the SPEC stops
the trainer's checks with one line naming the SPEC, not a pass."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = "script:ddp_tutorial.py {epochs} 1 | ddp_tutorial.py {epochs} 1"
HARD_CODED = "script:ddp_tutorial.py 5 1"


@pytest.mark.slow  # a whole suite session; tests/trainers/test_script_adapter.py covers each piece in the default run
def test_the_ddp_tutorial_is_checked_by_its_command_line(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "fixtures" / "scripts" / "ddp_tutorial.py", repo)
    stale = repo / "snapshot.pt"  # an earlier run's, at its last epoch: a fit that found it trained nothing
    stale.write_bytes(b"an earlier run's snapshot")
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pytest", "--pyargs", "ddp_conformance.suite", "-p", "no:cacheprovider",
               "--ddp-world-size", "2", f"--ddp-report={report}", "-k", "rank_participation or resume_fidelity",
               "--ddp-trainer", TUTORIAL, "--ddp-trainer", HARD_CODED]
    run = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=300)
    results = {(r["spec"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    assert "INTERNALERROR" not in run.stdout + run.stderr
    participation = results[(TUTORIAL, "rank_participation")]
    assert participation["outcome"] == "passed", run.stdout[-3000:]
    assert f"not shown to the script: snapshot.pt in {repo} (a checkpoint left by an earlier run there; every fit " \
           "starts in a fresh working directory)" in participation["figures"]["notes"]
    # the run config (devices, accelerator, the model's dropout) never reaches a script: no note says the
    # harness changed it for this trainer
    config_notes = [n for (spec, _), r in results.items() if spec == TUTORIAL for n in r["figures"].get("notes", [])
                    if n.startswith(("trainer.", "config "))]
    assert not config_notes, config_notes
    # the resume is judged (the tutorial's snapshot holds no optimizer or RNG state and re-runs its epoch),
    # not a fit that found another fit's snapshot and returned nothing
    resumed = results[(TUTORIAL, "resume_fidelity")]
    assert resumed["outcome"] == "failed" and "TrainState" not in resumed["message"], resumed["message"]
    # its snapshot resumes from the start of the epoch it was written at the end of; nothing in its training
    # draws random numbers (a DataLoader's own seed draw is not the trainer's), and its plain SGD keeps no
    # optimizer state: the position is the one cause
    assert resumed["message"].startswith("the data position is not restored: "), resumed["message"]
    assert "RNG state is not" not in resumed["message"] and "optimizer" not in resumed["message"]
    assert resumed["figures"]["checkpoint"] == "snapshot.pt"
    # no fit's snapshot.pt for the next session, and the earlier run's untouched
    assert sorted(p.name for p in repo.iterdir()) == ["ddp_tutorial.py", "snapshot.pt"]
    assert stale.read_bytes() == b"an earlier run's snapshot"
    first, other = results[(HARD_CODED, "rank_participation")], results[(HARD_CODED, "resume_fidelity")]
    assert first["outcome"] == "failed"
    assert (f"trainer SPEC {HARD_CODED!r}: fit(3) took more than 3 optimizer steps, not 3: no argument of its fit "
            "line carries {steps}") in first["message"], first["message"]
    assert other["outcome"] == "skipped" and "could not be built" in other["message"]
