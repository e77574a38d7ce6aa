"""Both processes: what a rank process keeps between the tests of a session: the evidence of a fit that several checks
judge (`checks/support/shared_fit.py`).

Everything is kept under a key that names all it depends on (the SPEC, the config, the group), and
is reused only when every rank still holds it: a rank that ran the collective fit alone would wait
in it forever. `forget` drops all of it where the process may no longer be what a fresh one is: after
a fit that raised or hung (`guarded_fit`) and after a check's own error (`run_check`). A verdict
computed from fits that ended normally keeps it: those fits leave the process as passing ones do.
A rebuilt pool is fresh processes, which hold nothing. No torch at import: the pytest process imports
this module with `ddp_conformance.checks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .check_context import all_gather

_Kept = TypeVar("_Kept")
_KEPT: dict[tuple[Any, ...], Any] = {}


def kept_or_run(key: tuple[Any, ...], run: Callable[[], _Kept]) -> tuple[_Kept, bool]:
    """(what is kept under `key`, True) where every rank holds it, else (`run()`'s value, now kept,
    False). Collective in an initialised group: every rank must ask."""
    held = _KEPT.get(key)
    if all(all_gather(held is not None)):
        return held, True
    _KEPT.pop(key, None)
    value = run()
    _KEPT[key] = value
    return value, False


def forget() -> None:
    """Drop everything this rank keeps: every check after this fits afresh."""
    _KEPT.clear()
