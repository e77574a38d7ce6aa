"""pytest features inside ranks: xfail(raises=), class instances, packages under both import modes,
fixtures with side effects, and figures that cannot travel."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("no_orphans")

TESTS = """
import os
import pytest
from .helpers import Box

@pytest.mark.xfail(raises=ValueError, strict=True)
@pytest.mark.ddp(world_size=2)
def test_xfail_raises_matches_the_ranks_exception(ddp):
    raise ValueError("expected")

@pytest.mark.xfail(raises=KeyError, strict=True)
@pytest.mark.ddp(world_size=2)
def test_xfail_raises_other_type_still_fails(ddp):
    raise ValueError("not a KeyError")

class TestWithState:
    def setup_method(self):
        self.value = 3

    @pytest.mark.ddp(world_size=2)
    def test_instance_and_conftest_fixture(self, ddp, box):
        assert self.value == 3 and box.value == 5 and isinstance(box, Box)

@pytest.mark.ddp(world_size=2)
def test_1_patches(ddp, monkeypatch):
    monkeypatch.setattr(os, "sep", "!")

@pytest.mark.ddp(world_size=2)
def test_2_sees_no_patch(ddp):
    assert os.sep == "/"

@pytest.mark.ddp(world_size=2)
def test_unpicklable_figure(ddp):
    import threading
    ddp.figures["lock"] = threading.Lock()
"""


@pytest.mark.parametrize("import_mode", ["prepend", pytest.param("importlib", marks=pytest.mark.slow)])
def test_pytest_features_inside_ranks(pytester: pytest.Pytester, import_mode: str) -> None:
    package = pytester.mkpydir("tests")
    (package / "helpers.py").write_text("class Box:\n    def __init__(self, value):\n        self.value = value\n")
    (package / "conftest.py").write_text(
        "import pytest\nfrom .helpers import Box\n\n@pytest.fixture\ndef box():\n    return Box(5)\n"
    )
    (package / "test_features.py").write_text(TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--import-mode={import_mode}", "-rfx")
    result.assert_outcomes(passed=3, failed=2, xfailed=1)
    result.stdout.fnmatch_lines(["*_ test_xfail_raises_other_type_still_fails _*",
                                 "2 of 2 ranks failed: ranks 0, 1 failed: ValueError: not a KeyError"])
    result.stdout.fnmatch_lines(
        ["*_ test_unpicklable_figure _*",
         "2 of 2 ranks failed: ranks 0, 1 failed: ddp.figures[[]'lock'[]] cannot be sent back*"]
    )
    # the failure is a figure problem on live ranks, not a crash
    assert "died" not in result.stdout.str()
