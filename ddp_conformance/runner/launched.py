"""Ranks someone else started: pytest itself running under torchrun, or srun with torch's env://
variables exported. Nothing is spawned; each pytest process is one rank, marked tests run in it, and
the ranks agree on every outcome through the launcher's store, so a test fails everywhere if it failed
anywhere, naming the rank. Only rank 0 prints.

The agreement travels through the store, not a collective: a test that broke or hung the group
must still be reported.

This controller sits beside `parent/` and `rank/` rather than in either: there is no parent here,
because this pytest process is itself a rank. So it uses the rank side's fixture value (`DdpContext`,
on `rank_device`) and runs the test body in pytest, as pytest calls it, instead of through a `Task`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from _pytest._io import TerminalWriter

from .controller import DdpTest, RunnerSettings, skip_at_item
from .rank.ddp_context import DdpContext, rank_device
from .ranks import ranks_label
from .wire import FAILED

AGREE_KEY = "ddp-conformance/outcome"
AGREED_KEY = pytest.StashKey[bool]()
CONTEXT_KEY = pytest.StashKey[DdpContext]()


def launched_externally(environ: dict[str, str] | None = None) -> bool:
    """torch's env:// contract is set for this very process (not one of our own pooled ranks)."""
    env = os.environ if environ is None else environ
    if "DDP_CONFORMANCE_STORE" in env:
        return False
    return all(name in env for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@dataclass(frozen=True)
class LaunchedRank:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_env(cls) -> LaunchedRank:
        world_size = int(os.environ["WORLD_SIZE"])
        return cls(rank=int(os.environ["RANK"]), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   world_size=world_size, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


class LauncherController:
    """The controller of launcher mode (the counterpart of `parent.pool_controller.PoolController`): this pytest
    process is one rank, and a marked test runs right here, inside the launcher's group."""

    def __init__(self, settings: RunnerSettings) -> None:
        self.me = LaunchedRank.from_env()
        self.requested_backend = settings.backend
        self.timeout = settings.timeout
        self.backend: str | None = None
        self.unusable_reason = ""
        self._seen: dict[str, int] = {}

    # -- the controller's face (see controller.Controller) ----------------------------------------
    def expect(self, preload: tuple[str, ...]) -> None:
        pass  # nothing to start: the launcher started the ranks

    def call_where_ranks_start(self, target: str, argument: str) -> str | None:
        return None  # this process is a rank: what it imports for the call, its tests use

    def collection_finished(self, tests: Sequence[DdpTest]) -> None:
        pass  # nothing to start: the launcher started the ranks

    def session_started(self, config: pytest.Config) -> None:
        quiet_non_zero_rank_output(config)

    def setup(self, item: pytest.Item, test: DdpTest) -> None:
        reason = self.skip_reason(test.requested_size) or self.unusable_reason
        if reason:
            skip_at_item(reason)
        self.ensure_group()
        self.arm_watchdog(test.timeout)

    def fixture_value(self, item: pytest.Item, test: DdpTest | None) -> DdpContext:
        if test is None:
            pytest.fail(f"{item.nodeid}: the ddp fixture needs the test marked @pytest.mark.ddp", pytrace=False)
        context = self.context()
        item.stash[CONTEXT_KEY] = context  # its figures become the test's properties
        return context

    def call(self, item: pytest.Function, test: DdpTest) -> bool | None:
        return None  # the test body runs here, on this rank, as pytest calls it

    def teardown(self, item: pytest.Item, test: DdpTest) -> None:
        self.disarm_watchdog()

    def report(self, item: pytest.Item, test: DdpTest, call: pytest.CallInfo[None],
               report: pytest.TestReport) -> None:
        self.agree_on_report(item, call.when, report)

    def session_finished(self) -> None:
        pass  # rank 0 says it is done only at close, after its terminal summary: see finish()

    def close(self) -> None:
        self.finish()

    def skip_reason(self, world_size: int | None) -> str | None:
        if world_size is not None and world_size != self.me.world_size:
            return f"the launcher started {self.me.world_size} ranks; this test needs {world_size}"
        return None

    def context(self) -> DdpContext:
        backend = self.ensure_group()
        return DdpContext(rank=self.me.rank, local_rank=self.me.local_rank, world_size=self.me.world_size,
                          backend=backend, device_name=rank_device(backend, self.me.local_rank))

    def ensure_group(self) -> str:
        import torch  # deferred: torch is heavy to import, and pytest loads this plugin in every session
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = self.requested_backend
            if backend == "auto":
                enough = torch.cuda.is_available() and torch.cuda.device_count() >= self.me.local_world_size
                backend = "nccl" if enough and dist.is_nccl_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(self.me.local_rank)
            dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=self.timeout))
        self.backend = str(dist.get_backend())
        return self.backend

    def agree(self, nodeid: str, outcome: str, summary: str) -> dict[int, tuple[str, str]]:
        """Publish this rank's outcome of a test and read everyone's; a rank that does not publish
        within the timeout is reported as silent (hung or dead). Keys name the test (and how often it
        ran), so ranks whose setups went differently still compare the same test."""
        import torch.distributed as dist  # deferred: torch is heavy to import

        store = dist.distributed_c10d._get_default_store()
        occurrence = self._seen[nodeid] = self._seen.get(nodeid, 0) + 1
        prefix = f"{AGREE_KEY}/{nodeid}/{occurrence}"
        store.set(f"{prefix}/{self.me.rank}", pickle.dumps((nodeid, outcome, summary)))
        keys = [f"{prefix}/{rank}" for rank in range(self.me.world_size)]
        outcomes: dict[int, tuple[str, str]] = {}
        with contextlib.suppress(Exception):  # the silent ranks are reported below
            store.wait(keys, timedelta(seconds=self.timeout))
        for rank, key in enumerate(keys):
            outcomes[rank] = (FAILED, f"did not report within {self.timeout:g} s (hung or dead)")
            with contextlib.suppress(Exception):
                if store.check([key]):
                    _, their_outcome, their_summary = pickle.loads(store.get(key))
                    outcomes[rank] = (their_outcome, their_summary)
        return outcomes


    def arm_watchdog(self, timeout: float) -> None:
        """No supervisor here to kill a hung test: past its limit, print every thread's stack and end
        this rank (the launcher then ends the others), rather than hold the CI job. The stacks go to
        the terminal pytest had before it started capturing: a captured stream dies with the rank."""
        faulthandler.dump_traceback_later(timeout, exit=True, file=_terminal())

    @staticmethod
    def disarm_watchdog() -> None:
        faulthandler.cancel_dump_traceback_later()

    def finish(self) -> None:
        """Rank 0 says it is done; the others wait for that before exiting, so the launcher (which
        tears every rank down when one exits non-zero) never cuts rank 0's report short."""
        import torch.distributed as dist  # deferred: torch is heavy to import

        if not dist.is_initialized():
            return
        with contextlib.suppress(Exception):
            store = dist.distributed_c10d._get_default_store()
            if self.me.rank == 0:
                store.set(f"{AGREE_KEY}/rank0-done", b"1")
            else:
                store.wait([f"{AGREE_KEY}/rank0-done"], timedelta(seconds=min(self.timeout, 120)))

    def agree_on_report(self, item: pytest.Item, when: str, report: pytest.TestReport) -> None:
        """A rank agrees once per marked test: at its call, or at a setup that did not pass (no call
        follows), so a failure anywhere is a failure everywhere."""
        if item.stash.get(AGREED_KEY, False):
            return
        context = item.stash.get(CONTEXT_KEY, None)
        if when == "call" and context is not None:
            for key, value in context.figures.items():
                report.user_properties.append((key, value))
                item.user_properties.append((key, value))
            if context.unusable_group:  # no pool to rebuild here: the remaining distributed tests skip
                self.unusable_reason = (f"the launcher's process group is unusable after {item.nodeid}: "
                                        f"{context.unusable_group}")
        if when != "call" and not (when == "setup" and not report.passed):
            return
        self.disarm_watchdog()  # the test is over here; waiting for the others has its own limit
        item.stash[AGREED_KEY] = True
        summary = "" if report.passed else (getattr(report, "longreprtext", "") or str(report.longrepr))
        if when == "setup" and report.failed:
            summary = "error in setup:\n" + summary
        outcomes = self.agree(item.nodeid, report.outcome, summary[-4000:])
        merge_report(report, self.me.rank, outcomes)


