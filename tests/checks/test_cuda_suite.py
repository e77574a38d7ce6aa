"""The conformance suite on real GPUs: both references, with the guides' basic and advanced configs and
an fp16 variant of advanced, every rank on the GPU (`--ddp-device cuda`: gloo with the ranks sharing one
GPU on a one-GPU runner, nccl with a GPU each on a larger one). SyncBatchNorm, bf16/fp16 autocast with
a GradScaler and the CUDA memory counters run for real here; on CPU they are only decided.

These run wherever CUDA is present (a GPU CI runner) and skip with the reason elsewhere. The nested
sessions see every GPU: this run's pytest-xdist worker variables are removed (see tests/runner/test_cuda.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: torch.cuda.is_available() is False")

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


@pytest.fixture(autouse=True)
def every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nested sessions see every GPU, whatever pytest-xdist worker runs them."""
    for variable in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)


def config_file(tmp: Path, name: str) -> Path:
    if name != "fp16":
        return CONFIGS / f"{name}.yaml"
    config = yaml.safe_load((CONFIGS / "advanced.yaml").read_text())
    config["trainer"]["precision"] = "16-mixed"
    path = tmp / "fp16.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", ["basic", "advanced", "fp16"])
def test_references_pass_every_check_on_the_gpu(
    pytester: pytest.Pytester, name: str, world_size: int
) -> None:
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "--ddp-trainer", "torch",
        "--ddp-trainer", "lightning", f"--ddp-config={config_file(pytester.path, name)}", "--ddp-device", "cuda",
        "--ddp-world-size", str(world_size), f"--ddp-report={report}", "-rs",
    )
    results = json.loads(report.read_text())["results"]
    failed = [(r["trainer"], r["check"], r["message"]) for r in results if r["outcome"] == "failed"]
    assert not failed, result.stdout.str()
    by_check = {(r["trainer"], r["check"]): r for r in results}
    for trainer in ("torch", "lightning"):
        figures = by_check[(trainer, "gradient_equivalence")]["figures"]
        assert by_check[(trainer, "gradient_equivalence")]["outcome"] == "passed", figures
        assert figures["precision"] == {"basic": "32-true", "advanced": "bf16-mixed", "fp16": "16-mixed"}[name]
        bucket = by_check[(trainer, "bucket_view_memory")]["figures"]
        assert bucket.get("memory_counter") == "torch.cuda.max_memory_allocated", bucket
    assert "SyncBatchNorm was not exercised" not in result.stdout.str()


def test_sync_batchnorm_passes_the_references_and_controls_and_names_the_mutants_on_the_gpu(
    pytester: pytest.Pytester
) -> None:
    """Every fixture that concerns sync_batchnorm, with the guide's basic config (BatchNorm, sync_batchnorm:
    true), world size 2 on whatever GPUs there are: the only place its mutants (`BREAKS_ON_CUDA`) can fail."""
    from ddp_conformance.checks.sync_batchnorm import TOLERANCE
    from tests.checks.test_suite import MUTANTS, declared, spec_of

    fixtures = [path for path in MUTANTS if "sync_batchnorm" in declared(path, "BREAKS_ON_CUDA", set())
                or "sync_batchnorm" in declared(path, "CONCERNS", ())]
    assert len(fixtures) >= 3
    report = pytester.path / "report.json"
    trainers = [arg for spec in ["torch", "lightning", *map(spec_of, fixtures)] for arg in ("--ddp-trainer", spec)]
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "-k", "sync_batchnorm", *trainers,
        f"--ddp-config={CONFIGS / 'basic.yaml'}", "--ddp-device", "cuda", "--ddp-world-size", "2",
        f"--ddp-report={report}", "-rs",
    )
    by_spec = {r["spec"]: r for r in json.loads(report.read_text())["results"]}
    for path in fixtures:
        row = by_spec[spec_of(path)]
        if declared(path, "CONTROL", ""):
            assert row["outcome"] == "passed", (path.name, row["message"], result.stdout.str())
            continue
        assert row["outcome"] == "failed", (path.name, row)
        for phrase in declared(path, "DIAGNOSIS_ON_CUDA")["sync_batchnorm"]:
            assert phrase in row["message"], (path.name, row["message"])
    for spec in ("torch", "lightning"):
        row = by_spec[spec]
        assert row["outcome"] == "passed", (spec, row["message"])
        assert row["figures"]["synced_layers"] == row["figures"]["batchnorm_layers"] == 2, row["figures"]
        assert row["figures"]["max_deviation"] <= TOLERANCE, row["figures"]


