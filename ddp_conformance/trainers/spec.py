"""`--ddp-trainer SPEC` resolution: a built-in name, `package.module:Attr` or `path/to/file.py:Attr`.

Resolution happens twice: once in the pytest process, so a bad SPEC is a one-line usage error
before anything is spawned, and again inside every rank (the ranks receive the SPEC string, not the
class), which is why a file SPEC is imported under a name derived from its absolute path: the same
file gives the same module name in every process, so its classes pickle by reference.

This module imports neither torch nor lightning; the built-ins are imported only when their factory
is called, inside a rank.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ..adapter import NotProvided, TrainerAdapter

BUILTINS: dict[str, str] = {
    "torch": "ddp_conformance.trainers.torch_ref:TorchTrainer",
    "lightning": "ddp_conformance.trainers.lightning_ref:LightningTrainer",
}

Factory = Callable[[], TrainerAdapter]


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
    return f"trainer SPEC {spec!r}: {reason}"


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
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise SpecError(_message(spec, f"cannot import {shown}: {_one_line(exc)}")) from exc
    return module


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


def resolve_spec(spec: str, rootdir: Path) -> Factory:
    """Turn a SPEC into a zero-argument callable that builds a fresh adapter.

    Relative file paths are taken from `rootdir`: the directory a SPEC was typed in (command line),
    or pytest's rootdir for a SPEC from an ini file. Raises SpecError with one line on any problem.
    """
    spec = spec.strip()
    if spec in BUILTINS:
        return _Builtin(spec)
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise SpecError(_message(spec, "expected a built-in name (" + ", ".join(BUILTINS)
                                 + "), package.module:Attr or path/to/file.py:Attr"))
    if _is_file_spec(target):
        path = Path(target)
        module = _import_file(spec, path if path.is_absolute() else Path(rootdir) / path, target)
    else:
        module = _import_module(spec, target, Path(rootdir))
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items()
                        if isinstance(v, type) and issubclass(v, TrainerAdapter) and v is not TrainerAdapter)
        hint = f" (adapters there: {', '.join(public)})" if public else ""
        raise SpecError(_message(spec, f"{target} has no attribute {attr!r}{hint}"))
    return _as_factory(spec, getattr(module, attr))


def _as_factory(spec: str, value: Any) -> Factory:
    if isinstance(value, type):
        if issubclass(value, TrainerAdapter):
            return value
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