_TERMINAL: Any = None


def remember_terminal() -> None:
    """Keep a handle on the real stderr; called when the plugin registers, before pytest's capture
    redirects file descriptor 2."""
    global _TERMINAL
    if _TERMINAL is None:
        _TERMINAL = os.fdopen(os.dup(2), "w")


def _terminal() -> Any:
    return _TERMINAL if _TERMINAL is not None else sys.__stderr__


def writes_reports() -> bool:
    """Rank 0 writes the reports; the others would clobber its files."""
    return int(os.environ.get("RANK", "0")) == 0


def quiet_non_zero_rank(config: pytest.Config) -> None:
    """Only rank 0 writes reports (called before junitxml reads its option)."""
    if writes_reports():
        return
    config.option.xmlpath = None
    config.option.ddp_report = None


def quiet_non_zero_rank_output(config: pytest.Config) -> None:
    """Rank 0 prints; the others would only repeat it. The reporter stays registered (assertion
    explanations ask it for its writer); only where it writes changes."""
    if int(os.environ.get("RANK", "0")) == 0:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter._tw = TerminalWriter(file=open(os.devnull, "w"))  # noqa: SIM115 - lives as long as pytest


def merge_report(report: Any, me: int, outcomes: dict[int, tuple[str, str]]) -> None:
    """Make this rank's report say what happened on every rank."""
    failed = sorted(rank for rank, (outcome, _) in outcomes.items() if outcome == FAILED)
    if not failed:
        return
    others = [rank for rank in failed if rank != me]
    if not others:
        return
    lines = [f"{ranks_label(failed)} failed"]
    for rank in others:
        lines.append(f"{'_' * 20} rank {rank} {'_' * 20}\n{outcomes[rank][1]}")
    text = "\n".join(lines)
    if report.passed or report.skipped:
        report.outcome = FAILED
        report.longrepr = text
    else:
        report.sections.append(("other ranks", text))
