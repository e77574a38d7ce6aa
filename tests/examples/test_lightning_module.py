"""Lightning with no adapter: examples/lightning_module (a LightningModule and a LightningDataModule in
their own files, one line of pytest config) gated by the suite; its broken twins, each the same repo
with one line changed, red with the verdict that names the bug and its remedy; and a LightningModule
that ships with Lightning (BoringModel + BoringDataModule) checked as it is, every verdict pinned.
The two remedies' verdicts: the twin's (no RNG callback) and the demo's (a plain DataLoader).

All of it in ONE nested session (`--ddp-trainer` repeated): each session pays a cold rank pool and
the ranks' first Lightning import. The example's SPEC is read from its pytest.ini, and typed in the
repo's directory, which is what pytest.ini's SPEC is relative to.
"""

from __future__ import annotations

import configparser
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddp_conformance.checks import DEFAULT_CHECKS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_module"
DEMOS = "lightning.pytorch.demos.boring_classes"
BORING = f"lightning:{DEMOS}:BoringModel+{DEMOS}:BoringDataModule"
#: twin -> (file, the line as the example has it, the line with the bug). The other remedy's verdict
#: (a plain DataLoader) is the demo module's below, and the lightning_plain_loader mutant's.
TWINS = {"no_rng_callback": ("model.py", "return [RNGStateCallback()]", "return []")}
#: twin -> words resume_fidelity's verdict must hold: the bug, then the remedy
TWIN_VERDICTS = {
    "no_rng_callback": ("the RNG state is not restored", "add ddp_conformance.lightning.RNGStateCallback() to your "
                        "Trainer's callbacks (or return it from your LightningModule's configure_callbacks)"),
}


def ini_spec(path: Path) -> str:
    parser = configparser.ConfigParser()
    parser.read(path)
    return parser["pytest"]["ddp_trainers"].strip()


def broken_twin(work: Path, name: str) -> Path:
    file, good, bad = TWINS[name]
    twin = work / name
    shutil.copytree(EXAMPLE, twin)
    text = (twin / file).read_text()
    assert text.count(good) == 1, f"{file} no longer has {good!r}"
    (twin / file).write_text(text.replace(good, bad))
    return twin


@pytest.fixture(scope="module")  # --dist loadfile: one worker runs the whole module
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("lightning_example")
    repo = work / "repo"
    shutil.copytree(EXAMPLE, repo)
    spec = ini_spec(repo / "pytest.ini")
    specs = {"example": spec, "boring": BORING}
    for name in TWINS:
        broken_twin(work, name)
        specs[name] = spec.replace("model.py", f"../{name}/model.py").replace("data.py", f"../{name}/data.py")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "ddp_conformance.suite",
               "--ddp-world-size", "2", "--ddp-report", "report.json"]
    for trainer in specs.values():
        command += ["--ddp-trainer", trainer]
    proc = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=240)
    report = repo / "report.json"
    assert report.is_file(), f"no report; pytest said:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    by_spec: dict[str, dict[str, Any]] = {}
    for result in json.loads(report.read_text())["results"]:
        by_spec.setdefault(result["spec"], {})[result["check"]] = result
    return {"proc": proc, "results": {name: by_spec[trainer] for name, trainer in specs.items()}}


# the session runs the modules as they are, in fp32, with no BatchNorm, static_graph off and no accumulation,
# Lightning never enters DDP's join, and no module declares an elastic resume: six checks have nothing to judge
# (static_graph says that --ddp-advise would tell whether the model could take it)
NOT_EXERCISED = {"sync_batchnorm": "skipped", "mixed_precision": "skipped", "static_graph": "skipped",
                 "uneven_inputs": "skipped", "accumulation_equivalence": "skipped", "elastic_resume": "skipped"}


def assert_not_exercised(results: dict[str, Any]) -> None:
    assert "has no BatchNorm layer" in results["sync_batchnorm"]["message"], results["sync_batchnorm"]
    assert "there is no mixed precision to compare" in results["mixed_precision"]["message"]
    assert "static_graph is off in the config: nothing to judge (--ddp-advise" in results["static_graph"]["message"]
    assert "the fit uses no DDP join" in results["uneven_inputs"]["message"], results["uneven_inputs"]
    assert "asks for no gradient accumulation" in results["accumulation_equivalence"]["message"]
    assert "does not declare that it resumes at another world size" in results["elastic_resume"]["message"]


