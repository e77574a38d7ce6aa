"""compiled_model's pieces, and its other side: a trainer that compiles its model itself.

The check reads torch's private per-module hook dicts to name a hook registered after the first forward,
and patches inductor's `fallback_random` (a compiled fit draws eager's dropout masks) and `compile_threads`
(no worker processes): all are guarded here (`config.patch` refuses a key it does not know), so that a torch
that renames them fails a test instead of the check going quiet.

The check is opt-in, and its matrix (the references, its fixtures and the trainers that compile themselves, in one
nested session of cold inductor compiles) is the default run's second-longest module: it runs with -m slow, which CI
runs after the default run on every torch it tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddp_conformance.checks.compiled_model import (
    HOOK_DICTS,
    TOLERANCE,
    compile_in_place,
    compiled,
    dropout_layers,
    inductor_settings,
    module_hooks,
)
from tests.checks.test_suite import (
    MUTANTS as ALL_FIXTURES,
)
from tests.checks.test_suite import (
    REFERENCES,
    assert_as_declared,
    declared,
    planned,
    run_grouped,
    run_nested,
    spec_of,
)

ROOT = Path(__file__).resolve().parents[2]
COMPILES_ITSELF = ROOT / "fixtures" / "compiled" / "compiles_itself.py"
MUTANTS = ROOT / "fixtures" / "mutants"


def test_every_module_keeps_its_hooks_where_the_check_reads_them() -> None:
    layer = nn.Linear(2, 2)
    for attribute in HOOK_DICTS:
        assert isinstance(getattr(layer, attribute), dict), attribute

    def tap(module: nn.Module, args: object, output: torch.Tensor) -> None:
        return None

    model = nn.Sequential(layer, nn.ReLU())
    before = module_hooks(model)
    handle = layer.register_forward_hook(tap)
    layer.register_forward_pre_hook(lambda module, args: None)
    added = {key: name for key, name in module_hooks(model).items() if key not in before}
    assert sorted((key[0], key[1], name.rsplit(".", 1)[-1]) for key, name in added.items()) == [
        ("0", "forward hook", "tap"), ("0", "forward pre-hook", "<lambda>")]
    handle.remove()
    assert len(module_hooks(model)) == len(before) + 1


def test_a_compiled_model_draws_the_eager_dropout_masks_with_fallback_random() -> None:
    """What comparing a script with dropout step for step rests on (fixture script_compiled_hook_and_dropout)."""
    def step(compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        if compiled:
            compile_in_place(model)
        torch.manual_seed(1)
        model(torch.ones(4, 8)).sum().backward()
        return model[0].weight.grad

    with inductor_settings():
        compiled = step(True)
    assert torch.equal(step(False), compiled)


def test_a_lightning_module_is_compiled_as_lightning_compiles_it() -> None:
    class Stepper(nn.Module):  # the shape the check looks for: a module with a training_step
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return self.net(batch).sum()

    class Wrapper(nn.Module):  # Lightning's strategy wraps the LightningModule before DDP does
        def __init__(self) -> None:
            super().__init__()
            self.inner = Stepper()

    wrapper = Wrapper()
    compile_in_place(wrapper)
    assert "forward" in vars(wrapper.inner) and "training_step" in vars(wrapper.inner)
    assert "forward" not in vars(wrapper)
    plain = nn.Linear(2, 2)
    compile_in_place(plain)
    assert "forward" in vars(plain)


def test_a_model_the_trainer_compiled_itself_is_recognised_in_every_form() -> None:
    def fresh() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2))

    assert not compiled(fresh())
    assert compiled(nn.Sequential(torch.compile(fresh())))  # DDP(torch.compile(model)), nanoGPT's
    method = fresh()
    method.compile()
    assert compiled(nn.Sequential(method))
    in_place = fresh()
    compile_in_place(in_place)  # as Lightning compiles a LightningModule's methods
    assert compiled(nn.Sequential(in_place))


def test_dropout_that_draws_is_found_in_layers_and_attention() -> None:
    model = nn.Sequential(nn.Dropout(0.0), nn.Dropout2d(0.1), nn.MultiheadAttention(4, 2, dropout=0.2),
                          nn.MultiheadAttention(4, 2))
    assert [type(m).__name__ for m in dropout_layers(model)] == ["Dropout2d", "MultiheadAttention"]


def test_every_precision_a_guide_config_trains_in_on_cpu_has_a_measured_tolerance() -> None:
    assert {"32", "32-true", "bf16-mixed"} <= set(TOLERANCE)


SCRIPTS = [MUTANTS / "script_clamp_hook_after_warmup.py", MUTANTS / "script_compiled_hook_and_dropout.py"]
SCRIPT_SPECS = [spec_of(script) for script in SCRIPTS]  # in this order in the session: the first compiles first
ITSELF = [f"{COMPILES_ITSELF}:Compiled", f"{COMPILES_ITSELF}:HookAfterWarmup"]
#: the fixtures test_suite.py's matrix would ask compiled_model of, asked here (its OWN_SESSION)
FIXTURES = [path for path in ALL_FIXTURES if "compiled_model" in planned(path)]


@pytest.fixture(scope="module")  # one nested session (a pool of ranks) for the tests below
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The references, the fixtures that declare compiled_model (the two scripts first, in this order) and the
    trainers that compile themselves, on compiled_model alone, in the suite's config."""
    fixtures = sorted(FIXTURES, key=lambda path: path not in SCRIPTS)
    pairs: list[tuple[str | Path, str]] = [(path, "compiled_model") for path in fixtures]
    pairs += [(spec, "compiled_model") for spec in [*REFERENCES, *ITSELF]]
    return run_grouped(tmp_path_factory.mktemp("compiled"), pairs)["results"]


