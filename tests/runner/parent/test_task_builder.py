"""Task building (parent/task_builder.py), tested without processes."""

from __future__ import annotations

from pathlib import Path


def test_local_module_index_sees_new_modules_and_is_kept_otherwise(tmp_path: Path) -> None:
    """The per-test scan of sys.modules is cached; an import or a removal must still be seen."""
    import sys
    import types

    from ddp_conformance.runner.parent.task_builder import _LocalModuleIndex

    index = _LocalModuleIndex()
    first = index(tmp_path)
    assert index(tmp_path) is first  # nothing changed: the same answer, no rescan
    module = types.ModuleType("ddp_probe_helpers")
    module.__file__ = str(tmp_path / "ddp_probe_helpers.py")
    sys.modules["ddp_probe_helpers"] = module
    try:
        assert index(tmp_path)["ddp_probe_helpers"] == (module.__file__, False)
    finally:
        del sys.modules["ddp_probe_helpers"]
    assert "ddp_probe_helpers" not in index(tmp_path)
