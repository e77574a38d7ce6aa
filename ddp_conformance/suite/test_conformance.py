"""The conformance tests: one per trainer SPEC per check, each run on every rank of a gloo/nccl group.

Parametrized in this module's own `pytest_generate_tests` from the session's `--ddp-trainer`
SPECs, so the suite needs no conftest. A trainer that could not be built fails its first check and
skips the others (`ddp_conformance.builds`). The ranks receive strings (SPEC, rootdir, config path) and
resolve them again: classes do not cross process boundaries.
"""

from __future__ import annotations

import pytest

from ddp_conformance.builds import unbuilt_trainers
from ddp_conformance.checks import CHECK_IDS, CheckOptions, run_check, stall_seconds, trainer_labels
from ddp_conformance.marker import ddp_test
from ddp_conformance.options import settings_of
from ddp_conformance.report import CHECK_PROPERTY, SPEC_PROPERTY, TRAINER_PROPERTY
from ddp_conformance.runner.wire import WARMUP


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.name != "test_conformance":
        return
    labels = trainer_labels(settings_of(metafunc.config).trainers)
    params = [pytest.param(spec, check, id=f"{label}-{check}") for spec, label in labels.items() for check in CHECK_IDS]
    metafunc.parametrize(("trainer", "check"), params)


@pytest.fixture
def conformance_options(request: pytest.FixtureRequest, trainer: str, check: str) -> CheckOptions:
    """Computed in the pytest process, pickled to the ranks. Also tags the test as a conformance
    result for ddp_conformance.report (user properties travel with the report, xdist included)."""
    settings = settings_of(request.config)
    label = trainer_labels(settings.trainers)[trainer]  # the test id's name for it, in the matrix and JSON too
    request.node.user_properties.extend([(TRAINER_PROPERTY, label), (SPEC_PROPERTY, trainer), (CHECK_PROPERTY, check)])
    marked = ddp_test(request.node)
    unbuilt = unbuilt_trainers(request.config)
    build = (trainer, marked.world_size if marked is not None else settings.world_size, settings.config_path)
    unbuilt.skip_if_unbuilt(build, label)
    unbuilt.watch(request.node, build)
    timeout = marked.timeout if marked is not None else settings.timeout
    return CheckOptions(spec_base=settings.spec_base, config_path=settings.config_path,
                        stall_after=stall_seconds(timeout), trainer_name=label)


@pytest.mark.ddp(preload=WARMUP)  # every check builds an optimizer, which imports torch._dynamo
def test_conformance(ddp, tmp_path, trainer: str, check: str, conformance_options: CheckOptions) -> None:
    run_check(check, trainer, conformance_options, ddp, tmp_path)
