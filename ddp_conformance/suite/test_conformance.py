"""The conformance tests: one per trainer SPEC per check, each run on every rank of a gloo/nccl group.

Parametrized in this module's own `pytest_generate_tests` from the session's `--ddp-trainer`
SPECs, each parsed once (`TrainerSpec`, with its one label; the test's `trainer` parameter is the
SPEC as given, its id the label), so the suite needs no conftest. A
trainer that could not be built fails its first check and skips the others (`ddp_conformance.suite.unbuilt`).
The ranks receive the parsed SPEC and the config read here, pickled with the test, and import what
the SPEC names: classes do not cross process boundaries.
"""

from __future__ import annotations

import pytest

from ddp_conformance.checks import CheckOptions, run_check, stall_seconds
from ddp_conformance.config import RunConfig
from ddp_conformance.marker import ddp_test
from ddp_conformance.options import run_config, session_trainers, settings_of
from ddp_conformance.runner.wire import WARMUP
from ddp_conformance.selection import LEAST_TIMEOUT
from ddp_conformance.suite.report import CHECK_PROPERTY, SPEC_PROPERTY, TRAINER_PROPERTY
from ddp_conformance.suite.unbuilt import unbuilt_trainers
from ddp_conformance.trainers.spec import TrainerSpec


def parsed_trainers(config: pytest.Config) -> dict[str, TrainerSpec]:
    """The session's SPECs, parsed once (`options.session_trainers`), by the SPEC as given."""
    return {spec.text: spec for spec in session_trainers(config)}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.name != "test_conformance":
        return
    settings = settings_of(metafunc.config)
    params = [pytest.param(text, check, id=f"{spec.label}-{check}", marks=_least_timeout(check, settings.timeout))
              for text, spec in parsed_trainers(metafunc.config).items() for check in settings.checks]
    metafunc.parametrize(("trainer", "check"), params)


def _least_timeout(check: str, timeout: float) -> list[pytest.MarkDecorator]:
    """A check that needs longer than the session's timeout before a hang can be told (`LEAST_TIMEOUT`) gets it, in
    a marker of its case: the function's gives no timeout, so this one's is the closest that does."""
    least = LEAST_TIMEOUT.get(check, 0.0)
    return [pytest.mark.ddp(timeout=least)] if least > timeout else []


@pytest.fixture(scope="session")
def conformance_config(pytestconfig: pytest.Config) -> RunConfig:
    """`--ddp-config`, read once for the session (`options.run_config`: the plugin read it when it checked it)."""
    return run_config(pytestconfig)


@pytest.fixture
def conformance_options(request: pytest.FixtureRequest, trainer: str, check: str,
                        conformance_config: RunConfig) -> CheckOptions:
    """Computed in the pytest process, pickled to the ranks. Also tags the test as a conformance
    result for ddp_conformance.suite.report (user properties travel with the report, xdist included)."""
    settings = settings_of(request.config)
    parsed = parsed_trainers(request.config)[trainer]
    request.node.user_properties.extend([(TRAINER_PROPERTY, parsed.label), (SPEC_PROPERTY, trainer),
                                         (CHECK_PROPERTY, check)])
    marked = ddp_test(request.node)
    unbuilt = unbuilt_trainers(request.config)
    build = (trainer, marked.world_size if marked is not None else settings.world_size, settings.config_path)
    unbuilt.skip_if_unbuilt(build, parsed.label)
    unbuilt.watch(request.node, build)
    timeout = marked.timeout if marked is not None else settings.timeout
    return CheckOptions(trainer=parsed, config=conformance_config, stall_after=stall_seconds(timeout),
                        advise=settings.advise, max_steps=settings.max_steps)


# every check builds an optimizer, which imports torch._dynamo; every check gathers objects across
# ranks, which torch.distributed reads through numpy
@pytest.mark.ddp(preload=WARMUP, requires=("numpy",))
def test_conformance(ddp, tmp_path, trainer: str, check: str, conformance_options: CheckOptions) -> None:
    run_check(check, conformance_options, ddp, tmp_path)
