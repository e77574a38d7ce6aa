"""A plain-torch Trainer class (examples/trainer_class): a 13-line adapter class, epoch-end snapshots
declared with `checkpoint_every = "epoch"`, gated by the suite; its broken twin (the snapshot's epoch
counter is never read back) is red with the data position named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SPEC = "conformance_adapter.py:EpochTrainer"  # as the example's pytest.ini names it
CHECKS = ("rank_participation", "sampler_disjointness", "resume_fidelity")


def test_a_trainer_class_is_gated_and_its_broken_twin_is_red(tmp_path: Path) -> None:
    """The example and its twin in ONE session (each session pays a cold rank pool)."""
    repo, twin = tmp_path / "repo", tmp_path / "twin"
    shutil.copytree(ROOT / "examples" / "trainer_class", repo)
    assert f"ddp_trainers = {SPEC}" in (repo / "pytest.ini").read_text()
    shutil.copytree(repo, twin)
    trainer = twin / "trainer.py"
    line = '        self.epochs_run = snapshot["EPOCHS_RUN"]\n'
    assert line in trainer.read_text()
    trainer.write_text(trainer.read_text().replace(line, ""))

    report = repo / "report.json"
    subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "ddp_conformance.suite", "-p", "no:cacheprovider",
                    "--ddp-world-size", "2", f"--ddp-report={report}", "-k", " or ".join(CHECKS),
                    "--ddp-trainer", SPEC, "--ddp-trainer", f"../twin/{SPEC}"], cwd=repo, capture_output=True,
                   text=True, timeout=300)
    results: dict[str, dict[str, dict]] = {}
    for r in json.loads(report.read_text())["results"]:
        results.setdefault(r["trainer"], {})[r["check"]] = r
    good = results[SPEC]
    assert {c: r["outcome"] for c, r in good.items()} == dict.fromkeys(CHECKS, "passed"), good
    assert good["resume_fidelity"]["figures"]["checkpoint_cadence"] == "epoch"
    red = results[f"../twin/{SPEC}"]["resume_fidelity"]
    assert red["outcome"] == "failed" and red["message"].startswith("the data position is not restored"), red
