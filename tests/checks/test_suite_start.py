"""A session that runs the conformance suite starts its fork server while pytest still validates the
SPECs and collects, asked to import the frameworks the SPECs need (`options.suite_preload`), so
those imports overlap pytest's own; any other session starts nothing before it collects a marked test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CONFTEST = """
import os

def pytest_sessionstart(session):
    children = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode().split("\\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and "ddp_conformance.runner.rank.fork_server" in argv:
            children.append(" ".join(argv[argv.index("ddp_conformance.runner.rank.fork_server") + 2:]))
    print("FORK SERVERS AT SESSION START:", children or "none")
"""


@pytest.mark.parametrize(("args", "expected"), [
    (["--pyargs", "ddp_conformance.suite", "--ddp-trainer", "lightning"], "*torch._dynamo lightning.pytorch*"),
    (["--pyargs", "ddp_conformance.suite", "--ddp-trainer", "torch"], "*['torch._dynamo']*"),
    (["test_plain.py", "--ddp-trainer", "lightning"], "*none*"),
], ids=["lightning", "torch", "not-the-suite"])
def test_the_suite_s_fork_server_starts_before_collection_with_the_frameworks_its_specs_need(
        pytester: pytest.Pytester, args: list[str], expected: str) -> None:
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs Linux /proc to see the fork server")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", "--collect-only", *args)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([f"FORK SERVERS AT SESSION START: {expected}"])


SLOW_TRAINER = """
import time
time.sleep(60)  # resolving this SPEC takes long enough to be interrupted
Trainer = None
"""


def _fork_servers_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"ddp_conformance.runner.rank.fork_server" in argv:
            found.append(int(entry))
    return found


def test_a_ci_runner_s_sigterm_while_the_specs_are_resolved_leaves_no_process_or_directory(tmp_path: Path) -> None:
    """The fork server starts before the SPECs are resolved: a SIGTERM then (a CI job cancelled) must
    unwind pytest as Ctrl-C does, so that the fork server and its private directory go with it."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs Linux /proc to see the fork server")
    (tmp_path / "slow_trainer.py").write_text(SLOW_TRAINER)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = dict(os.environ, TMPDIR=str(temp))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                             "ddp_conformance.suite", "--ddp-trainer", "slow_trainer.py:Trainer"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _fork_servers_of(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "the fork server never started"
            time.sleep(0.1)
        servers = _fork_servers_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(1)
    assert not [pid for pid in servers if os.path.exists(f"/proc/{pid}")]
    assert list(temp.iterdir()) == []
