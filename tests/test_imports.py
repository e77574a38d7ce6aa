"""Every import the plugin makes is declared in pyproject.toml or guarded, read from the source.

An environment that lacked an undeclared package (numpy, which torch does not require) made every check fail with
a traceback of importlib frames: so the package imports only the standard library and what pyproject declares
(Lightning only where a `lightning:` trainer or its pieces need it, as the extra says). numpy is declared for
torch.distributed's object collectives, which read their buffers through it; the plugin's own code reads tensors
without it, and the RNG helpers users import (`resumable`) work in a process that has none.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddp_conformance"
#: the modules pyproject's dependencies provide, and the distribution that provides each
DECLARED = {"torch": "torch", "numpy": "numpy", "pytest": "pytest", "_pytest": "pytest", "yaml": "pyyaml",
            "pluggy": "pytest"}
#: the `lightning` extra: imported only by the modules a Lightning trainer or a user's Lightning project loads
LIGHTNING_EXTRA = {"lightning", "lightning_fabric", "pytorch_lightning"}


def guarded(tree: ast.AST) -> set[int]:
    """The ids of the import statements inside a `try` whose handler catches ImportError: optional on purpose."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers):
            found.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return found


def imported_roots(path: Path) -> set[str]:
    """The top-level names the unguarded import statements in `path` bring in (absolute imports only)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    optional = guarded(tree)
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_package_imports_only_the_standard_library_and_declared_packages() -> None:
    undeclared = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        extra = imported_roots(path) - set(sys.stdlib_module_names) - set(DECLARED) - {"ddp_conformance"}
        extra -= LIGHTNING_EXTRA
        if extra:
            undeclared[str(path.relative_to(ROOT))] = sorted(extra)
    assert not undeclared, f"imports pyproject.toml does not declare: {undeclared}"


def test_lightning_is_imported_only_where_a_lightning_trainer_needs_it() -> None:
    importers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                       if imported_roots(path) & LIGHTNING_EXTRA)
    assert importers == ["lightning.py", "trainers/lightning_adapter.py", "trainers/lightning_ref.py"], importers


@pytest.mark.parametrize("module", ["ddp_conformance.resumable", "ddp_conformance.trainers.torch_ref",
                                    "ddp_conformance.checks.resume_fidelity"])
def test_without_numpy_the_rng_state_round_trips_and_the_modules_import(module: str) -> None:
    script = textwrap.dedent(f"""
        import sys, warnings
        sys.modules["numpy"] = None  # as if not installed: `import numpy` raises ImportError
        warnings.simplefilter("ignore")  # torch warns once that numpy is missing
        import importlib
        import torch
        importlib.import_module({module!r})
        from ddp_conformance.resumable import capture_rng_state, restore_rng_state, seed_all
        seed_all(3)
        state = capture_rng_state()
        drawn = torch.rand(4)
        restore_rng_state(state)
        assert torch.equal(drawn, torch.rand(4))
        assert "numpy" not in state, sorted(state)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_with_numpy_its_rng_state_is_carried() -> None:
    np = pytest.importorskip("numpy", reason="numpy is not installed: its RNG state has nothing to carry")
    from ddp_conformance.resumable import capture_rng_state, restore_rng_state

    np.random.seed(5)
    state = capture_rng_state()
    drawn = np.random.rand(3)
    np.random.seed(6)
    restore_rng_state(state)
    assert (np.random.rand(3) == drawn).all()


def test_without_numpy_the_harness_reads_tensor_bytes() -> None:
    """Every digest of the recorder and the checks reads tensors through `tensor_bytes`: `Tensor.numpy()` raised
    "Numpy is not available" in every check of an environment with torch and pytest only."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["numpy"] = None
        warnings.simplefilter("ignore")
        import torch
        from ddp_conformance.checks.support.observe import input_digest
        from ddp_conformance.checks.support.model_state import digest
        from ddp_conformance.checks.support.tensor_bytes import tensor_bytes
        t = torch.arange(6, dtype=torch.float32)
        assert bytes(tensor_bytes(t)) == bytes(tensor_bytes(t.reshape(2, 3).t().contiguous().t()))
        assert input_digest([t, torch.zeros(3).expand(2, 3)]) and digest({"w": t})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
