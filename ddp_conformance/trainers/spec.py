"""Both processes: `--ddp-trainer SPEC` resolution: a built-in name, `package.module:Attr`, `path/to/file.py:Attr`, or
`lightning:` and a LightningModule (+ LightningDataModule), or a factory, each named the same two ways.

A `lightning:` SPEC needs no adapter: `lightning:pkg.model:LitModel+pkg.data:LitData` checks that
module and datamodule (each built with no arguments) under Lightning's Trainer; `lightning:pkg.model:LitModel`
alone uses the module's own `train_dataloader`; `lightning:path/to/file.py:make` names a
zero-argument factory returning the module, `(module, datamodule)` or `(module, datamodule,
trainer_kwargs)`, for classes that take arguments or a Trainer that needs some (callbacks,
gradient clipping...). See `lightning_adapter.py`.

A SPEC is parsed once, in the pytest process, into a `TrainerSpec`: its kind, the folder a relative
path is taken from, and its one label (the test id's, the messages' and the report's). The ranks
receive that value with the test and only import what it names (`TrainerSpec.resolve`): classes do
not cross process boundaries, which is why a file SPEC is imported under a name derived from its
absolute path: the same file gives the same module name in every process, so its classes pickle by
reference. Resolving in the pytest process too makes a bad SPEC a one-line usage error before
anything is spawned.

This module imports neither torch nor lightning (a `lightning:` SPEC imports the user's modules, which
do); the built-ins and the Lightning adapter are imported only when their factory is called.

A `script:` SPEC names a training script by its command lines (`script_adapter.py`):
`script:train.py --steps {steps} --ckpt-dir {checkpoint_dir} --ckpt-at {checkpoint_at} | train.py
--steps {steps} --resume {checkpoint}`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any

from ..adapter import NotProvided, TrainerAdapter
from .lightning_parts import LightningParts
from .script_adapter import SCRIPT_PREFIX, ScriptAdapter, ScriptSpecError, parse_script_spec

BUILTINS: dict[str, str] = {
    "torch": "ddp_conformance.trainers.torch_ref:TorchTrainer",
    "lightning": "ddp_conformance.trainers.lightning_ref:LightningTrainer",
}

Factory = Callable[[], TrainerAdapter]
LIGHTNING_PREFIX = "lightning:"


class SpecError(ValueError):
    """A SPEC that does not import or does not name an adapter; `str()` is the one-line message."""


class _Builtin:
    """A built-in reference, imported on first call so that resolving it costs nothing.

    A missing optional dependency (lightning) is not a usage error: it becomes `NotProvided`, which
    the checks turn into skips naming the missing package.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.target = BUILTINS[name]

    def __call__(self) -> TrainerAdapter:
        module_name, _, attr = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if not missing or missing == "ddp_conformance":
                raise
            raise NotProvided(self.name, "", f"{missing} is not installed (pip install {missing})") from exc
        return getattr(module, attr)()

    def __repr__(self) -> str:
        return f"<built-in trainer {self.name!r}>"


class _CheckedFactory:
    """A user's zero-argument factory, checked to return an adapter every time it is called."""

    def __init__(self, spec: str, factory: Callable[[], Any]) -> None:
        self.spec = spec
        self.factory = factory
        self.name = getattr(factory, "__name__", spec)

    def __call__(self) -> TrainerAdapter:
        adapter = self.factory()
        if not isinstance(adapter, TrainerAdapter):
            raise SpecError(_message(self.spec, f"the factory returned {type(adapter).__name__}, "
                                                "not a TrainerAdapter"))
        return adapter


def _message(spec: str, reason: str) -> str:
    return f"{message_prefix(spec)}{reason}"


def message_prefix(spec: str) -> str:
    """What every SpecError's message about `spec` starts with, before the reason."""
    return f"trainer SPEC {spec!r}: "


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _import_file(spec: str, path: Path, shown: str) -> ModuleType:
    """Import a file under a name stable across processes; its directory goes on sys.path so the
    file can import its neighbours (`from helpers import X`) as it would when run as a script."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"_ddp_trainer_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    if not resolved.is_file():
        raise SpecError(_message(spec, f"no such file: {resolved}"))
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(_message(spec, f"cannot import {shown}: not a Python file"))
    shadowed = _shadowed_neighbour(resolved)
    if shadowed:
        raise SpecError(_message(spec, shadowed))
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise SpecError(_message(spec, f"cannot import {shown}: {_one_line(exc)}")) from exc
    return module


def _shadowed_neighbour(path: Path) -> str:
    """A neighbour the file imports (`from trainer import Trainer`) that this process has already
    imported under the same name from another folder: Python would hand the file that other module,
    and the checks would judge another trainer's code. Two SPECs in one session whose folders both
    hold a `trainer.py` (a repo and its fork, say) hit this; "" when every neighbour is the file's own."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ""  # the import itself will say what is wrong
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
    for top in sorted({name.split(".")[0] for name in imported}):
        own = [path.parent / f"{top}.py", path.parent / top / "__init__.py"]
        loaded = getattr(sys.modules.get(top), "__file__", None)
        if loaded and any(p.is_file() for p in own) and Path(loaded).resolve() not in own:
            return (f"its neighbour {own[0].name if own[0].is_file() else top} is imported as module {top!r}, "
                    f"which this process already imported from {loaded}: a process holds one module per name, "
                    "so run these trainers in separate sessions (or give one of the files another name)")
    return ""


