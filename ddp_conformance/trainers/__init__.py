"""Trainers the conformance checks can judge: the two references and SPEC resolution.

Kept import-light on purpose: `from ddp_conformance.trainers import resolve_spec` must not import
torch or lightning, because the plugin resolves `--ddp-trainer` in every session that passes it.
The references themselves (`torch_ref`, `lightning_ref`) are imported only when resolved.
"""

from .spec import BUILTINS, SpecError, resolve_spec

__all__ = ["BUILTINS", "SpecError", "resolve_spec"]
