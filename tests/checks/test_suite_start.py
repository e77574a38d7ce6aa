"""A session that runs the conformance suite starts its fork server while pytest still validates the
SPECs and collects, asked to import the frameworks the SPECs need (`options.suite_preload`), so
those imports overlap pytest's own; any other session starts nothing before it collects a marked test."""

from __future__ import annotations

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
    if not __import__("os").path.exists("/proc/self/stat"):
        pytest.skip("needs Linux /proc to see the fork server")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", "--collect-only", *args)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([f"FORK SERVERS AT SESSION START: {expected}"])
