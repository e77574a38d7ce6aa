"""The conformance suite on every mutant in fixtures/mutants/ and on both references, world size 2.

A check that cannot fail is a defect: each mutant declares `BREAKS` (the checks it must fail),
`DIAGNOSIS` (words its verdict must contain, so a failure names the bug; `DIAGNOSIS_RECORDED` adds the words a
hang's verdict holds where torch records gloo's collectives) and `SKIPS` (checks that
cannot judge it, with words their reason must contain); a control (`CONTROL`: correct in an unusual
way) breaks nothing and must only be skipped where it says (the default run asks it the checks its
`CONCERNS` names, the slow test the rest). The session's config (suite.yaml) turns
gradient_as_bucket_view on, so bucket_view_memory judges every trainer that honours its config. The
nested sessions run with `--ddp-advise`, so what a skip for a setting left off says is judged too.

All trainers go through ONE nested pytest session (`--ddp-trainer` repeated): a session per mutant
would pay a cold rank pool and the ranks' first torch/Lightning imports every time. Its
`--ddp-report` JSON is then read per trainer by the parametrized tests below, and its JUnit XML and
terminal output by the others. The default run's session runs the references and controls on every
check and each mutant on the checks it declares (`planned`); the rest of the matrix, every other
check passing each mutant (no check fails a bug that is not its own), is the slow test's session
(-m slow, which CI runs after the default run): half the matrix's time, ~35 s of a 2-core machine.
A mutant that fails every check that fits alike (a rank that never trains hangs each one, each at
the cost of the stall and a rebuilt pool) names the few the default run asks (`ASKED_BY_DEFAULT`);
the slow test judges the others against the same declarations.

`--ddp-timeout 20` gives the hang watchdog 2 s (`stall_seconds`): the mutant whose rank 1 never
trains must be reported by the check naming rank 1, long before the harness's timeout.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddp_conformance.checks import CHECK_IDS, DEFAULT_CHECKS
from ddp_conformance.checks.support import collectives
from ddp_conformance.suite.report import schema
from tests.suite.test_report import assert_fits_and_nothing_is_cut
from tests.test_plan import assert_as_planned

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = sorted((ROOT / "fixtures" / "mutants").glob("*.py"))
REFERENCES = ["torch", "lightning"]
#: checks whose matrix runs in their own module's nested session (tests/checks/test_compiled_model.py,
#: test_elastic_resume.py), so that pytest-xdist can put it on the other worker: compiled_model's cold compiles added
#: ~100 s to this module's, elastic_resume's fixtures 20 s
OWN_SESSION = ("compiled_model", "elastic_resume")
IN_THIS_SESSION = tuple(check for check in CHECK_IDS if check not in OWN_SESSION)
CONFIG = Path(__file__).with_name("suite.yaml")
# checks that do not apply to a trainer on this run's CPU config, and the words their skip gives: the suite's
# config has no BatchNorm and trains in fp32, and torch's SyncBatchNorm runs on GPUs only (test_cuda_suite.py
# judges it there)
NOT_APPLICABLE = {"sync_batchnorm": ("has no BatchNorm layer", "ran on cpu"),
                  "mixed_precision": ("there is no mixed precision to compare",),
                  "bucket_cap_mb_invariance": ("runs its own command line, not the harness's config",),
                  "static_graph": ("static_graph is off in the config; the model can take it",
                                   "runs its own command line, not the harness's config"),
                  # a trainer that never enters DDP's join must be given equal batch counts, which its loaders give
                  "uneven_inputs": ("the fit uses no DDP join",),
                  # the suite's config accumulates no gradients; the fixtures that accumulate set it in their setup
                  "accumulation_equivalence": ("the config asks for no gradient accumulation",),
                  # a guide's config with the flag off (tiny.yaml), where a fixture needs that config's other settings
                  "bucket_view_memory": ("its config sets it false",),
                  # the guides' resume needs the GPU count it was checkpointed with: only a trainer that says otherwise
                  # is judged, and only where its resized groups can run (CPU_ONLY)
                  "elastic_resume": ("does not declare that it resumes at another world size",
                                     "the resized groups run with gloo on CPU")}
#: checks that judge on CPU alone: on a GPU run (test_cuda_suite.py) they skip, saying why, whatever a fixture breaks
CPU_ONLY = {"elastic_resume"}


def not_applicable(check: str, result: dict[str, Any]) -> bool:
    return result["outcome"] == "skipped" and any(words in result["message"] for words in NOT_APPLICABLE.get(check, ()))



_REQUIRED = object()


def declared(path: Path, name: str, default: Any = _REQUIRED) -> Any:
    """A mutant's BREAKS / DIAGNOSIS / SKIPS, read without importing it (that would import torch here)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    if default is not _REQUIRED:
        return default
    raise AssertionError(f"{path.name} does not define {name}")