@pytest.mark.slow
def test_the_references_train_the_same_model_compiled_as_eager(session: dict[str, Any]) -> None:
    """compiled_model passes the references, within its fp32 tolerance, and compiled them itself."""
    for spec in REFERENCES:
        result = session[spec]["compiled_model"]
        figures = result["figures"]
        assert result["outcome"] == "passed" and figures["compiled_by"] == "the check", result
        assert figures["max_rel_delta"] <= figures["tolerance"], figures


@pytest.mark.slow
@pytest.mark.parametrize("path", FIXTURES, ids=[path.stem for path in FIXTURES])
def test_each_fixture_is_judged_as_it_declares(session: dict[str, Any], path: Path) -> None:
    """test_suite.py's matrix for this check: the mutants fail with their words, the controls pass, and a fit that
    is not reproducible (script_unseeded_model) skips saying so."""
    assert ("compiled_model" in declared(path, "BREAKS") | set(declared(path, "SKIPS", {}))
            or declared(path, "CONTROL", ""))
    assert_as_declared(path, session[spec_of(path)])


@pytest.mark.slow
def test_a_fit_compiled_earlier_in_the_rank_process_is_not_reused_for_another_trainer_s_model(
        session: dict[str, Any]) -> None:
    """The same layers in two scripts of one session: the first registers its hook after the first forward, the
    second from the start. Dynamo's code cache for nn.Sequential.forward does not guard on hooks, so the second,
    compiled, reused the first's graph and ran without its hook (CI, once the matrix ran them in this order)."""
    first, second = (session[spec]["compiled_model"] for spec in SCRIPT_SPECS)
    assert first["outcome"] == "failed" and "registers module hooks after its first forward" in first["message"]
    assert second["outcome"] == "passed", second


@pytest.mark.slow
def test_a_machine_without_a_cxx_compiler_is_a_skip_not_the_trainer_s_failure(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))  # inductor's compiler for the CPU (config.cpp.cxx)
    result = run_nested(tmp_path / "session", [("torch", "compiled_model")])["results"]["torch"]["compiled_model"]
    assert result["outcome"] == "skipped", result
    assert result["message"].startswith("inductor finds no working C++ compiler on this machine"), result


@pytest.mark.slow
def test_a_trainer_that_compiles_itself_is_compared_with_its_fit_under_force_eager(session: dict[str, Any]) -> None:
    control, mutant = (session[spec]["compiled_model"] for spec in ITSELF)
    if not hasattr(torch.compiler, "set_stance"):
        for result in (control, mutant):
            assert result["outcome"] == "skipped" and "set_stance arrived in 2.6" in result["message"], result
        return
    assert control["outcome"] == "passed" and control["figures"]["compiled_by"] == "the trainer", control
    assert mutant["outcome"] == "failed", mutant
    assert mutant["message"].startswith("the fit registers module hooks after its first forward (forward hook "
                                        "HookAfterWarmup._keep_features on '0')"), mutant
