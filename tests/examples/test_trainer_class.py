"""A plain-torch Trainer class (examples/trainer_class): a 13-line adapter class, epoch-end snapshots
declared with `checkpoint_every = "epoch"`, gated by the suite; its broken twin (the snapshot's epoch
counter is never read back) is red with the data position named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_suite(repo: Path, *extra: str) -> dict[str, dict]:
    report = repo / "report.json"
    subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "ddp_conformance.suite", "-p", "no:cacheprovider",
                    "--ddp-world-size", "2", f"--ddp-report={report}", *extra], cwd=repo, capture_output=True,
                   text=True, timeout=300)
    return {r["check"]: r for r in json.loads(report.read_text())["results"]}


@pytest.mark.slow  # a whole suite session on the example; test_suite.py holds class trainers to every check
def test_a_trainer_class_is_gated_and_its_broken_twin_is_red(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "examples" / "trainer_class", repo)
    results = run_suite(repo, "-k", "rank_participation or sampler_disjointness or resume_fidelity")
    assert {c: r["outcome"] for c, r in results.items()} == dict.fromkeys(
        ["rank_participation", "sampler_disjointness", "resume_fidelity"], "passed"), results
    assert results["resume_fidelity"]["figures"]["checkpoint_cadence"] == "epoch"

    trainer = repo / "trainer.py"
    line = '        self.epochs_run = snapshot["EPOCHS_RUN"]\n'
    assert line in trainer.read_text()
    trainer.write_text(trainer.read_text().replace(line, ""))
    red = run_suite(repo, "-k", "resume_fidelity")["resume_fidelity"]
    assert red["outcome"] == "failed" and red["message"].startswith("the data position is not restored"), red
