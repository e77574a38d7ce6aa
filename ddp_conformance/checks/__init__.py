"""The six conformance checks, and the one entry point the suite calls inside every rank.

Each check is a module with `run(ctx: CheckContext) -> dict` written against the adapter only
(`ddp_conformance.adapter`): it never imports a trainer. A check either returns its figures (pass),
raises `CheckFailed` whose first line names the bug (fail), or calls `pytest.skip(reason)` when
the adapter cannot give what it needs (`NotProvided`) or the platform cannot run it.

Importing this package does not import torch: the suite module imports it in the pytest process
just to learn the check ids.
"""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass

from .base import CheckContext, CheckFailed, hide_on_verdict

#: the check ids, in the order the suite runs them and the report shows them
CHECK_IDS: tuple[str, ...] = (
    "rank_participation",
    "sampler_disjointness",
    "data_consistency",
    "gradient_equivalence",
    "resume_fidelity",
    "bucket_view_memory",
)


@dataclass(frozen=True)
class CheckOptions:
    """What the pytest process decides for a check and pickles to the ranks.

    `stall_after` is how long every rank may go without progress, once some rank has left its
    fit, before the fit counts as hung: it is derived from the test timeout so that the check's own
    verdict (naming the ranks that stopped) arrives before the harness's generic timeout.
    """

    spec_base: str  # what a relative file SPEC is relative to (see options.Settings.spec_base)
    config_path: str | None
    stall_after: float
    trainer_name: str = ""  # the session's name for the trainer (`trainer_labels`); its own label when empty


def stall_seconds(timeout: float) -> float:
    """A tenth of the test timeout, within [2, 15] s: a healthy rank finishes its last step well
    inside 2 s of its peers (they meet in that step's all-reduce), and the verdict must come
    before the harness kills the test."""
    return min(15.0, max(2.0, timeout / 10.0))


def trainer_label(spec: str) -> str:
    """A short, readable name for a SPEC in test ids and the report: built-ins as is, a file SPEC
    by its file stem (plus the attribute when it is not `Trainer`), a module SPEC by its last part,
    a `lightning:` SPEC by the names of its parts (`LitModel+LitData`), a `script:` SPEC by its script."""
    from pathlib import PurePath

    if spec.startswith("lightning:"):  # lightning:pkg.model:LitModel+pkg.data:LitData -> LitModel+LitData
        return "+".join(part.rpartition(":")[2].strip() for part in spec[len("lightning:"):].split("+"))
    if spec.startswith("script:"):  # script:path/train.py --flags ... -> train.py
        words = spec[len("script:"):].split()
        return PurePath(words[0]).name if words else spec
    target, sep, attr = spec.rpartition(":")
    if not sep:
        return spec
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    stem = PurePath(target).stem if is_file else target.rsplit(".", 1)[-1]
    return stem if attr == "Trainer" else f"{stem}.{attr}"


def trainer_labels(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Each SPEC's one name for the session (test id, matrix and JSON): its `trainer_label`, or the SPEC
    itself where two SPECs would share a label (two `conformance_adapter.py` in different folders)."""
    labels = {spec: trainer_label(spec) for spec in specs}
    taken = Counter(labels.values())
    return {spec: label if taken[label] == 1 else spec for spec, label in labels.items()}


def run_check(check_id: str, spec: str, options: CheckOptions, ddp: object, workdir: object) -> dict:
    """Run one check for one trainer SPEC on this rank; the suite's test body.

    Resolves the SPEC and loads the config again inside the rank (the ranks receive strings, not
    classes), reconciles the config with the group the harness started, and turns `NotProvided`
    into a skip that says what was missing.
    """
    __tracebackhide__ = hide_on_verdict
    import pytest

    from ..adapter import NotProvided, named

    if check_id not in CHECK_IDS:
        raise ValueError(f"unknown check {check_id!r}; known: {', '.join(CHECK_IDS)}")
    module = importlib.import_module(f"{__name__}.{check_id}")
    try:
        with named(options.trainer_name or trainer_label(spec)):
            ctx = CheckContext.create(check_id, spec, options.spec_base, options.config_path,
                                      options.stall_after, ddp, workdir)
            return ctx.finish(module.run(ctx))
    except NotProvided as exc:
        pytest.skip(str(exc))
    raise AssertionError("unreachable")  # pragma: no cover - pytest.skip raises


__all__ = ["CHECK_IDS", "CheckContext", "CheckFailed", "CheckOptions", "run_check", "stall_seconds",
           "trainer_label", "trainer_labels"]
