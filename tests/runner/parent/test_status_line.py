"""Progress of long distributed tests: what rank 0 says with `ddp.status` reaches pytest's terminal
once a test runs long, rate-limited, never from another rank, and under -q only for long work."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_conformance.runner.parent import status_line
from ddp_conformance.runner.parent.status_line import StatusLine, read_status
from ddp_conformance.runner.rank import ddp_context
from ddp_conformance.runner.rank.ddp_context import DdpContext

# a test that runs past the first line's threshold (5 s) by a little, so that it prints exactly once;
# rank 0 falls silent after 2 s and rank 1 goes on: were rank 1's words taken, they would be the latest
TESTS = """
import time
import pytest

@pytest.mark.ddp(world_size=2)
def test_long(ddp):
    for step in range(65):
        if ddp.rank == 1 or step < 20:
            ddp.status(f"rank {ddp.rank} fits, step {step} of 65")
        time.sleep(0.1)

@pytest.mark.ddp(world_size=2)
def test_short(ddp):
    ddp.status("a short test's words")
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def session_tmpdir() -> Iterator[Path]:
    """TMPDIR of the pytest session the test runs (short: a pool's socket path has a limit)."""
    path = Path(tempfile.mkdtemp(prefix="ddpt-", dir="/tmp" if os.path.isdir("/tmp") else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_long_test_shows_rank_0_s_status_with_its_name_and_a_short_one_none(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, session_tmpdir: Path) -> None:
    """Through a pipe, as in a CI log: the line comes though stdout is no terminal, and pytest's row of
    results goes on under the test's file after it. The status file goes with the pool's directory."""
    pytester.makepyfile(TESTS)
    monkeypatch.setenv("TMPDIR", str(session_tmpdir))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    lines = [line for line in result.outlines if "[ddp]" in line]
    assert len(lines) == 1, result.outlines
    result.stdout.fnmatch_lines(["  [[]ddp[]] test_long: rank 0 fits, step * of 65 ([5-7] s)",
                                 "test_a_long_test_shows_*.py .*"])
    assert "rank 1" not in result.stdout.str() and "short test" not in result.stdout.str()
    assert not list(session_tmpdir.iterdir())  # nothing left behind: the pools' directories went


@pytest.mark.slow  # a 6.5 s test on purpose; test_under_q_only_long_work_shows judges the same rule in-process
def test_under_q_a_test_shorter_than_the_quiet_threshold_shows_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert "[ddp]" not in result.stdout.str()


def test_a_line_comes_after_the_threshold_at_most_every_interval_and_only_when_the_text_changed(
        tmp_path: Path) -> None:
    path, clock, written = tmp_path / "status", Clock(), []
    line = StatusLine(path, "test_x[a]", written.append, clock=clock)
    path.write_text("step 1")
    clock.now += status_line.PROGRESS_AFTER_SECONDS - 0.1
    line.poll()
    assert written == []  # a test that ends within a few seconds says nothing
    clock.now += 0.1
    line.poll()
    assert written == [f"  [ddp] test_x[a]: step 1 ({status_line.PROGRESS_AFTER_SECONDS:.0f} s)"]
    path.write_text("step 2")
    clock.now += status_line.PROGRESS_EVERY_SECONDS - 0.1
    line.poll()
    assert len(written) == 1  # not yet: one line per interval
    path.write_text("step 1")
    clock.now += 0.1
    line.poll()
    assert len(written) == 1  # the same words as last shown
    path.write_text("step 3")
    line.poll()
    assert written[-1].startswith("  [ddp] test_x[a]: step 3 (")


def test_under_q_only_long_work_shows(tmp_path: Path) -> None:
    path, clock, written = tmp_path / "status", Clock(), []
    line = StatusLine(path, "test_x", written.append, quiet=True, clock=clock)
    path.write_text("step 1")
    clock.now += status_line.QUIET_PROGRESS_SECONDS - 1
    line.poll()
    assert written == []
    clock.now += 1
    line.poll()
    assert written == [f"  [ddp] test_x: step 1 ({status_line.QUIET_PROGRESS_SECONDS:.0f} s)"]


def test_the_line_shows_the_first_line_printable_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "status"
    assert read_status(path) == ""  # the rank said nothing
    path.write_text("\n fit 'a'\x1b[2J, step 1\nsecond line")
    assert read_status(path) == "fit 'a' [2J, step 1"
    path.write_text("x" * 500)
    shown = read_status(path)
    assert len(shown) == status_line.SHOWN_CHARS and shown.endswith("...")


def test_status_writes_whole_files_at_most_every_quarter_second_and_only_where_the_pool_asks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "status"
    ctx = DdpContext(rank=0, local_rank=0, world_size=2, backend="gloo", device_name="cpu", status_file=str(path))
    ctx.status("step 1")
    ctx.status("step 2")  # within STATUS_WRITES_APART_SECONDS: dropped
    assert path.read_text() == "step 1"
    monkeypatch.setattr(ddp_context, "STATUS_WRITES_APART_SECONDS", 0.0)
    ctx.status("step 3")
    assert path.read_text() == "step 3"
    assert [p.name for p in tmp_path.iterdir()] == ["status"]  # written beside, then renamed over it
    DdpContext(rank=1, local_rank=1, world_size=2, backend="gloo", device_name="cpu").status("anything")
    shutil.rmtree(tmp_path)
    ctx.status("the pool's directory is gone")  # and the rank goes on
