"""A torchrun script checked by its command line alone (examples/torchrun_script): every check judges
the script's real run (data_consistency reads the dataset its training loader iterated,
gradient_equivalence reruns its first step in a world of one); and a broken twin (its checkpoint
restores no RNG state) is red with the RNG named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIT = "--steps {steps} --ckpt-dir {checkpoint_dir} --ckpt-every {checkpoint_at}"
RESUME = "--steps {steps} --resume {checkpoint}"


def test_a_script_is_checked_by_its_command_line_and_its_broken_twin_is_red(tmp_path: Path) -> None:
    repo, twin = tmp_path / "repo", tmp_path / "twin"
    shutil.copytree(ROOT / "examples" / "torchrun_script", repo)
    shutil.copytree(repo, twin)
    train = twin / "train.py"
    text = train.read_text()
    restore = '        torch.set_rng_state(start["rng"][rank]["torch"])\n'
    assert restore in text
    train.write_text(text.replace(restore, ""))
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pytest", "--pyargs", "ddp_conformance.suite", "-p", "no:cacheprovider",
               "--ddp-world-size", "2", f"--ddp-report={report}", "-k", "not bucket_view_memory"]
    for script in ("train.py", "../twin/train.py"):
        command += ["--ddp-trainer", f"script:{script} {FIT} | {script} {RESUME}"]
    run = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=300)
    results = {(Path(r["spec"].split()[0][len("script:"):]).parent.name or "repo", r["check"]): r
               for r in json.loads(report.read_text())["results"]}
    outcomes = {key: r["outcome"] for key, r in results.items()}
    for check in ("rank_participation", "sampler_disjointness", "data_consistency", "resume_fidelity"):
        assert outcomes[("repo", check)] == "passed", (check, results[("repo", check)]["message"], run.stdout[-2000:])
    # a script reports no losses: that is not evidence that every rank saw the same ones
    assert not any("same losses" in n for n in results[("repo", "rank_participation")]["figures"].get("notes", []))
    # its dataset is the one its training loader iterated in the real run, read on every rank
    assert outcomes[("repo", "data_consistency")] == "passed", results[("repo", "data_consistency")]["message"]
    assert results[("repo", "data_consistency")]["figures"]["dataset_from"] == "the fit's training loader (fit(1))"
    # judged from its run (its nn.Dropout off in both runs): the same script in a world of one on the global batch
    assert outcomes[("repo", "gradient_equivalence")] == "passed", results[("repo", "gradient_equivalence")]["message"]
    assert results[("repo", "gradient_equivalence")]["figures"]["fit_step"] == "judged"
    assert outcomes[("twin", "resume_fidelity")] == "failed" and run.returncode == 1
    assert results[("twin", "resume_fidelity")]["message"].startswith("the RNG state is not restored")
    assert outcomes[("twin", "sampler_disjointness")] == "passed"
