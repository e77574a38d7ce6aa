"""Drawn scenarios (hypothesis): world size 1-4, dataset sizes that world size x batch does not divide,
drop_last, shuffle, accumulation, and the checkpoint step (the torch reference declares a drawn
checkpoint cadence: any step, epoch ends, every 1-3 steps, from which resume_fidelity places its
checkpoint). In every drawn scenario the reference passes every check, and each mutant here (at its
own cadence) is caught wherever its bug can show:

- no_set_epoch (the same shuffle every epoch) shows in sampler_disjointness only when the loader
  shuffles, every rank reads at least two samples an epoch and the observed positions reach the
  order rule's minimum (`sampling.ORDER_MIN_SIZE`); and in resume_fidelity whenever the checkpoint
  falls mid-epoch (an epoch of at least 3 steps): its resumable loader keys the position on the
  sampler's epoch, which this mutant never sets, so a mid-epoch resume replays the epoch;
- world_scaled_loss (loss / world size on top of DDP's averaging) can show only above one rank;
- ckpt_no_rng (no RNG state in the checkpoint) shows always: the check forces dropout.

One nested pytest session per scenario runs all four trainers (a session costs a cold rank pool), and
the default run takes the one fixed scenario below (world size 3, ~35 s); `DDP_SCENARIOS=N` adds N
drawn ones (measured: 4 drawn scenarios in 167 s on the 2-core machine).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from ddp_conformance.checks import DEFAULT_CHECKS
from ddp_conformance.checks.support.sampling import ORDER_MIN_SIZE

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "fixtures" / "mutants"
MUTANT_SPECS = [f"{MUTANTS / name}.py:Trainer" for name in ("no_set_epoch", "world_scaled_loss", "ckpt_no_rng")]
# the torch reference, declaring the drawn checkpoint cadence (so the checkpoint step is drawn too)
REFERENCE = """\
from ddp_conformance.trainers.torch_ref import TorchTrainer


class Trainer(TorchTrainer):
    checkpoint_every = {cadence!r}