def planned(path: Path) -> list[str]:
    """The checks the default run's session asks of a mutant: those it breaks or skips, or where it fails every
    check that fits alike (a hang, a crash in DDP), the few it names (`ASKED_BY_DEFAULT`); of a control, those
    its unusual correctness concerns (`CONCERNS`), else the default set's. An opt-in check (`--ddp-checks`) is
    asked only of the fixtures that name it."""
    if declared(path, "CONTROL", ""):
        concerns = set(declared(path, "CONCERNS", DEFAULT_CHECKS))
        return [check for check in CHECK_IDS if check in concerns]
    named = set(declared(path, "ASKED_BY_DEFAULT", set())) or (
        set(declared(path, "BREAKS")) | set(declared(path, "SKIPS", {})))
    return [check for check in CHECK_IDS if check in named]


def picks_a_gpu(path: Path) -> bool:
    """Whether a fixture that picks its own device (`PICKS_ITS_OWN_DEVICE`: a script that trains on a GPU
    whenever one is present, as real scripts do) trains on one here, whatever this session's `--ddp-device`."""
    if not declared(path, "PICKS_ITS_OWN_DEVICE", False):
        return False
    import torch  # this process has no other use for it

    return torch.cuda.is_available()


def spec_of(path: Path) -> str:
    """The fixture's SPEC: its `Trainer` class, or the form it declares (`SPEC = "lightning:{path}:Module"`,
    a LightningModule with no adapter, in the shape the bug was found in)."""
    return declared(path, "SPEC", "{path}:Trainer").format(path=path)


def config_of(path: Path) -> Path:
    """The config a fixture is judged with: the suite's, or the config it names (`CONFIG = "advanced"`) where only
    that config exercises its check (bf16-mixed, BatchNorm): a variant of the suite's beside it
    (`suite_accumulate`), else a guide's in fixtures/configs/ (which test_guide_configs.py runs the references on)."""
    name = declared(path, "CONFIG", "")
    if not name:
        return CONFIG
    variant = CONFIG.with_name(f"{name}.yaml")
    return variant if variant.is_file() else ROOT / "fixtures" / "configs" / f"{name}.yaml"


def run_grouped(workdir: Path, pairs: list[tuple[str | Path, str]], *options: str) -> dict[str, Any]:
    """(subject, check) pairs, a subject a reference's SPEC or a fixture's file, in one nested session per
    config, each given `options` too; the suite config's session (the references') gives the result its report
    and output."""
    groups: dict[Path, list[tuple[str, str]]] = {}
    for subject, check in pairs:
        fixture = isinstance(subject, Path)
        groups.setdefault(config_of(subject) if fixture else CONFIG, []).append(
            (spec_of(subject) if fixture else subject, check))
    main = run_nested(workdir / "suite", groups.pop(CONFIG), CONFIG, *options)
    for config, group in sorted(groups.items()):
        # one str hash secret for every rank (tests/conftest.py): one fork server, not two, imports Lightning
        other = run_nested(workdir / config.stem, group, config, *options, hash_secrets=False)
        main["results"].update(other["results"])
    return main