def outcomes(results: dict[str, Any]) -> dict[str, str]:
    return {check: results[check]["outcome"] for check in DEFAULT_CHECKS}


@pytest.mark.slow  # one whole suite session; test_suite.py holds lightning: SPECs to every check
def test_the_example_passes_every_check_with_no_adapter(session: dict[str, Any]) -> None:
    results = session["results"]["example"]
    assert outcomes(results) == {**dict.fromkeys(DEFAULT_CHECKS, "passed"), **NOT_EXERCISED,
                                 "bucket_view_memory": "skipped"}, results
    assert_not_exercised(results)
    assert results["resume_fidelity"]["figures"]["comparison"] == "bitwise"
    assert "too small to measure" in results["bucket_view_memory"]["message"]  # its 1.4 KiB of gradients
    assert session["proc"].returncode == 1  # the twins and the demo are red


@pytest.mark.slow  # one whole suite session; test_suite.py holds lightning: SPECs to every check
@pytest.mark.parametrize("twin", list(TWINS))
def test_each_broken_twin_fails_resume_fidelity_with_the_remedy(session: dict[str, Any], twin: str) -> None:
    results = session["results"][twin]
    assert outcomes(results) == {**outcomes(session["results"]["example"]), "resume_fidelity": "failed"}
    verdict = results["resume_fidelity"]["message"]
    assert "\n" not in verdict
    for words in TWIN_VERDICTS[twin]:
        assert words in verdict, verdict


@pytest.mark.slow  # one whole suite session; test_suite.py holds lightning: SPECs to every check
def test_a_module_that_ships_with_lightning_checked_as_it_is(session: dict[str, Any]) -> None:
    """BoringModel + BoringDataModule (lightning/pytorch/demos/boring_classes.py), judged by its code:
    - `RandomDataset` is `torch.randn(length, size)` without a seed, built in the datamodule's
      `__init__`: every process that does not seed first generates its own data (data_consistency),
      so there is no common global batch (gradient_equivalence skipped);
    - `train_dataloader()` is a plain `DataLoader`: a mid-epoch resume replays the epoch (resume);
      nothing in training is random (no dropout, Lightning's DistributedSampler has its own seed), so
      no RNG verdict;
    - one Linear(32, 2): 264 B of gradients, too small to measure bucket views;
    - Lightning injects a DistributedSampler and calls set_epoch: the sampler check passes;
    - DDP broadcasts rank 0's Linear when it wraps it, and nothing acts per bucket: initial_sync and
      bucket_cap_mb_invariance pass."""
    results = session["results"]["boring"]
    assert outcomes(results) == {
        "rank_participation": "passed", "sampler_disjointness": "passed", "data_consistency": "failed",
        "gradient_equivalence": "skipped", "resume_fidelity": "failed", "bucket_view_memory": "skipped",
        "initial_sync": "passed", "bucket_cap_mb_invariance": "passed", **NOT_EXERCISED}, results
    assert_not_exercised(results)
    assert "is the data generated without a seed" in results["data_consistency"]["message"]
    assert "the ranks' datasets differ" in results["gradient_equivalence"]["message"]
    assert "the data position is not restored" in results["resume_fidelity"]["message"]
    assert ("build it as ddp_conformance.lightning.ResumableDataLoader(...) instead of DataLoader(...)"
            in results["resume_fidelity"]["message"])
    assert "264 B of gradients, too small to measure" in results["bucket_view_memory"]["message"]


def test_the_example_readme_shows_its_one_line_of_config():
    line = f"ddp_trainers = {ini_spec(EXAMPLE / 'pytest.ini')}"
    assert line in (EXAMPLE / "README.md").read_text()
    for words in (*TWIN_VERDICTS["no_rng_callback"], "ResumableDataLoader(...) instead of DataLoader(...)"):
        assert " ".join(words.split()) in " ".join((EXAMPLE / "README.md").read_text().split())
