"""What a user reads when a conformance check fails: the verdict first, their own frames only, a
trainer that cannot be built reported once, a rank that raised named with its error, and nothing
of the harness (its frames, its source, its warnings). Each case was measured before it was fixed:
581 lines for a trainer whose `__init__` raises, ~40 lines of gradient_equivalence.py's source
above a verdict, and "training hangs: rank 0 stopped" for a rank whose fit raised."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ddp_conformance.checks import DEFAULT_CHECKS
from ddp_conformance.checks.support import collectives
from tests.helpers import failure_report

ROOT = Path(__file__).resolve().parents[2]
SUITE = ["--pyargs", "ddp_conformance.suite", "--ddp-world-size", "2", "-p", "no:cacheprovider"]
INIT_RAISES = """
    from ddp_conformance.trainers.torch_ref import TorchTrainer


    class MyTrainer(TorchTrainer):
        def __init__(self):
            super().__init__()
            raise ValueError("learning_rate must be positive")
    """


def assert_no_harness(text: str) -> None:
    assert "ddp_conformance" not in text and "def run_check" not in text and "def test_conformance" not in text, text


def test_a_trainer_that_cannot_be_built_is_reported_once_with_its_own_traceback(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(init_raises=INIT_RAISES)
    result = pytester.runpytest_subprocess(*SUITE, "--ddp-trainer", "init_raises.py:MyTrainer", "-rs")
    result.assert_outcomes(failed=1, skipped=len(DEFAULT_CHECKS) - 1)
    report = failure_report(result.outlines)
    text = "\n".join(report)
    assert report[1] == ("2 of 2 ranks failed: ranks 0, 1 failed: TrainerBuildError: trainer init_raises.MyTrainer "
                         "could not be built: ValueError: learning_rate must be positive"), text
    assert len(report) <= 11, text
    assert report[-2:] == ["init_raises.py:7: ValueError", ""], text  # the user's frame, and only it
    assert_no_harness(text)
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and skipped[0].startswith(f"SKIPPED [{len(DEFAULT_CHECKS) - 1}]") and skipped[0].endswith(
        ": trainer init_raises.MyTrainer could not be built (see test "
        "test_conformance[init_raises.MyTrainer-rank_participation])"), skipped
    # the whole session, with pytest's header, the matrix (or, where it cannot fit, a list: a line and a
    # two-line note a check), its notes and the -rs line: was 581 lines
    assert len(result.outlines) <= 42 + 3 * len(DEFAULT_CHECKS), (len(result.outlines), result.stdout.str())


@pytest.mark.slow  # the default run proves the skip itself (the test above); this, that it stays one trainer's
def test_a_build_failure_skips_only_that_trainers_checks(pytester: pytest.Pytester) -> None:
    """Remembered per trainer: the reference after it runs its checks (and passes them)."""
    pytester.makepyfile(init_raises=INIT_RAISES)
    result = pytester.runpytest_subprocess(*SUITE, "--ddp-trainer", "init_raises.py:MyTrainer", "--ddp-trainer",
                                           "torch", "-k", "rank_participation or data_consistency", "-v")
    result.assert_outcomes(failed=1, skipped=1, passed=2)
    result.stdout.fnmatch_lines(["*init_raises.MyTrainer-rank_participation] FAILED*",
                                 "*init_raises.MyTrainer-data_consistency] SKIPPED*",
                                 "*torch-rank_participation] PASSED*", "*torch-data_consistency] PASSED*"])


@pytest.mark.parametrize(("style", "most_lines"), [("long", 5), pytest.param("line", 1, marks=pytest.mark.slow)])
def test_a_verdict_is_its_message_without_the_harness_source_or_warnings(
        pytester: pytest.Pytester, style: str, most_lines: int) -> None:
    """A check's verdict is raised by the harness: no frame of it is the user's, so the verdict's
    message is all there is (it was preceded by ~40 lines of gradient_equivalence.py). The harness's
    own float() of a loss that requires grad no longer warns in the user's `[rank 0]` output."""
    mutant = ROOT / "fixtures" / "mutants" / "grads_divided_by_world.py"
    result = pytester.runpytest_subprocess(*SUITE, "--ddp-trainer", f"{mutant}:Trainer", "-k", "gradient_equivalence",
                                           f"--tb={style}")
    result.assert_outcomes(failed=1)
    report = failure_report(result.outlines)
    text = "\n".join(report)
    headline = ("2 of 2 ranks failed: ranks 0, 1 failed: CheckFailed: gradients are exactly 1/2 of the "
                "single-process gradients although the loss is a mean")
    assert len(report) <= most_lines, text
    assert report[0 if style == "line" else 1].startswith(
        headline if style != "line" else f"test_conformance.py::test_conformance[grads_divided_by_world-"
                                         f"gradient_equivalence]: {headline}"), text
    assert_no_harness(text)
    assert "[rank " not in result.stdout.str(), result.stdout.str()  # no output of the ranks at all