def _import_module(spec: str, module_name: str, rootdir: Path) -> ModuleType:
    """Import `package.module`; when its top package is not importable, retry with rootdir on
    sys.path, so a SPEC naming a module of the user's repo works without installing it."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        root = str(rootdir.resolve())
        if exc.name != top or root in sys.path:
            raise SpecError(_message(spec, f"cannot import {module_name}: {_one_line(exc)}")) from exc
        sys.path.append(root)
        return _import_module(spec, module_name, rootdir)
    except (Exception, SystemExit) as exc:
        raise SpecError(_message(spec, f"cannot import {module_name}: {_one_line(exc)}")) from exc


def _is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


BUILTIN, LIGHTNING, SCRIPT, ATTRIBUTE = "builtin", "lightning", "script", "attribute"  # a SPEC's kinds


@dataclass(frozen=True)
class TrainerSpec:
    """One `--ddp-trainer` SPEC, parsed once: the text as given, the folder a relative path in
    it is taken from, its kind and its one label. Picklable: the suite sends it to the ranks with the test."""

    text: str
    base: str
    kind: str
    label: str

    @classmethod
    def parse(cls, text: str, base: str | Path, label: str = "") -> TrainerSpec:
        """`text` read once; one SpecError line when it has none of the shapes (nothing is imported here)."""
        kind = _kind(text)
        if kind is None:
            raise SpecError(_message(text.strip(), "expected a built-in name (" + ", ".join(BUILTINS) + "), "
                                     "package.module:Attr, path/to/file.py:Attr or lightning:pkg.module:LitModule"))
        return cls(text=text, base=str(base), kind=kind, label=label or _label(kind, text.strip()))

    @property
    def frameworks(self) -> tuple[str, ...]:
        """The framework modules every rank imports to build this trainer, known without importing it:
        worth importing once, before ranks are forked (Lightning's ~3 s of CPU a rank)."""
        return ("lightning.pytorch",) if self.kind == LIGHTNING or self.text.strip() == "lightning" else ()

    @property
    def imports_code(self) -> bool:
        """Whether resolving it imports the module it names (and whatever that imports: Lightning, torch)."""
        return self.kind in (LIGHTNING, ATTRIBUTE)

    def resolve(self) -> Factory:
        """A zero-argument callable that builds a fresh adapter: imports what the SPEC names, in this
        process. Raises SpecError with one line on any problem."""
        rootdir, spec = Path(self.base), self.text.strip()
        if self.kind == BUILTIN:
            return _Builtin(spec)
        if self.kind == LIGHTNING:
            return _resolve_lightning(spec, rootdir)
        if self.kind == SCRIPT:
            return _resolve_script(spec, rootdir)
        target, _, attr = spec.rpartition(":")
        return _as_factory(spec, _attribute(spec, target, attr, rootdir, _adapters_in))


def resolve_spec(spec: str, rootdir: Path) -> Factory:
    """Turn a SPEC into a zero-argument callable that builds a fresh adapter.

    Relative file paths are taken from `rootdir`: the directory a SPEC was typed in (command line),
    or pytest's rootdir for a SPEC from an ini file. Raises SpecError with one line on any problem.
    """
    return TrainerSpec.parse(spec, rootdir).resolve()


def problem_of(specs: Iterable[TrainerSpec]) -> str:
    """The one line of the first of `specs` that does not resolve, "" when every one does."""
    try:
        for spec in specs:
            spec.resolve()
    except SpecError as exc:
        return str(exc)
    return ""


def first_problem(specs: str) -> str:
    """`problem_of` the SPECs in `specs` (JSON: [[text, base], ...]). Called by name where the ranks'
    imports are made already (`Controller.call_where_ranks_start`)."""
    return problem_of(TrainerSpec.parse(text, base) for text, base in json.loads(specs))


def _kind(text: str) -> str | None:
    """Which of the SPEC shapes `text` has: the one place a SPEC's shape is read."""
    spec = text.strip()
    if spec in BUILTINS:
        return BUILTIN
    if spec.startswith(LIGHTNING_PREFIX):
        return LIGHTNING
    if spec.startswith(SCRIPT_PREFIX):
        return SCRIPT
    target, sep, attr = spec.rpartition(":")
    return ATTRIBUTE if sep and target and attr else None


def trainer_label(spec: str) -> str:
    """A short, readable name for a SPEC in test ids and the report: built-ins as is, a file SPEC
    by its file stem (plus the attribute when it is not `Trainer`), a module SPEC by its last part,
    a `lightning:` SPEC by the names of its parts (`LitModel+LitData`), a `script:` SPEC by its script."""
    return _label(_kind(spec), spec.strip())


def _label(kind: str | None, spec: str) -> str:
    if kind == LIGHTNING:  # lightning:pkg.model:LitModel+pkg.data:LitData -> LitModel+LitData
        return "+".join(part.rpartition(":")[2].strip() for part in spec[len(LIGHTNING_PREFIX):].split("+"))
    if kind == SCRIPT:  # script:path/train.py --flags ... -> train.py
        words = spec[len(SCRIPT_PREFIX):].split()
        if words[:2] == ["accelerate", "launch"]:  # the launcher's flags, then the script: its first `.py`
            words = [word for word in words[2:] if word.endswith(".py")] or words
        return PurePath(words[0]).name if words else spec
    if kind != ATTRIBUTE:
        return spec
    target, _, attr = spec.rpartition(":")
    stem = PurePath(target).stem if _is_file_spec(target) else target.rsplit(".", 1)[-1]
    return stem if attr == "Trainer" else f"{stem}.{attr}"


def trainer_labels(specs: Iterable[str]) -> dict[str, str]:
    """Each SPEC's one name for the session (test id, matrix and JSON): its `trainer_label`, or the SPEC
    itself where two SPECs would share a label (two `conformance_adapter.py` in different folders)."""
    labels = {spec: trainer_label(spec) for spec in specs}
    taken = Counter(labels.values())
    return {spec: label if taken[label] == 1 else spec for spec, label in labels.items()}


def session_trainers(specs: Iterable[str], base: str | Path) -> tuple[TrainerSpec, ...]:
    """The session's SPECs, each parsed once with its session label (`trainer_labels`)."""
    labels = trainer_labels(specs)
    return tuple(TrainerSpec.parse(spec, base, label) for spec, label in labels.items())


def _resolve_script(spec: str, base: Path) -> Factory:
    """A `script:` SPEC: checked here (the script exists, the placeholders are known), run in the ranks."""
    try:
        parse_script_spec(spec, base)
    except ScriptSpecError as exc:
        raise SpecError(_message(spec, str(exc))) from None
    return functools.partial(ScriptAdapter, spec, base)


def _attribute(spec: str, target: str, attr: str, rootdir: Path, candidates: Callable[[ModuleType], list[str]]) -> Any:
    """`target`'s attribute `attr`, `target` being a module or a file; one line naming what is there if not."""
    if _is_file_spec(target):
        path = Path(target)
        module = _import_file(spec, path if path.is_absolute() else rootdir / path, target)
    else:
        module = _import_module(spec, target, rootdir)
    if not hasattr(module, attr):
        found = candidates(module)
        hint = f" ({_KINDS[candidates]} there: {', '.join(found)})" if found else ""
        raise SpecError(_message(spec, f"{target} has no attribute {attr!r}{hint}"))
    return getattr(module, attr)


def _adapters_in(module: ModuleType) -> list[str]:
    return sorted(n for n, v in vars(module).items()
                  if isinstance(v, type) and issubclass(v, TrainerAdapter) and v is not TrainerAdapter)


def _lightning_classes_in(module: ModuleType) -> list[str]:
    return sorted(n for n, v in vars(module).items() if _lightning_kind(v) and v.__module__ == module.__name__)


_KINDS: dict[Any, str] = {_adapters_in: "adapters", _lightning_classes_in: "Lightning classes"}


def _lightning_kind(value: Any) -> str:
    """"module" or "datamodule" for a LightningModule/LightningDataModule subclass, else "". Read from
    the class's bases by name, so that no Lightning import is needed to tell."""
    if not isinstance(value, type):
        return ""
    names = {(base.__module__.split(".")[0], base.__name__) for base in value.__mro__[1:]}
    if ("lightning", "LightningModule") in names or ("pytorch_lightning", "LightningModule") in names:
        return "module"
    if ("lightning", "LightningDataModule") in names or ("pytorch_lightning", "LightningDataModule") in names:
        return "datamodule"
    return ""


# ---------------------------------------------------------------------------------------------------
# lightning:MODULE[+DATAMODULE] | lightning:FACTORY

_LIGHTNING_USAGE = ("expected lightning:pkg.module:LitModule[+pkg.module:LitDataModule] or "
                    "lightning:path/to/file.py:factory (each part package.module:Attr or path/to/file.py:Attr)")


class _LightningFactory:
    """Builds a `LightningAdapter` on what a `lightning:` SPEC named (imports Lightning when called)."""

    def __init__(self, parts: LightningParts) -> None:
        self.parts = parts
        self.name = parts.label

    def __call__(self) -> TrainerAdapter:
        from .lightning_adapter import LightningAdapter  # deferred: it imports lightning and torch

        return LightningAdapter(self.parts)

    def __repr__(self) -> str:
        return f"<lightning trainer {self.name!r}>"


def _resolve_lightning(spec: str, rootdir: Path) -> Factory:
    """`lightning:` followed by one part (a LightningModule class, or a factory) or two (a module and
    a datamodule, in either order), each `package.module:Attr` or `path/to/file.py:Attr`."""
    pieces = [piece.strip() for piece in spec[len(LIGHTNING_PREFIX):].split("+")]
    if not 1 <= len(pieces) <= 2 or not all(p.rpartition(":")[0] and p.rpartition(":")[2] for p in pieces):
        raise SpecError(_message(spec, _LIGHTNING_USAGE))
    named: dict[str, Any] = {}
    for piece in pieces:
        target, _, attr = piece.rpartition(":")
        value = _attribute(spec, target, attr, rootdir, _lightning_classes_in)
        kind = _lightning_kind(value) or _lightning_factory(spec, attr, value, len(pieces))
        if kind in named:
            raise SpecError(_message(spec, f"names two Lightning {kind}s ({named[kind].__name__}, {attr}); "
                                           "expected one LightningModule and at most one LightningDataModule"))
        if isinstance(value, type):
            _needs_no_arguments(spec, attr, value)
        named[kind] = value
    if "factory" not in named and "module" not in named:
        raise SpecError(_message(spec, f"names no LightningModule (only the datamodule {pieces[0]}); "
                                       "name the module too: lightning:pkg.module:LitModule+" + pieces[0]))
    label = "+".join(piece.rpartition(":")[2] for piece in pieces)
    return _LightningFactory(LightningParts(spec=spec, label=label, module=named.get("module"),
                                            datamodule=named.get("datamodule"), factory=named.get("factory")))


def _lightning_factory(spec: str, attr: str, value: Any, parts: int) -> str:
    """"factory" for a zero-argument callable named alone; one line for anything else."""
    if isinstance(value, type):
        raise SpecError(_message(spec, f"{attr} is a class but neither a LightningModule nor a LightningDataModule"))
    if not callable(value):
        raise SpecError(_message(spec, f"{attr} is a {type(value).__name__}, not a LightningModule, a "
                                       "LightningDataModule or a factory"))
    if parts > 1:
        raise SpecError(_message(spec, f"{attr} is a factory, which names everything itself: name it alone "
                                       f"(lightning:...:{attr})"))
    _needs_no_arguments(spec, attr, value)
    return "factory"


def _needs_no_arguments(spec: str, attr: str, value: Any) -> None:
    try:
        inspect.signature(value).bind()
    except TypeError:
        raise SpecError(_message(spec, f"{attr} needs arguments; name a zero-argument factory that returns "
                                       "(module, datamodule, trainer_kwargs) instead")) from None
    except ValueError:
        pass  # no signature to read: the call will tell


def _as_factory(spec: str, value: Any) -> Factory:
    if isinstance(value, type):
        if issubclass(value, TrainerAdapter):
            return value
        kind = _lightning_kind(value)
        if kind:
            shown = "a LightningModule" if kind == "module" else "a LightningDataModule"
            raise SpecError(_message(spec, f"{value.__name__} is {shown}: check it with a lightning: SPEC, "
                                           "lightning:pkg.module:LitModule[+pkg.module:LitDataModule]"))
        raise SpecError(_message(spec, f"{value.__name__} is a class but not a TrainerAdapter subclass "
                                       "(see docs/adapter.md)"))
    if isinstance(value, TrainerAdapter):
        raise SpecError(_message(spec, "names an adapter instance; name its class or a zero-argument "
                                       "factory (each rank needs a fresh one)"))
    if not callable(value):
        raise SpecError(_message(spec, f"names a {type(value).__name__}, not an adapter class "
                                       "or a zero-argument factory"))
    try:
        inspect.signature(value).bind()
    except TypeError:
        raise SpecError(_message(spec, "names a callable that needs arguments; an adapter factory "
                                       "takes none")) from None
    except ValueError:
        pass  # builtins without a signature: trust the call below
    factory = _CheckedFactory(spec, value)
    try:
        factory()  # fail now, in the pytest process, rather than once per rank
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(_message(spec, f"the factory raised {_one_line(exc)}")) from exc
    return factory