def run_nested(workdir: Path, pairs: list[tuple[str, str]], config: Path = CONFIG, *options: str,
               hash_secrets: bool = True) -> dict[str, Any]:
    """One nested session of these (SPEC, check) pairs (tests/checks/nested_selection.py deselects the rest);
    `hash_secrets`: each rank hashes str with its own secret, as under torchrun (the hash mutants, in the suite
    config's group, need it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    report, junit, selected = workdir / "report.json", workdir / "junit.xml", workdir / "pairs.json"
    selected.write_text(json.dumps(pairs))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs", "ddp_conformance.suite",
               "-p", "tests.checks.nested_selection", "--ddp-world-size", "2", "--ddp-timeout", "20",
               "--ddp-config", str(config), "--ddp-report", str(report), f"--junitxml={junit}",
               "--ddp-checks", "all", "--ddp-advise", *options]
    for spec in dict.fromkeys(spec for spec, _ in pairs):
        command += ["--ddp-trainer", spec]
    env = dict(os.environ, DDP_SELECTED_PAIRS=str(selected),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if hash_secrets:
        env.pop("PYTHONHASHSEED", None)
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=600)  # a hang, not a slow host
    assert report.is_file(), f"no report; pytest said:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(report.read_text())
    by_trainer: dict[str, dict[str, dict[str, Any]]] = {}
    for result in doc["results"]:
        by_trainer.setdefault(result["spec"], {})[result["check"]] = result
    assert_as_planned(by_trainer)  # every check trained what the printed plan says it trains
    return {"proc": proc, "doc": doc, "results": by_trainer, "junit": junit.read_text()}


@pytest.fixture(scope="module")  # --dist loadfile: one worker runs the whole module
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pairs: list[tuple[str | Path, str]] = [(spec, check) for spec in REFERENCES for check in IN_THIS_SESSION]
    pairs += [(path, check) for path in MUTANTS for check in planned(path) if check in IN_THIS_SESSION]
    return run_grouped(tmp_path_factory.mktemp("suite"), pairs)


@pytest.fixture(scope="module")
def rest_of_the_matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pairs: list[tuple[str | Path, str]] = [(path, check) for path in MUTANTS for check in DEFAULT_CHECKS
                                           if check not in planned(path)]
    return run_grouped(tmp_path_factory.mktemp("suite_rest"), pairs)


def test_reference_trainers_pass_every_check(session: dict[str, Any]) -> None:
    for spec in REFERENCES:
        results = session["results"][spec]
        assert list(results) == list(IN_THIS_SESSION)
        failed = {c: r["message"] for c, r in results.items()
                  if c in DEFAULT_CHECKS and r["outcome"] != "passed" and not not_applicable(c, r)}
        assert not failed, f"{spec}: {failed}"


def test_the_references_step_on_a_nonfinite_loss_as_the_guides_write_them(session: dict[str, Any]) -> None:
    """The opt-in check fails the references: like the guides' loops and stock Lightning, they have no guard."""
    for spec in REFERENCES:
        result = session["results"][spec]["nonfinite_loss"]
        assert result["outcome"] == "failed" and "every rank stepped on it" in result["message"], result
        assert result["message"].startswith("rank 1's loss turned non-finite at step 2 (NaN added to the output "
                                            "of its model's first layer, Linear)"), result


#: the fixtures this module's session asks something of (the others are judged in their check's own session)
JUDGED_HERE = [path for path in MUTANTS if set(planned(path)) & set(IN_THIS_SESSION)]


@pytest.mark.parametrize("path", JUDGED_HERE, ids=[p.stem for p in JUDGED_HERE])
def test_mutant_fails_exactly_the_checks_it_breaks_and_the_verdict_names_the_bug(
        session: dict[str, Any], path: Path) -> None:
    breaks, skips = declared(path, "BREAKS"), declared(path, "SKIPS", {})
    control = declared(path, "CONTROL", "")  # a trainer correct in an unusual way: it must pass
    assert (breaks or skips or control) and set(breaks) | set(skips) <= set(CHECK_IDS)
    assert set(declared(path, "DIAGNOSIS", {})) == set(breaks), "every check a mutant breaks has its verdict's words"
    assert set(declared(path, "ASKED_BY_DEFAULT", set())) <= set(breaks) | set(skips)
    results = session["results"][spec_of(path)]
    assert list(results) == [check for check in planned(path) if check in IN_THIS_SESSION]
    # a control passes every other check; a mutant's others are the slow test's
    assert_as_declared(path, results, picks_a_gpu(path))


