"""--ddp-trainer SPEC resolution: built-ins, modules, files from any cwd; one-line errors otherwise."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ddp_conformance.adapter import NotProvided, TrainerAdapter
from ddp_conformance.trainers import SpecError, resolve_spec
from ddp_conformance.trainers.spec import trainer_label

ADAPTER = """
from ddp_conformance.adapter import TrainerAdapter

class Mine(TrainerAdapter):
    name = "mine"

def factory():
    return Mine()

def bad_factory():
    return 42

def needs_args(config):
    return Mine()

class NotAnAdapter:
    pass

instance = Mine()
number = 3
"""


@pytest.fixture
def clean_imports(monkeypatch):
    """Undo what resolving user SPECs does to sys.path and sys.modules."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def project(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_builtins_resolve_without_importing_torch_or_lightning():
    out = run_python("""
        import sys
        from ddp_conformance.trainers import resolve_spec
        factories = [resolve_spec(name, '.') for name in ('torch', 'lightning')]
        print('torch' in sys.modules, 'lightning' in sys.modules, [f.name for f in factories])
    """)
    assert out == "False False ['torch', 'lightning']"


def test_builtin_torch_builds_the_reference():
    from ddp_conformance.trainers.torch_ref import TorchTrainer

    assert isinstance(resolve_spec("torch", ".")(), TorchTrainer)


def test_missing_lightning_is_a_skip_reason_not_a_usage_error():
    out = run_python("""
        import sys
        sys.modules['lightning'] = None  # as if it were not installed
        from ddp_conformance.adapter import NotProvided
        from ddp_conformance.trainers import resolve_spec
        factory = resolve_spec('lightning', '.')
        try:
            factory()
        except NotProvided as exc:
            print(exc)
    """)
    assert out == "trainer lightning: lightning is not installed (pip install lightning)"


def test_file_spec_relative_to_rootdir_from_any_cwd_with_neighbours(tmp_path, monkeypatch, clean_imports):
    root = project(tmp_path / "repo", {
        "ci/helpers_for_mine.py": "LABEL = 'from a neighbour'\n",
        "ci/my_trainer.py": ADAPTER + "\nfrom helpers_for_mine import LABEL\n",
    })
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    factory = resolve_spec("ci/my_trainer.py:Mine", root)
    adapter = factory()
    assert isinstance(adapter, TrainerAdapter) and adapter.name == "mine"
    assert sys.modules[type(adapter).__module__].LABEL == "from a neighbour"
    # the same file resolves to the same module (and class) again, as it must in every rank
    assert resolve_spec(str(root / "ci/my_trainer.py") + ":Mine", tmp_path) is factory


def test_two_specs_whose_neighbours_share_a_name_is_one_line(tmp_path, clean_imports):
    """A repo and its copy, both `adapter.py` + `trainer.py`: the copy's `from trainer import ...`
    would get the first repo's module; that is said, not silently checked."""
    files = {"adapter.py": ADAPTER + "\nfrom trainer import LABEL\n", "trainer.py": "LABEL = 'original'\n"}
    first, copy = project(tmp_path / "repo", files), project(tmp_path / "fork", files)
    assert sys.modules[type(resolve_spec("adapter.py:Mine", first)()).__module__].LABEL == "original"
    assert_one_line_spec_error("adapter.py:Mine", copy, "its neighbour trainer.py is imported as module 'trainer', "
                               f"which this process already imported from {first / 'trainer.py'}")


def test_module_spec_and_factory(tmp_path, clean_imports):
    root = project(tmp_path, {"pkg_for_spec/__init__.py": "", "pkg_for_spec/adapters.py": ADAPTER})
    assert resolve_spec("pkg_for_spec.adapters:Mine", root)().name == "mine"
    assert resolve_spec("pkg_for_spec.adapters:factory", root)().name == "mine"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("tensorflow", "expected a built-in name (torch, lightning), package.module:Attr, path/to/file.py:Attr or "
                       "lightning:pkg.module:LitModule"),
        ("mine.py", "expected a built-in name"),
        ("missing.py:Mine", "no such file: "),
        ("broken.py:Mine", "cannot import broken.py: SyntaxError: "),
        ("imports_missing.py:Mine", "cannot import imports_missing.py: ModuleNotFoundError: No module named "
                                    "'not_a_module_anywhere'"),
        ("mine.py:Nope", "mine.py has no attribute 'Nope' (adapters there: Mine)"),
        ("mine.py:NotAnAdapter", "NotAnAdapter is a class but not a TrainerAdapter subclass"),
        ("mine.py:instance", "names an adapter instance; name its class or a zero-argument factory"),
        ("mine.py:number", "names a int, not an adapter class or a zero-argument factory"),
        ("mine.py:needs_args", "names a callable that needs arguments"),
        ("mine.py:bad_factory", "the factory returned int, not a TrainerAdapter"),
        ("no_such_package.mod:Mine", "cannot import no_such_package.mod: ModuleNotFoundError: "),
    ],
)
def test_bad_specs_are_one_line_naming_the_spec(tmp_path, clean_imports, spec, reason):
    root = project(tmp_path, {
        "mine.py": ADAPTER,
        "broken.py": "def oops(:\n",
        "imports_missing.py": "import not_a_module_anywhere\n",
    })
    assert_one_line_spec_error(spec, root, reason)