"""


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    world = draw(st.integers(1, 4))
    batch = draw(st.integers(2, 4))
    accumulate = draw(st.integers(1, 2))
    drop_last = draw(st.booleans())
    # at least two optimizer steps an epoch on every rank, and a size world x batch does not divide
    size = draw(st.integers(2 * world * batch * accumulate + 1, 2 * world * batch * accumulate + 12)
                .filter(lambda n: n % (world * batch) != 0))
    return {"world": world, "cadence": draw(st.sampled_from([None, "epoch", 1, 2, 3])), "config": {
        "seed": draw(st.integers(0, 9)),
        "trainer": {"accumulate_grad_batches": accumulate, "strategy": {"gradient_as_bucket_view": True}},
        "data": {"size": size, "batch_size": batch, "shuffle": draw(st.booleans()), "drop_last": drop_last,
                 "seed": draw(st.integers(0, 9))},
    }}


# checks the drawn configs do not vary: they train in fp32 without BatchNorm (on CPU sync_batchnorm could only
# skip), and what initial_sync, bucket_cap_mb_invariance and static_graph judge does not depend on the data or
# the world drawn; the reference never enters DDP's join, so uneven_inputs only says so, nor declares an elastic
# resume, which elastic_resume's skip says
NOT_DRAWN = ("bucket_view_memory", "sync_batchnorm", "mixed_precision", "initial_sync", "bucket_cap_mb_invariance",
             "static_graph", "uneven_inputs", "elastic_resume")


def run_scenario(tmp: Path, scenario: dict) -> dict[str, dict[str, dict]]:
    config, report, reference = tmp / "scenario.yaml", tmp / "report.json", tmp / "reference.py"
    config.write_text(yaml.safe_dump(scenario["config"]))
    reference.write_text(REFERENCE.format(cadence=scenario["cadence"]))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "ddp_conformance.suite",
               "--ddp-world-size", str(scenario["world"]), "--ddp-timeout", "30", "--ddp-config", str(config),
               "--ddp-report", str(report), "-k", " and ".join(f"not {check}" for check in NOT_DRAWN)]
    for trainer in [f"{reference}:Trainer", *MUTANT_SPECS]:
        command += ["--ddp-trainer", trainer]
    proc = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=400)
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-2000:]
    results: dict[str, dict[str, dict]] = {}
    for entry in json.loads(report.read_text())["results"]:
        results.setdefault(Path(entry["spec"].split(":")[0]).stem, {})[entry["check"]] = entry
    return results


def per_rank_samples(scenario: dict) -> int:
    data, world = scenario["config"]["data"], scenario["world"]
    return data["size"] // world if data["drop_last"] else math.ceil(data["size"] / world)


def order_can_show(scenario: dict) -> bool:
    per_rank = per_rank_samples(scenario)
    return scenario["config"]["data"]["shuffle"] and per_rank >= 2 and per_rank * scenario["world"] >= ORDER_MIN_SIZE


def epoch_steps(scenario: dict) -> int:
    config = scenario["config"]
    batches = math.ceil(per_rank_samples(scenario) / config["data"]["batch_size"])
    return math.ceil(batches / config["trainer"]["accumulate_grad_batches"])


DRAWN = int(os.environ.get("DDP_SCENARIOS", "0"))


@settings(max_examples=max(DRAWN, 1), phases=[Phase.explicit, Phase.generate] if DRAWN else [Phase.explicit],
          deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(scenario=scenarios())
# always: an odd world, a size it does not divide, accumulation, a checkpoint every 2 steps
@example(scenario={"world": 3, "cadence": 2, "config": {
    "seed": 1, "trainer": {"accumulate_grad_batches": 2, "strategy": {"gradient_as_bucket_view": True}},
    "data": {"size": 41, "batch_size": 3, "shuffle": True, "drop_last": True, "seed": 2}}})
def test_references_pass_and_mutants_are_caught_in_drawn_scenarios(tmp_path_factory: pytest.TempPathFactory,
                                                                  scenario: dict) -> None:
    results = run_scenario(tmp_path_factory.mktemp("scenario"), scenario)
    checks = [c for c in DEFAULT_CHECKS if c not in NOT_DRAWN]
    reference = {c: (r["outcome"], r["message"]) for c, r in results["reference"].items()}
    accumulation, reason = reference.pop("accumulation_equivalence")
    assert all(outcome == "passed" for outcome, _ in reference.values()), (scenario, reference)
    # judged where the drawn config accumulates and the first window's micro-batches are equal (a short epoch
    # can end a window early: one process cannot recompute a mean over unequal micro-batches)
    if scenario["config"]["trainer"]["accumulate_grad_batches"] == 1:
        assert accumulation == "skipped" and "asks for no gradient accumulation" in reason, (scenario, reason)
    else:
        assert accumulation == "passed" or "micro-batches differ in size" in reason, (scenario, reason)
    assert list(results["reference"]) == checks
    cadence = results["reference"]["resume_fidelity"]["figures"]["checkpoint_cadence"]
    assert cadence == (scenario["cadence"] or "any step")
    expected = {
        "no_set_epoch": {"sampler_disjointness": order_can_show(scenario),
                         "resume_fidelity": epoch_steps(scenario) >= 3},
        "world_scaled_loss": {"gradient_equivalence": scenario["world"] > 1},
        "ckpt_no_rng": {"resume_fidelity": True},
    }
    for mutant, shows in expected.items():
        outcomes = {c: r["outcome"] for c, r in results[mutant].items()}
        failed = {c for c, o in outcomes.items() if o == "failed"}
        messages = {c: results[mutant][c]["message"] for c in failed}
        assert failed == {check for check, show in shows.items() if show}, (mutant, scenario, outcomes, messages)