def assert_as_declared(path: Path, results: dict[str, dict[str, Any]], on_gpu: bool = False) -> None:
    """The checks asked of a fixture fail exactly where it declares (`BREAKS`, with the `DIAGNOSIS` words), skip
    exactly where it declares (`SKIPS`, with their words) or where the check does not apply here, and pass
    otherwise. `on_gpu`: the fixture trained on a GPU, where the checks only a GPU exercises fail as it declares
    for one (`BREAKS_ON_CUDA`, `DIAGNOSIS_ON_CUDA`) instead of skipping, and those that judge on CPU alone
    (`CPU_ONLY`) skip instead of failing."""
    breaks, diagnosis = set(declared(path, "BREAKS")), dict(declared(path, "DIAGNOSIS", {}))
    skips: dict[str, str | tuple[str, ...]] = declared(path, "SKIPS", {})
    if on_gpu:
        breaks = (breaks | declared(path, "BREAKS_ON_CUDA", set())) - CPU_ONLY
        diagnosis.update(declared(path, "DIAGNOSIS_ON_CUDA", {}))
        diagnosis = {check: words for check, words in diagnosis.items() if check not in CPU_ONLY}
        skips = {check: words for check, words in skips.items() if check not in breaks}
    if collectives.TORCH_RECORDS:  # a hang's verdict names each rank's collective where torch records gloo's
        for check, words in declared(path, "DIAGNOSIS_RECORDED", {}).items():
            diagnosis[check] = [*([diagnosis[check]] if isinstance(diagnosis.get(check), str)
                                  else diagnosis.get(check, ())), *([words] if isinstance(words, str) else words)]
    outcomes = {check: r["outcome"] for check, r in results.items()}
    assert {c for c, o in outcomes.items() if o == "failed"} == set(breaks) & set(results), outcomes
    skipped = {c for c, r in results.items() if r["outcome"] == "skipped" and (c in skips or not not_applicable(c, r))}
    assert skipped == set(skips) & set(results), outcomes
    for check, words in [*skips.items(), *diagnosis.items()]:  # one phrase, or several (the bug, then its remedy)
        for phrase in [words] if isinstance(words, str) else words:
            assert check not in results or phrase in results[check]["message"], results[check]["message"]


def test_a_script_that_reseeds_and_draws_its_batches_is_blamed_on_its_rng_not_a_data_position(
        session: dict[str, Any]) -> None:
    """nanoGPT's shape: no DataLoader, batches drawn with torch.randint from an RNG seeded at every start:
    the batches after the resume differ because the RNG does, which is not a lost data position."""
    message = session["results"][spec_of(ROOT / "fixtures" / "mutants" / "script_reseeds_like_nanogpt.py")][
        "resume_fidelity"]["message"]
    assert message.startswith("the RNG state is not restored: ") and "it seeds its RNG on start" in message, message
    assert "data position" not in message and "the batches after the resume differ too, following the RNG" in message


@pytest.mark.parametrize(("mutant", "ended_at"), [("lightning_plain_loader_saves_every_5", 2),
                                                  ("lightning_no_rng", None), ("ckpt_no_rng", None)])
def test_the_diagnostic_resume_ends_once_it_has_parted_and_runs_whole_where_it_matches(
        session: dict[str, Any], mutant: str, ended_at: int | None) -> None:
    """resume_fidelity's second resume (the RNG as it was at the checkpoint) ends after two micro-batches
    where it was fed other inputs and its weights differ already (a plain DataLoader in Lightning that
    re-reads the epoch's first batches, resumed from a checkpoint its cadence puts early in the second epoch,
    so that the resume is longer than the two steps it trains without a cadence), and runs to the horizon
    where it matches the uninterrupted run (only the RNG is lost): its verdicts are the whole run's (the
    matrix above holds them to their words)."""
    result = session["results"][spec_of(ROOT / "fixtures" / "mutants" / f"{mutant}.py")]["resume_fidelity"]
    assert result["outcome"] == "failed", result
    assert result["figures"].get("second_resume_ended_at_micro_batch") == ended_at, result["figures"]


