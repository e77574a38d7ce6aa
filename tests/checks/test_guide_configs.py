"""Both references pass every check with every guide config in fixtures/configs/, world size 2: a check's
tolerance or skip that holds for the suite's own config (test_suite.py) must hold for the settings users copy
from the guides too (BatchNorm with sync_batchnorm, bf16-mixed, static_graph with accumulation, bucket caps
of 25-100 MB and 0.001 MB). A check that cannot apply to a config skips with the words `NOT_APPLICABLE`
allows (no BatchNorm, fp32, the flag off, no join, no accumulation); any other outcome fails.
The same on a GPU is tests/checks/test_cuda_suite.py's. One nested session per config (slow: ~15 s each).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_conformance.checks import DEFAULT_CHECKS
from tests.checks.test_suite import REFERENCES, not_applicable, run_nested

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "fixtures" / "configs").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_both_references_pass_every_check_with_every_guide_config(tmp_path: Path, config: Path) -> None:
    session = run_nested(tmp_path, [(spec, check) for spec in REFERENCES for check in DEFAULT_CHECKS], config)
    judged = {}
    for spec in REFERENCES:
        results = session["results"][spec]
        assert list(results) == list(DEFAULT_CHECKS), session["proc"].stdout[-3000:]
        judged[spec] = {check: r["outcome"] for check, r in results.items() if not not_applicable(check, r)}
        wrong = {check: r["message"] for check, r in results.items()
                 if r["outcome"] != "passed" and not not_applicable(check, r)}
        assert not wrong, f"{spec} with {config.name}: {wrong}"
    assert judged["torch"] == judged["lightning"], judged  # the two references are judged alike
