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
import os
import time
from pathlib import Path
Path(__file__).with_name("resolving").write_text(str(os.getpid()))  # where, and in which process
time.sleep(60)  # resolving this SPEC takes long enough to be interrupted
Trainer = None
"""
SLOW_TEST_FILE = """
import os
import time
from pathlib import Path
Path(__file__).with_name("collecting").write_text(str(os.getpid()))
time.sleep(60)  # collecting this file takes long enough to be interrupted
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


@pytest.mark.parametrize("interrupted", ["resolving", "collecting"])
def test_a_ci_runner_s_sigterm_while_the_specs_are_resolved_leaves_no_process_or_directory(
        tmp_path: Path, interrupted: str) -> None:
    """The fork server starts before the SPECs are resolved (in a process it forks, while pytest configures):
    a SIGTERM while they are resolved, or while pytest collects (a CI job cancelled), must unwind pytest as
    Ctrl-C does, at once, so that the fork server, the process resolving and the private directory go with
    it. Interrupted while collecting, pytest still calls the hooks that end a collection: nothing may wait
    there."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("needs Linux /proc to see the fork server")
    (tmp_path / "slow_trainer.py").write_text(SLOW_TRAINER)
    (tmp_path / "test_slow_to_collect.py").write_text(SLOW_TEST_FILE)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = dict(os.environ, TMPDIR=str(temp))
    # collecting: a SPEC resolved at once (built in), so that pytest gets to the slow test file
    collecting = interrupted == "collecting"
    tests, spec = (["test_slow_to_collect.py"], "torch") if collecting else ([], "slow_trainer.py:Trainer")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                             "ddp_conformance.suite", *tests, "--ddp-trainer", spec],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / interrupted).is_file():
            assert proc.poll() is None and time.monotonic() < deadline, f"pytest never got to {interrupted}"
            time.sleep(0.1)
        servers = _fork_servers_of(proc.pid)
        assert servers, f"the fork server had not started when pytest got to {interrupted}"
        busy = int((tmp_path / interrupted).read_text())
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)  # not the 60 s of a SPEC resolved after the collection it interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(1)
    assert not [pid for pid in [*servers, busy] if os.path.exists(f"/proc/{pid}")]
    # torch's own compile cache (torchinductor_<user>), made by importing torch._dynamo and kept across runs
    # by design, is not ours to remove
    assert [path for path in temp.iterdir() if not path.name.startswith("torchinductor_")] == []
    assert not (tmp_path / "resolving").exists() or interrupted == "resolving"


LIT_MODULE = """
import lightning.pytorch as pl

class LitModel(pl.LightningModule):
    pass
"""
WHAT_PYTEST_IMPORTED = """
import sys

def pytest_collection_finish(session):
    print("PYTEST IMPORTED:", sorted(name for name in ("lightning",) if name in sys.modules))
"""


# exec'd ranks are the fallback (no fork, or DDP_CONFORMANCE_SPAWN=exec): their variant, whose pytest imports
# Lightning itself, runs with -m slow
@pytest.mark.parametrize("spawn", ["fork", pytest.param("exec", marks=pytest.mark.slow)])
def test_a_spec_is_resolved_where_the_ranks_imports_are_and_a_bad_one_is_still_one_usage_line(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, spawn: str) -> None:
    """A SPEC that imports code (here Lightning's, ~4 s of CPU) is resolved in a process the fork server forks,
    which has imported it for the ranks already: not again in pytest's process, on a 2-core machine the ranks'
    way to their first test. A bad one is still one usage line. Without a fork server (exec'd ranks) pytest
    resolves it itself, with the same line."""
    pytester.makeconftest(WHAT_PYTEST_IMPORTED)
    pytester.makepyfile(lit_model=LIT_MODULE)
    monkeypatch.setenv("DDP_CONFORMANCE_SPAWN", spawn)
    common = ["-s", "-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "--collect-only"]
    good = pytester.runpytest_subprocess(*common, "--ddp-trainer", "lightning:lit_model.py:LitModel")
    assert good.ret == 0, good.stdout.str() + good.stderr.str()
    good.stdout.fnmatch_lines(["PYTEST IMPORTED: []" if spawn == "fork" else "PYTEST IMPORTED: ['lightning'*"])
    bad = pytester.runpytest_subprocess(*common, "--ddp-trainer", "lightning:lit_model.py:LitModl")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert not bad.stdout.lines, bad.stdout.str()  # before the session: no header, no collection
    assert bad.stderr.lines == ["ERROR: --ddp-trainer: 'lightning:lit_model.py:LitModl': lit_model.py has no attribute "
                                "'LitModl' (Lightning classes there: LitModel)"] or bad.stderr.str()


SRC_TRAINER = """
from ddp_conformance.trainers.torch_ref import TorchTrainer


class Trainer(TorchTrainer):
    name = "from_src"
"""


def test_a_spec_importable_through_pytest_s_own_pythonpath_resolves_as_in_the_ranks(pytester: pytest.Pytester) -> None:
    """The SPEC is resolved where the ranks' imports are, but with pytest's sys.path and working directory, as
    the ranks run each test: a package only pytest's `pythonpath` ini option makes importable (a src layout)
    resolves there too, and a misspelt one is still the usage line."""
    pytester.makeini("[pytest]\npythonpath = src\n")
    package = pytester.path / "src" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "trainer.py").write_text(SRC_TRAINER)
    common = ["-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite", "--collect-only", "-q"]
    good = pytester.runpytest_subprocess(*common, "--ddp-trainer", "mypkg.trainer:Trainer")
    assert good.ret == 0, good.stdout.str() + good.stderr.str()
    good.stdout.fnmatch_lines(["*test_conformance[[]trainer-rank_participation[]]*"])
    bad = pytester.runpytest_subprocess(*common, "--ddp-trainer", "mypkg.trainer:Trainr")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert not bad.stdout.lines, bad.stdout.str()  # before the session: no header, no collection
    assert bad.stderr.lines == ["ERROR: --ddp-trainer: 'mypkg.trainer:Trainr': mypkg.trainer has no attribute "
                                "'Trainr' (adapters there: Trainer)"] or bad.stderr.str()