def test_mixed_precision_passes_the_references_and_controls_and_names_the_mutants_on_the_gpu(
    pytester: pytest.Pytester
) -> None:
    """The fixtures that concern mixed_precision at bf16-mixed (the advanced config), those that break it
    only with 16-mixed's GradScaler (`BREAKS_ON_CUDA`) at 16-mixed, the controls and the references at both."""
    from tests.checks.test_suite import MUTANTS, declared, spec_of

    # a torchrun script's precision is its own, whatever the config: those controls are judged by the CPU run
    controls = [path for path in MUTANTS if "mixed_precision" in declared(path, "CONCERNS", ())
                and not spec_of(path).startswith("script:")]
    breaks = {"advanced": ("BREAKS", "DIAGNOSIS"), "fp16": ("BREAKS_ON_CUDA", "DIAGNOSIS_ON_CUDA")}
    for name, (breaks_name, diagnosis_name) in breaks.items():
        mutants = [path for path in MUTANTS if "mixed_precision" in declared(path, breaks_name, set())]
        assert mutants and controls
        report = pytester.path / f"report-{name}.json"
        specs = ["torch", "lightning", *map(spec_of, mutants + controls)]
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "-k", "mixed_precision",
            *[arg for spec in specs for arg in ("--ddp-trainer", spec)],
            f"--ddp-config={config_file(pytester.path, name)}", "--ddp-device", "cuda", "--ddp-world-size", "2",
            f"--ddp-report={report}",
        )
        by_spec = {r["spec"]: r for r in json.loads(report.read_text())["results"]}
        for path in mutants:
            row = by_spec[spec_of(path)]
            assert row["outcome"] == "failed", (name, path.name, row)
            for phrase in declared(path, diagnosis_name)["mixed_precision"]:
                assert phrase in row["message"], (name, path.name, row["message"])
        precision = {"fp16": "16-mixed", "advanced": "bf16-mixed"}[name]
        for spec in ["torch", "lightning", *map(spec_of, controls)]:
            row = by_spec[spec]
            assert row["outcome"] == "passed" and row["figures"]["precision"] == precision, (name, spec, row,
                                                                                               result.stdout.str())
            assert row["figures"]["max_rel_delta"] > 0, row["figures"]


#: judged above, per precision and with the fixtures' CUDA declarations (`BREAKS_ON_CUDA`)
JUDGED_ABOVE = {"sync_batchnorm", "mixed_precision"}


def test_every_other_check_judges_the_references_and_fixtures_on_the_gpu_as_on_the_cpu(
    tmp_path: Path
) -> None:
    """test_suite.py's default matrix (the references on every check, each fixture on the checks it declares or
    concerns), every rank on the GPU: each check that runs on the CPU too must give the same verdicts there,
    from the same declarations. All disagreements are collected, so one GPU run shows them all."""
    from ddp_conformance.checks import CHECK_IDS, DEFAULT_CHECKS
    from tests.checks.test_suite import (
        MUTANTS,
        REFERENCES,
        assert_as_declared,
        not_applicable,
        planned,
        run_grouped,
        spec_of,
    )

    checks = [check for check in CHECK_IDS if check not in JUDGED_ABOVE]
    pairs: list[tuple[str | Path, str]] = [(spec, check) for spec in REFERENCES for check in checks]
    pairs += [(path, check) for path in MUTANTS for check in planned(path) if check in checks]
    session = run_grouped(tmp_path, pairs, "--ddp-device", "cuda")
    counters = {session["results"][spec]["bucket_view_memory"]["figures"].get("memory_counter") for spec in REFERENCES}
    assert counters == {"torch.cuda.max_memory_allocated"}, counters  # the ranks trained on the GPU
    disagreements = {}
    for spec in REFERENCES:
        results = session["results"][spec]
        failed = {c: r["message"] for c, r in results.items()
                  if c in DEFAULT_CHECKS and r["outcome"] != "passed" and not not_applicable(c, r)}
        if failed:
            disagreements[spec] = failed
    for path in MUTANTS:
        try:
            assert_as_declared(path, session["results"].get(spec_of(path), {}), on_gpu=True)
        except AssertionError as error:
            disagreements[path.stem] = str(error)
    assert not disagreements, json.dumps(disagreements, indent=1)


def test_a_rank_0_only_collective_at_an_epoch_end_is_named_under_the_gpu_backend(pytester: pytest.Pytester) -> None:
    """The hang fixtures whose code follows the harness's device (a class trainer, a LightningModule; the torchrun
    script's is gloo on the CPU by its own hand), on the GPUs (nccl where there is a GPU a rank): one failure,
    rank_participation's, naming rank 0's gather and where the ranks parted; every other check skips naming it."""
    from ddp_conformance.checks.support import collectives
    from tests.checks.test_suite import MUTANTS, spec_of

    fixtures = [path for path in MUTANTS
                if path.name in ("rank0_evaluates_at_epoch_end.py", "lightning_rank0_gathers_at_epoch_end.py")]
    assert len(fixtures) == 2
    report = pytester.path / "report.json"
    pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "--ddp-checks", "rank_participation,"
        "sampler_disjointness,initial_sync", *[arg for path in fixtures for arg in ("--ddp-trainer", spec_of(path))],
        "--ddp-device", "cuda", "--ddp-world-size", "2", "--ddp-timeout", "60", f"--ddp-report={report}")
    by_case = {(r["spec"], r["check"]): r for r in json.loads(report.read_text())["results"]}
    for path in fixtures:
        failed = by_case[(spec_of(path), "rank_participation")]
        assert failed["outcome"] == "failed" and failed["message"].startswith("training hangs"), failed
        if collectives.TORCH_RECORDS:
            assert "rank 0 all_gather #" in failed["message"] and "Collectives: rank 0 waits in all_gather #" in \
                failed["message"], failed["message"]
        for check in ("sampler_disjointness", "initial_sync"):
            skipped = by_case[(spec_of(path), check)]
            assert skipped["outcome"] == "skipped" and "hangs (see test" in skipped["message"], skipped
