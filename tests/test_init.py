"""The names a user imports from the package root: each one the object its module defines, loaded on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ddp_conformance


@pytest.mark.parametrize("name", ddp_conformance.__all__)
def test_each_public_name_is_its_modules_own(name: str) -> None:
    home = importlib.import_module(f"ddp_conformance.{ddp_conformance._HOMES[name]}")
    assert getattr(ddp_conformance, name) is getattr(home, name) and name in dir(ddp_conformance)


def test_the_public_names_are_the_ones_the_root_maps() -> None:
    assert sorted(ddp_conformance.__all__) == sorted(ddp_conformance._HOMES)
    with pytest.raises(AttributeError, match="has no attribute 'Trainer'"):
        ddp_conformance.Trainer  # noqa: B018


def test_an_adapter_written_against_the_root_loads_no_torch() -> None:
    """A user's class trainer module imports the interface in the pytest process, which the plugin keeps light."""
    code = ("import sys; from ddp_conformance import NotProvided, TrainerAdapter, TrainState; "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