UNPLANNED = [path for path in MUTANTS if set(DEFAULT_CHECKS) - set(planned(path))]


@pytest.mark.slow
@pytest.mark.parametrize("path", UNPLANNED, ids=[p.stem for p in UNPLANNED])
def test_mutant_passes_every_check_whose_bug_it_is_not(rest_of_the_matrix: dict[str, Any], path: Path) -> None:
    """The rest of the matrix: mostly checks a fixture must pass, and the rest of what a fixture that fails every
    check alike declares beyond `ASKED_BY_DEFAULT`."""
    results = rest_of_the_matrix["results"][spec_of(path)]
    assert list(results) == [check for check in DEFAULT_CHECKS if check not in planned(path)]
    assert_as_declared(path, results, picks_a_gpu(path))


def test_a_trainer_that_leaves_the_flag_off_is_skipped_with_the_measured_saving(session: dict[str, Any]) -> None:
    result = session["results"][f"{ROOT / 'fixtures' / 'mutants' / 'bucket_view_off.py'}:Trainer"]["bucket_view_memory"]
    figures = result["figures"]
    assert result["outcome"] == "skipped" and figures["saved_pct_of_grad_bytes"] >= 90, result
    assert f"{figures['saved_pct_of_grad_bytes']}% of one gradient copy" in result["message"]
    assert any("DistributedDataParallel(model, gradient_as_bucket_view=..." in note for note in figures["notes"])
    assert figures["check_seconds"] >= figures["trainer_seconds"] > 0, figures  # a skip's cost is reported too


def test_a_script_s_saving_is_measured_in_its_own_fit_and_its_loaders_dataset_is_read(session: dict[str, Any]) -> None:
    results = session["results"][spec_of(ROOT / "fixtures" / "mutants" / "script_rank_shards_in_place_grads.py")]
    memory, data = results["bucket_view_memory"], results["data_consistency"]
    assert memory["outcome"] == "passed" and memory["figures"]["saved_pct_of_grad_bytes"] >= 90, memory
    assert memory["figures"]["measured_at"].startswith("the pre-hook of optimizer step 3 of the fit"), memory
    assert data["outcome"] == "passed" and data["figures"]["summary"].endswith("each rank its own shard"), data
    assert data["figures"]["dataset_from"] == "the fit's training loader (fit(1))"


@pytest.mark.parametrize(("control", "scheme"), [("per_rank_with_replacement", "independent draws with replacement"),
                                                 ("iterable_sharded", "iterable dataset")])
def test_unusual_but_correct_sampling_is_recognised_not_just_passed(session: dict[str, Any], control: str,
                                                                     scheme: str) -> None:
    result = session["results"][f"{ROOT / 'fixtures' / 'mutants' / control}.py:Trainer"]["sampler_disjointness"]
    assert result["outcome"] == "passed" and result["figures"]["scheme"] == scheme, result


def test_clipping_by_norm_is_recognised_in_the_step_and_in_the_fit_not_just_passed(session: dict[str, Any]) -> None:
    control = f"{ROOT / 'fixtures' / 'mutants' / 'clips_grad_norm.py'}:Trainer"
    result = session["results"][control]["gradient_equivalence"]
    assert result["outcome"] == "passed" and result["figures"]["fit_step"] == "judged", result
    clipping = [note for note in result["figures"]["notes"] if "gradient clipping by norm" in note]
    assert [note.split(" gradients are")[0] for note in clipping] == ["the DDP step's", "the fit's first step's"]


def test_without_a_fit_the_gradients_are_still_judged_from_the_step(session: dict[str, Any]) -> None:
    result = session["results"][f"{ROOT / 'fixtures' / 'mutants' / 'step_only.py'}:Trainer"]["gradient_equivalence"]
    assert result["outcome"] == "passed" and result["figures"]["fit_step"] == "not judged", result
    assert any("not judged: trainer step_only does not provide fit" in note for note in result["figures"]["notes"])


