"""`--ddp-advise` (ini `ddp_advise`): where the config leaves a setting off, what turning it on would give is
measured only on request. Without it bucket_view_memory and static_graph skip without the runs that measure it;
with it they say what it would give. The verdict (a skip) is the same either way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

CHECKS = "bucket_view_memory,static_graph"


NOT_WRAPPED = Path(__file__).resolve().parents[2] / "fixtures" / "mutants" / "not_wrapped.py"


def results(pytester: pytest.Pytester, *options: str) -> dict[str, dict[str, Any]]:
    """The two checks on the torch reference with the default config (both settings off), world size 2, and
    bucket_view_memory on a trainer that never wraps its model (keyed "unwrapped")."""
    report = pytester.path / "report.json"
    report.unlink(missing_ok=True)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "--ddp-trainer",
                                  "torch", "--ddp-trainer", f"{NOT_WRAPPED}:Trainer", "--ddp-world-size", "2",
                                  "--ddp-checks", CHECKS, "--ddp-report", str(report), *options)
    found = json.loads(report.read_text())["results"]
    return {r["check"] if r["spec"] == "torch" else f"unwrapped {r['check']}": r for r in found}


def test_without_it_a_setting_that_is_off_is_skipped_unmeasured_and_with_it_measured(pytester: pytest.Pytester) -> None:
    plain = results(pytester)
    assert {r["outcome"] for r in plain.values()} == {"skipped"}, plain
    view, static = plain["bucket_view_memory"], plain["static_graph"]
    assert "gradient_as_bucket_view is off" in view["message"] and "--ddp-advise" in view["message"], view
    assert view["figures"]["pairs_measured"] == 0 and "saved_pct_of_grad_bytes" not in view["figures"], view
    # the one step of the probe fit (shared), and none measured: the setting is read off wrap
    assert view["figures"]["observed_steps"] == 1 and view["figures"]["shared_fits"] == {"probe": "ran here"}, view
    unwrapped = plain["unwrapped bucket_view_memory"]["message"]
    assert unwrapped.startswith("the model is not wrapped in DistributedDataParallel"), unwrapped
    assert static["message"].startswith("static_graph is off in the config: nothing to judge (--ddp-advise"), static
    assert "static_fit" not in static["figures"], static

    pytester.makeini("[pytest]\nddp_advise = true\n")  # the ini mirror
    advised = results(pytester)
    assert {r["outcome"] for r in advised.values()} == {"skipped"}, advised
    view, static = advised["bucket_view_memory"], advised["static_graph"]
    assert "turning it on would save" in view["message"] and view["figures"]["pairs_measured"] >= 1, view
    assert "static_graph is off in the config; the model can take it" in static["message"], static
    assert static["figures"]["static_fit"] == "trained", static
    assert advised["unwrapped bucket_view_memory"]["message"] == unwrapped  # the same verdict, measured


NO_BATCH_NEEDED = """
import threading

from ddp_conformance.trainers.torch_ref import TorchTrainer


class Trainer(TorchTrainer):
    name = "no_batch_needed"

    def make_dataset(self, size=None):
        # the fits (in their own threads) build their loaders from it; the check's own thread must not ask
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("bucket_view_memory built a batch for a setting it reads off wrap")
        return super().make_dataset(size)
"""


def test_a_setting_read_off_wrap_builds_no_batch(pytester: pytest.Pytester) -> None:
    """Read without a step, the setting needs no batch either: a Lightning trainer's dataset costs a probe fit."""
    pytester.makepyfile(no_batch_needed=NO_BATCH_NEEDED)
    report = pytester.path / "report.json"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "--ddp-trainer",
                                  "no_batch_needed.py:Trainer", "--ddp-world-size", "2", "--ddp-checks",
                                  "bucket_view_memory", "--ddp-report", str(report))
    [view] = json.loads(report.read_text())["results"]
    assert view["outcome"] == "skipped" and "gradient_as_bucket_view is off" in view["message"], view
