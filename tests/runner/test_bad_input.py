"""Bad trainer SPECs and configs: one usage line naming the thing at fault, before any rank starts."""

from __future__ import annotations

import pytest


def run_usage_error(pytester: pytest.Pytester, *args: str) -> str:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.strip()]
    assert len(errors) == 1, result.stderr.str()
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    return errors[0]


def test_trainer_that_does_not_import(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(broken_adapter="import not_a_module_anywhere\n")
    line = run_usage_error(pytester, "--ddp-trainer", "broken_adapter.py:Trainer")
    assert line.startswith("ERROR: trainer SPEC 'broken_adapter.py:Trainer': ")
    assert "No module named 'not_a_module_anywhere'" in line


def test_trainer_spec_that_names_no_adapter(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(my_adapter="class Trainer:\n    pass\nVALUE = 3\n")
    line = run_usage_error(pytester, "--ddp-trainer", "my_adapter.py:VALUE")
    assert line.startswith("ERROR: trainer SPEC 'my_adapter.py:VALUE': ")


def test_unreadable_config(pytester: pytest.Pytester) -> None:
    line = run_usage_error(pytester, "--ddp-config", "missing.yaml")
    assert line == "ERROR: ddp-config missing.yaml: cannot read the file: No such file or directory"


def test_config_with_a_wrong_type_names_the_key_path(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", bad="trainer:\n  strategy:\n    bucket_cap_mb: big\n")
    line = run_usage_error(pytester, "--ddp-config", "bad.yaml")
    assert "trainer.strategy.bucket_cap_mb: expected a number, got 'big'" in line


def test_config_from_ini_is_relative_to_rootdir(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nddp_config = configs/nope.yaml\n")
    line = run_usage_error(pytester)
    assert "configs/nope.yaml: cannot read the file" in line