def test_the_fit_itself_is_judged_for_both_references(session: dict[str, Any]) -> None:
    for spec in REFERENCES:
        figures = session["results"][spec]["gradient_equivalence"]["figures"]
        assert figures["fit_step"] == "judged" and figures["fit_step_max_rel_delta"] <= figures["rtol"], figures


def test_every_check_is_proven_by_a_mutant_it_rejects() -> None:
    """On this run's CPU, or on a GPU (`BREAKS_ON_CUDA`, judged in test_cuda_suite.py) for a check that
    only a GPU can exercise."""
    proven = set().union(*(declared(path, "BREAKS") | declared(path, "BREAKS_ON_CUDA", set()) for path in MUTANTS))
    assert proven == set(CHECK_IDS)
    assert len(MUTANTS) >= 12


def test_report_shapes_json_junit_and_terminal_matrix(session: dict[str, Any]) -> None:
    doc, out = session["doc"], session["proc"].stdout
    assert (doc["world_size"], doc["backend"]) == (2, "gloo")
    assert len(doc["results"]) == len(REFERENCES) * len(IN_THIS_SESSION) + sum(
        len(set(planned(path)) & set(IN_THIS_SESSION)) for path in MUTANTS if config_of(path) == CONFIG)
    assert set(doc["results"][0]) == {"trainer", "spec", "check", "outcome", "figures", "message"}
    assert doc["schema_version"] == 3
    # figures reach JUnit XML as properties (rank 0's ddp.figures -> user_properties)
    assert '<property name="saved_pct_of_grad_bytes"' in session["junit"]
    assert '<property name="max_rel_delta"' in session["junit"]
    assert "ddp conformance (world size 2, gloo)" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "ddp conformance (world size 2, gloo)" in line)
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith("====="))
    # the grid, or where seven checks of this many trainers cannot fit it, a line per trainer and its checks
    shape = lines[start + 1].startswith("trainer ") or lines[start + 2].startswith(f"  {CHECK_IDS[0]}: ")
    assert shape, lines[start:start + 3]
    assert_fits_and_nothing_is_cut(doc, lines[start + 1:end])  # 18 trainers, 120 columns, verdicts in full
    assert "test_conformance[no_set_epoch-sampler_disjointness]" in out  # ids name trainer and check


def test_the_real_report_follows_its_schema(session: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a dev extra")
    jsonschema.validate(session["doc"], schema(), cls=jsonschema.Draft202012Validator)


def test_a_hang_is_reported_by_the_check_not_by_the_harness_timeout(session: dict[str, Any]) -> None:
    results = session["results"][f"{ROOT / 'fixtures' / 'mutants' / 'rank_skips_training.py'}:Trainer"]
    figures = results["rank_participation"]["figures"]
    assert figures.get("hung") is True
    assert figures["check_seconds"] < 10, "the watchdog must fire after ~2 s of no progress, not at the timeout"


def test_no_rank_is_left_stuck_in_a_check_when_a_peer_hangs_or_raises(session: dict[str, Any]) -> None:
    """Every rank of a conformance test answers with its own verdict: a fit runs in a watched thread, so no rank
    waits for the runner to give up on it ("no answer ... after another rank failed (stuck)"), the cost of 5 s and
    a harness function named as where the rank is. nonfinite_loss's wait for every rank's fit to end
    (`_every_rank_raised`) once was such a place: its rank whose fit raised waited for a peer that hangs in DDP's
    all-reduce, until that peer's stall verdict counted as an end (`ProgressObserver.declare_hung`)."""
    import xml.etree.ElementTree as ET  # only this test reads the JUnit XML's structure

    stuck = [case.get("name") for case in ET.fromstring(session["junit"]).iter("testcase")
             for failure in case.iter("failure") if "after another rank failed (stuck)" in (failure.text or "")]
    assert stuck == []
