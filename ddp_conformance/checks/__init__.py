"""Both processes: the conformance checks, and the one entry point the suite calls inside every rank.

Each check is a module (or a package, when it has a second look of its own) with
`run(ctx: CheckContext) -> dict`, written against the adapter only (`ddp_conformance.adapter`): it
never imports a trainer. A check either returns its figures (pass), raises `CheckFailed` whose first
line names the bug (fail), or calls `pytest.skip(reason)` when the adapter cannot give what it needs
(`NotProvided`) or the platform cannot run it. `run_check` records each of the three as one
`CheckResult`, sent once to the pytest process (`ddp.figures[RESULT_FIGURE]`), and lets the check's own
verdict end the test; the report reads the verdict and figures from that value alone. What the checks
share is in `support/`.

Importing this package does not import torch: the suite and the report import it in the pytest
process for the check ids and the result's shape.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..adapter import NotProvided, named
from ..selection import CHECK_IDS, DEFAULT_CHECKS
from .support import session_evidence
from .support.check_context import CheckContext, CheckFailed, CheckOptions, hide_on_verdict

#: the one `ddp.figures` key a check's result travels under (rank 0's becomes the test's user property)
RESULT_FIGURE = "conformance_result"
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
#: the checks that read the shared one-step probe fit (`support/shared_fit.py`) through a watcher of their own,
#: their module's `PROBE_WATCHER`: the probe carries every one of them, since whichever check runs it first,
#: the others reuse it
PROBE_READERS = ("bucket_view_memory", "initial_sync", "resume_fidelity", "sync_batchnorm")
#: the same for the shared fit to n: their module's `LONG_FIT_WATCHERS(k, n, checkpoint_at)` plans their watchers
LONG_FIT_READERS = ("resume_fidelity",)


@dataclass(frozen=True)
class CheckResult:
    """One check's result on one rank: its outcome, its verdict (the failure's diagnosis, the skip's
    reason, "" on a pass) and the figures it measured. Travels as a plain dict (`as_figure`), which
    pickles to the pytest process and crosses pytest-xdist like any user property."""

    outcome: str
    verdict: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def as_figure(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "verdict": self.verdict, "figures": self.figures}

    @classmethod
    def from_figure(cls, value: Any) -> CheckResult | None:
        """The result sent as `as_figure`, or None for anything else (a test that ended before its check did)."""
        if not isinstance(value, dict) or not isinstance(value.get("figures"), dict):
            return None
        return cls(str(value.get("outcome", "")), str(value.get("verdict", "")), value["figures"])


def stall_seconds(timeout: float) -> float:
    """A tenth of the test timeout, within [2, 15] s: a healthy rank finishes its last step well
    inside 2 s of its peers (they meet in that step's all-reduce), and the verdict must come
    before the harness kills the test."""
    return min(15.0, max(2.0, timeout / 10.0))


def probe_watchers() -> tuple[Any, ...]:
    """What makes each probe reader's watcher (`PROBE_READERS`)."""
    return tuple(importlib.import_module(f"{__name__}.{check_id}").PROBE_WATCHER for check_id in PROBE_READERS)


def long_fit_watchers() -> tuple[Any, ...]:
    """What plans each long-fit reader's watchers (`LONG_FIT_READERS`)."""
    return tuple(importlib.import_module(f"{__name__}.{check_id}").LONG_FIT_WATCHERS for check_id in LONG_FIT_READERS)


def run_check(check_id: str, options: CheckOptions, ddp: Any, workdir: Any) -> CheckResult:
    """Run one check for one trainer on this rank; the suite's test body.

    Resolves the parsed SPEC in this rank (classes do not cross processes), reconciles the config
    with the group the harness started, and puts the check's one result in `ddp.figures`, as it grows
    (what a check measured before an error of its own is reported). The check's own verdict, a
    `CheckFailed` or a skip, goes on as the check raised it: the result records it, and it ends the test.
    Returns the result of a check that passed.
    """
    __tracebackhide__ = hide_on_verdict
    if check_id not in CHECK_IDS:
        raise ValueError(f"unknown check {check_id!r}; known: {', '.join(CHECK_IDS)}")
    module = importlib.import_module(f"{__name__}.{check_id}")
    figures: dict[str, Any] = {}
    ddp.figures[RESULT_FIGURE] = CheckResult("", figures=figures).as_figure()  # the figures so far, if it errs
    ctx: CheckContext | None = None
    result: CheckResult | None = None
    try:
        with named(options.trainer.label):
            ctx = CheckContext.create(check_id, options, ddp, Path(workdir), figures)
            ctx.probe_watchers, ctx.long_fit_watchers = probe_watchers(), long_fit_watchers()
            result = CheckResult(PASSED, figures=ctx.finish(module.run(ctx)))
        return result
    except CheckFailed as exc:
        result = CheckResult(FAILED, str(exc), figures)
        raise
    except (NotProvided, pytest.skip.Exception) as exc:
        # a skip keeps what the check spent and observed before it: its time is the suite's cost too
        reason = exc.msg if isinstance(exc, pytest.skip.Exception) else str(exc)
        result = CheckResult(SKIPPED, reason, ctx.finish({}) if ctx is not None else figures)
        if isinstance(exc, NotProvided):  # the adapter cannot give what the check needs: it does not apply
            pytest.skip(reason)
        raise
    finally:
        if result is not None:
            ddp.figures[RESULT_FIGURE] = result.as_figure()
        else:
            # after an error of the check's own the process may hold anything; a verdict leaves it as the check's
            # completed fits did (a fit that raised or hung has already dropped the evidence, in `guarded_fit`)
            session_evidence.forget()


__all__ = ["CHECK_IDS", "DEFAULT_CHECKS", "RESULT_FIGURE", "CheckContext", "CheckFailed", "CheckOptions",
           "CheckResult", "run_check", "stall_seconds"]
