"""Both processes: say which adapter call failed: a user's adapter that raises (or a checkpoint it cannot read) must
give one line naming the trainer, the method and its arguments, not a bare `OSError: [Errno 22]`."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ...adapter import NotProvided, TrainerBuildError, adapter_name


class AdapterError(Exception):
    """A trainer's own code raised while a check was asking it for something."""


def _show(value: Any) -> str:
    if isinstance(value, Path):
        return "/".join(value.parts[-3:])  # enough of a path to recognise the file
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class CallNamingAdapter:
    """Passes every attribute through; a method call that raises is re-raised as `AdapterError`
    naming the call (the original exception stays chained, its traceback in the report)."""

    def __init__(self, adapter: Any) -> None:
        object.__setattr__(self, "_adapter", adapter)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._adapter, name)
        if name.startswith("_") or not callable(value):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except (NotProvided, AdapterError, TrainerBuildError):
                raise  # already the harness's own words about this trainer
            except Exception as exc:
                if type(exc).__module__.startswith(("_pytest", "pytest", "ddp_conformance.checks")):
                    raise  # skips, fails and check verdicts are not the adapter's errors
                shown = ", ".join([*map(_show, args),
                                   *(f"{k}={_show(v)}" for k, v in kwargs.items() if k != "observer")])
                first = str(exc).splitlines()[0] if str(exc) else ""
                # the cause first: a report clips long headlines
                raise AdapterError(f"trainer {adapter_name(self._adapter)}: {name} raised {type(exc).__name__}: "
                                   f"{first} (called as {name}({shown}))") from exc

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._adapter, name, value)