def test_not_provided_is_the_default_for_everything_but_setup():
    class Bare(TrainerAdapter):
        pass

    adapter = Bare()
    with pytest.raises(NotProvided, match=r"^trainer Bare does not provide resume: the trainer cannot resume"):
        adapter.resume(None, 3)  # type: ignore[arg-type]
    for method, args in [("make_dataset", ()), ("make_model", ()), ("batch_indices", (None,)),
                         ("collate", ([],)), ("loss", (None, None)), ("wrap", (None,)),
                         ("fit", (3,))]:
        with pytest.raises(NotProvided, match=f"does not provide {method}"):
            getattr(adapter, method)(*args)
    # train_step defaults to loss(model, batch).backward(): without a loss it names the loss
    with pytest.raises(NotProvided, match="does not provide loss"):
        adapter.train_step(None, None)


# --- lightning: SPECs: a LightningModule (+ LightningDataModule), or a factory, with no adapter -----

LIGHTNING_CLASSES = """
import lightning.pytorch as pl

class LitModel(pl.LightningModule):
    pass

class OtherModel(pl.LightningModule):
    pass

class LitData(pl.LightningDataModule):
    pass

class NeedsArgs(pl.LightningModule):
    def __init__(self, width):
        super().__init__()

class Plain:
    pass

def make():
    return LitModel(), LitData(), {"gradient_clip_val": 1.0}

def make_with(width):
    return LitModel()

number = 3
"""


@pytest.fixture
def lightning_loaded():
    """Lightning and torch imported before `clean_imports` takes its snapshot: torch's operator
    libraries cannot be imported twice in one process."""
    import ddp_conformance.trainers.lightning_adapter  # noqa: F401


def test_lightning_specs_name_a_module_and_a_datamodule_or_a_factory(tmp_path, lightning_loaded, clean_imports):
    from ddp_conformance.trainers.lightning_adapter import LightningAdapter

    root = project(tmp_path, {"lit/model.py": LIGHTNING_CLASSES, "pkg_lit/__init__.py": "",
                              "pkg_lit/parts.py": LIGHTNING_CLASSES})
    both = resolve_spec("lightning:lit/model.py:LitModel+pkg_lit.parts:LitData", root)
    adapter = both()
    assert isinstance(adapter, LightningAdapter) and adapter.name == both.name == "LitModel+LitData"
    assert adapter.parts.module.__name__ == "LitModel" and adapter.parts.datamodule.__name__ == "LitData"
    swapped = resolve_spec("lightning:pkg_lit.parts:LitData+pkg_lit.parts:LitModel", root)()
    assert (swapped.parts.module.__name__, swapped.parts.datamodule.__name__) == ("LitModel", "LitData")
    alone = resolve_spec("lightning:pkg_lit.parts:LitModel", root)()
    assert alone.parts.datamodule is None and alone.name == "LitModel"
    built = resolve_spec("lightning:lit/model.py:make", root)().build()
    assert type(built.module).__name__ == "LitModel" and built.trainer_kwargs == {"gradient_clip_val": 1.0}


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("lightning:", "expected lightning:pkg.module:LitModule[+pkg.module:LitDataModule] or "
                       "lightning:path/to/file.py:factory"),
        ("lightning:model.py", "expected lightning:pkg.module:LitModule"),
        ("lightning:model.py:LitModel+model.py:LitData+model.py:OtherModel", "expected lightning:"),
        ("lightning:model.py:LitModl", "model.py has no attribute 'LitModl' (Lightning classes there: LitData, "
                                       "LitModel, NeedsArgs, OtherModel)"),
        ("lightning:model.py:Plain", "Plain is a class but neither a LightningModule nor a LightningDataModule"),
        ("lightning:model.py:number", "number is a int, not a LightningModule, a LightningDataModule or a factory"),
        ("lightning:model.py:LitModel+model.py:OtherModel", "names two Lightning modules (LitModel, OtherModel)"),
        ("lightning:model.py:LitData", "names no LightningModule (only the datamodule model.py:LitData)"),
        ("lightning:model.py:make+model.py:LitData", "make is a factory, which names everything itself"),
        ("lightning:model.py:NeedsArgs", "NeedsArgs needs arguments; name a zero-argument factory"),
        ("lightning:model.py:make_with", "make_with needs arguments"),
        ("lightning:missing.py:LitModel", "no such file: "),
        ("model.py:LitModel", "LitModel is a LightningModule: check it with a lightning: SPEC"),
    ],
)
def test_bad_lightning_specs_are_one_line_naming_the_spec(tmp_path, lightning_loaded, clean_imports, spec, reason):
    root = project(tmp_path, {"model.py": LIGHTNING_CLASSES})
    assert_one_line_spec_error(spec, root, reason)


def test_a_factory_that_returns_something_else_is_one_line(lightning_loaded):
    from ddp_conformance.trainers.lightning_adapter import unpack

    with pytest.raises(TypeError, match=r"^trainer SPEC 'lightning:x.py:make': the factory returned a tuple of int, "
                                        r"str; expected a LightningModule, \(module, datamodule\) or"):
        unpack((1, "a"), "lightning:x.py:make")


def assert_one_line_spec_error(spec: str, root, reason: str) -> None:
    """A bad SPEC stops with one line that names the SPEC and says why."""
    with pytest.raises(SpecError) as caught:
        resolve_spec(spec, root)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"trainer SPEC {spec!r}: ")
    assert reason in message


def test_trainer_labels_are_short_and_readable():
    assert trainer_label("torch") == "torch"
    assert trainer_label("/abs/fixtures/mutants/no_set_epoch.py:Trainer") == "no_set_epoch"
    assert trainer_label("adapters.py:MyTrainer") == "adapters.MyTrainer"
    assert trainer_label("pkg.module:Trainer") == "module"