@pytest.mark.slow  # a nested suite session; tests/checks/support/test_progress.py judges its stall verdict
def test_a_rank_whose_fit_raised_is_named_with_its_error_and_only_the_waiting_rank_hangs(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(fit_raises="""
        from ddp_conformance.trainers.torch_ref import TorchTrainer


        class MyTrainer(TorchTrainer):
            def fit(self, *args, **kwargs):
                if self.ctx.rank == 0:
                    import a_module_this_machine_lacks  # noqa: F401
                return super().fit(*args, **kwargs)
        """)
    result = pytester.runpytest_subprocess(*SUITE, "--ddp-trainer", "fit_raises.py:MyTrainer",
                                           "-k", "rank_participation")
    result.assert_outcomes(failed=1)
    report = failure_report(result.outlines)
    text = "\n".join(report)
    # the trainer is named as its test id names it (it inherits the reference's own `name = "torch"`)
    assert report[1].startswith("2 of 2 ranks failed: rank 0 failed: AdapterError: trainer fit_raises.MyTrainer: ") \
        and report[1].endswith(
        "fit raised ModuleNotFoundError: No module named 'a_module_this_machine_lacks' (called as fit(3)); "
        "rank 1 failed after it (below)"), text
    assert "training hangs" not in text and "rank 0 stopped" not in text, text
    assert len(report) <= 14, text
    assert "fit_raises.py:7: ModuleNotFoundError" in report, text  # rank 0: the user's frame
    rank1 = report[report.index("_" * 20 + " rank 1 " + "_" * 20) + 1]
    assert rank1.startswith("E   CheckFailed: rank 0 failed with AdapterError: ") and \
        "; rank 1 hangs waiting for it (rank 1 waits before wrapping the model" in rank1, text
    assert_no_harness(text)


RANK_1_STOPS_EARLY = """
    import torch.distributed as dist

    from ddp_conformance.trainers.torch_ref import TorchTrainer


    class MyTrainer(TorchTrainer):
        def fit(self, steps, **kwargs):
            # rank 1 alone decides it has trained enough: rank 0 waits for it in DDP's all-reduce
            return super().fit(min(steps, 1) if dist.get_rank() == 1 else steps, **kwargs)
"""


def test_a_trainer_whose_fit_hangs_is_reported_once_and_its_other_checks_skip(pytester: pytest.Pytester) -> None:
    """One hang, one failure: every later check's fit would wait in the same hang for its own stall window."""
    pytester.makepyfile(stops_early=RANK_1_STOPS_EARLY)
    result = pytester.runpytest_subprocess(*SUITE, "--ddp-trainer", "stops_early.py:MyTrainer", "--ddp-timeout",
                                           "60", "-rs")
    result.assert_outcomes(failed=1, skipped=len(DEFAULT_CHECKS) - 1)
    result.stdout.fnmatch_lines(["*stops_early.MyTrainer / rank_participation failed: training hangs: rank 1 stopped*"])
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and skipped[0].startswith(f"SKIPPED [{len(DEFAULT_CHECKS) - 1}]") and skipped[0].endswith(
        ": trainer stops_early.MyTrainer hangs (see test test_conformance[stops_early.MyTrainer-rank_participation]): "
        "this check's fit would wait in the same hang"), skipped


RANK_0_EVALUATES = """
    import torch.distributed as dist

    from ddp_conformance.trainers.torch_ref import TorchTrainer


    class MyTrainer(TorchTrainer):
        def optimizer_step(self):
            super().optimizer_step()
            if dist.get_rank() == 0 and self.global_step == 2:  # "only the main process evaluates"
                self.evaluate()

        def evaluate(self):
            metrics = [None] * dist.get_world_size()
            dist.all_gather_object(metrics, {"loss": self.losses[-1]})
"""


def test_a_hang_in_different_collectives_names_each_rank_s_collective_and_where_they_part(
        pytester: pytest.Pytester) -> None:
    """Rank 0 alone evaluates after step 2 with a collective; rank 1 goes on into step 3's backward. Both wait in a
    collective, so the hang is told in the stall window (2 s at --ddp-timeout 20), from each rank's flight
    recorder: rank 0 in the all_gather its evaluate called, rank 1 in DDP's gradient all-reduce, parted there."""
    pytester.makepyfile(evaluates=RANK_0_EVALUATES)
    result = pytester.runpytest_subprocess(*SUITE, "--ddp-trainer", "evaluates.py:MyTrainer", "--ddp-timeout", "20",
                                           "--ddp-checks", "rank_participation", f"--ddp-report={pytester.path}/r.json")
    result.assert_outcomes(failed=1)
    verdict = json.loads((pytester.path / "r.json").read_text())["results"][0]["message"]
    if not collectives.TORCH_RECORDS:  # torch 2.4: where progress alone places the ranks, and why no more
        assert verdict.startswith("training hangs: rank 0 stopped at micro-batch 1"), verdict
        assert verdict.endswith(f". Collectives: none recorded: torch {torch.__version__} keeps no flight record of "
                                "gloo's collectives (a newer torch names each rank's collective and where the ranks "
                                "parted)"), verdict
        return
    assert verdict.startswith("training hangs: the ranks' collectives part: the ranks part at #"), verdict
    rank0 = re.search(r"rank 0 all_gather #(\d+) of group (\S+) \(1; evaluates.py:\d+ \(evaluate\)\)", verdict)
    rank1 = re.search(r"rank 1 DDP's gradient all-reduce #(\d+) of group (\S+) \(\d+; backward at torch_ref.py:\d+ "
                      r"\(backward\)\)", verdict)
    assert rank0 and rank1 and rank0.groups() == rank1.groups(), verdict  # the same slot of the same group
    assert "Collectives: rank 0 waits in all_gather #" in verdict, verdict
    assert "rank 1 waits in DDP's gradient all-reduce #" in verdict and "backward of micro-batch 2 at" in verdict
    assert "no progress for 2 s" in verdict, verdict  # both blocked in a collective: one stall window, not four


RANK_1_LEAVES = """
    import os
    import signal

    import torch.distributed as dist

    from ddp_conformance.trainers.torch_ref import TorchTrainer


    class Killed(TorchTrainer):
        def optimizer_step(self):
            super().optimizer_step()
            if dist.get_rank() == 1 and self.global_step == 2:  # the OOM killer takes rank 1
                os.kill(os.getpid(), signal.SIGKILL)


    class Exits(TorchTrainer):
        def optimizer_step(self):
            super().optimizer_step()
            if dist.get_rank() == 1 and self.global_step == 2:
                raise SystemExit(3)
"""


def test_a_rank_that_is_killed_or_exits_mid_fit_fails_one_check_and_the_others_skip(pytester: pytest.Pytester) -> None:
    """Each named with its cause, once: rank 1 killed by SIGKILL (the rank process ends, the pool is rebuilt) or
    leaving with SystemExit (rank 0 left waiting for it); every later check of that trainer skips naming the test."""
    pytester.makepyfile(leaves=RANK_1_LEAVES)
    checks = "rank_participation,sampler_disjointness,initial_sync"
    result = pytester.runpytest_subprocess(*SUITE, "--ddp-trainer", "leaves.py:Killed", "--ddp-trainer",
                                           "leaves.py:Exits", "--ddp-timeout", "20", "--ddp-checks", checks,
                                           f"--ddp-report={pytester.path}/r.json")
    result.assert_outcomes(failed=2, skipped=4)
    results = {(r["trainer"], r["check"]): r for r in json.loads((pytester.path / "r.json").read_text())["results"]}
    killed = results[("leaves.Killed", "rank_participation")]["message"]
    assert "rank 1 died (killed by SIGKILL (9))" in killed, killed
    exits = results[("leaves.Exits", "rank_participation")]["message"]
    assert exits.startswith("rank 1 failed with SystemExit: 3 after 2 micro-batch(es)") and \
        "rank 0 hangs waiting for it" in exits, exits
    for check in ("sampler_disjointness", "initial_sync"):
        assert results[("leaves.Killed", check)]["message"] == (
            "trainer leaves.Killed's rank 1 died (killed by SIGKILL (9)) in test "
            "test_conformance[leaves.Killed-rank_participation]: this check's fit would end the same way")
        assert results[("leaves.Exits", check)]["message"].startswith("trainer leaves.Exits hangs (see test "
                                                                       "test_conformance[leaves.Exits-rank_part")
