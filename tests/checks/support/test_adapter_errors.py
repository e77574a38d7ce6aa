"""A trainer's own error is named by the adapter call that raised it; the harness's own words (a
skip, a missing method, a trainer that cannot be built) pass through as they are."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_conformance.adapter import NotProvided, TrainerBuildError
from ddp_conformance.checks.support.adapter_errors import AdapterError, CallNamingAdapter


class Raising:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def fit(self, steps: int, checkpoint_dir: Path | None = None) -> None:
        raise self.error


def test_a_trainers_error_names_the_call_and_its_arguments():
    with pytest.raises(AdapterError) as raised:
        CallNamingAdapter(Raising(OSError(22, "Invalid argument"))).fit(3, checkpoint_dir=Path("/a/b/c/d"))
    assert ("fit raised OSError: [Errno 22] Invalid argument (called as fit(3, checkpoint_dir=b/c/d))"
            in str(raised.value))
    assert isinstance(raised.value.__cause__, OSError)


@pytest.mark.parametrize("error", [NotProvided("script:t.py", "make_model()"),
                                   TrainerBuildError("trainer SPEC 'script:t.py': fit(4) took 5 optimizer steps"),
                                   pytest.skip.Exception("no GPU")], ids=lambda e: type(e).__name__)
def test_the_harness_own_words_pass_through(error: BaseException):
    with pytest.raises(type(error)) as raised:
        CallNamingAdapter(Raising(error)).fit(3)
    assert raised.value is error
