"""pytest's built-in fixtures inside ranks: each used once as it should pass and once as it should
fail, on every rank, for that rank. One nested session runs all of them (a session per fixture would
pay a pool start each); the tests below read its per-test outcomes and failure text from JUnit XML."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from ddp_conformance.runner.rank.builtin_fixtures import RankCapture, warnings_recorder

pytestmark = pytest.mark.usefixtures("no_orphans")

TESTS = r'''
import logging
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist


def gathered(value):
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, value)
    return box


@pytest.mark.ddp(world_size=2)
def test_capsys_pass(ddp, capsys):
    print(f"out of rank {ddp.rank}")
    print(f"err of rank {ddp.rank}", file=sys.stderr)
    assert capsys.readouterr() == (f"out of rank {ddp.rank}\n", f"err of rank {ddp.rank}\n")
    with capsys.disabled():
        print(f"straight to the output of rank {ddp.rank}")
    print(f"unread by rank {ddp.rank}")


@pytest.mark.ddp(world_size=2)
def test_capsys_fail(ddp, capsys):
    print(f"hello from {ddp.rank}")
    assert capsys.readouterr().out == "hello from 0\n"


@pytest.mark.ddp(world_size=2)
def test_capsysbinary_pass(ddp, capsysbinary):
    print("bytes")
    assert capsysbinary.readouterr().out == b"bytes\n"


@pytest.mark.ddp(world_size=2)
def test_capfd_pass(ddp, capfd):
    os.system(f"echo shell of rank {ddp.rank}")  # a child process: only fd-level capture sees it
    print(f"python of rank {ddp.rank}")
    out, err = capfd.readouterr()
    assert out == f"shell of rank {ddp.rank}\npython of rank {ddp.rank}\n" and err == ""


@pytest.mark.ddp(world_size=2)
def test_capfd_fail(ddp, capfd):
    os.system(f"echo shell of rank {ddp.rank}")
    assert capfd.readouterr().out == "shell of rank 0\n"


@pytest.mark.ddp(world_size=2)
def test_caplog_pass(ddp, caplog):
    caplog.set_level(logging.INFO)
    logging.getLogger("trainer").info("rank %d ready", ddp.rank)
    if ddp.rank == 1:
        logging.getLogger("trainer").warning("only rank 1 warns")
    expected = [("trainer", logging.INFO, f"rank {ddp.rank} ready")]
    if ddp.rank == 1:
        expected.append(("trainer", logging.WARNING, "only rank 1 warns"))
    assert caplog.record_tuples == expected
    assert f"rank {ddp.rank} ready" in caplog.text and caplog.get_records("call") == caplog.records
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        logging.getLogger("trainer").warning("below the level")
    assert caplog.messages == []


@pytest.mark.ddp(world_size=2)
def test_caplog_fail(ddp, caplog):
    if ddp.rank == 1:
        logging.getLogger("trainer").warning("rank 1 lost its shard")
    assert caplog.messages == []


@pytest.mark.ddp(world_size=2)
def test_recwarn_pass(ddp, recwarn):
    if ddp.rank == 0:
        warnings.warn("rank 0 warns once", UserWarning)
    assert len(recwarn) == (1 if ddp.rank == 0 else 0)
    if ddp.rank == 0:
        assert str(recwarn.pop(UserWarning).message) == "rank 0 warns once"


@pytest.mark.ddp(world_size=2)
def test_recwarn_fail(ddp, recwarn):
    warnings.warn(f"rank {ddp.rank} warns", DeprecationWarning)
    assert len(recwarn) == 0


@pytest.mark.ddp(world_size=2)
def test_monkeypatch_1_pass(ddp, monkeypatch):
    monkeypatch.setenv("PATCHED_IN_RANK", str(ddp.rank))
    monkeypatch.setattr(os, "sep", "!")
    assert os.environ["PATCHED_IN_RANK"] == str(ddp.rank) and os.sep == "!"


@pytest.mark.ddp(world_size=2)
def test_monkeypatch_2_undone(ddp):
    assert "PATCHED_IN_RANK" not in os.environ and os.sep == "/"


@pytest.mark.ddp(world_size=2)
def test_monkeypatch_fail(ddp, monkeypatch):
    monkeypatch.setattr(os, "no_such_attribute", 1)


@pytest.mark.ddp(world_size=2)
def test_tmp_path_factory_pass(ddp, tmp_path_factory, tmp_path):
    first, second = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("data")
    assert first != second and first.is_dir() and second.is_dir()
    assert gathered(str(first)) == [str(first)] * 2  # one directory shared by every rank
    assert gathered(str(tmp_path)) == [str(tmp_path)] * 2
    assert first.is_relative_to(tmp_path_factory.getbasetemp())
    (first / f"rank{ddp.rank}").write_text("x")
    dist.barrier()
    assert sorted(p.name for p in first.iterdir()) == ["rank0", "rank1"]


@pytest.mark.ddp(world_size=2)
def test_tmp_path_factory_fail(ddp, tmp_path_factory):
    tmp_path_factory.mktemp("../outside")


@pytest.mark.slow_marker_for_request(reason="a marker")
@pytest.mark.parametrize("size", [3])
@pytest.mark.ddp(world_size=2)
def test_request_pass(ddp, request, size):
    assert request.node.name == "test_request_pass[3]" and request.node.nodeid.endswith("test_request_pass[3]")
    assert request.node.get_closest_marker("slow_marker_for_request").kwargs == {"reason": "a marker"}
    assert [m.name for m in request.node.iter_markers("ddp")] == ["ddp"]
    assert request.node.get_closest_marker("absent") is None
    assert request.node.callspec.params == {"size": 3} and "size" in request.fixturenames
    assert "slow_marker_for_request" in request.node.keywords


@pytest.mark.ddp(world_size=2)
def test_request_fail(ddp, request):
    request.config.getoption("verbose")


@pytest.mark.ddp(world_size=2)
def test_pytestconfig_unpicklable(ddp, pytestconfig):
    pass
'''


@pytest.fixture(scope="module")  # --dist loadfile: one worker runs the whole module
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One nested pytest run of TESTS: the outcome and failure text of every test, and its output."""
    root = tmp_path_factory.mktemp("builtin-fixtures")
    (root / "test_builtins.py").write_text(TESTS)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow_marker_for_request: a marker\n")
    junit = root / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", f"--junitxml={junit}",
                           f"--basetemp={root / 'basetemp'}", "test_builtins.py"],
                          cwd=root, capture_output=True, text=True, timeout=240)
    assert junit.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = {}
    for case in ET.parse(junit).iter("testcase"):
        failure = case.find("failure")
        cases[case.get("name")] = {"outcome": "failed" if failure is not None else "passed",
                                   "text": (failure.text or "") if failure is not None else ""}
    return {"cases": cases, "stdout": proc.stdout, "basetemp": root / "basetemp"}


def outcome(session: dict[str, Any], name: str) -> dict[str, str]:
    return session["cases"][name]


def test_capsys_captures_each_ranks_own_writes(session: dict[str, Any]) -> None:
    assert outcome(session, "test_capsys_pass")["outcome"] == "passed", outcome(session, "test_capsys_pass")
    assert outcome(session, "test_capsysbinary_pass")["outcome"] == "passed"
    out = session["stdout"]
    for rank in (0, 1):  # unread output and capsys.disabled() reach the rank's output, as in pytest
        assert f"[rank {rank}] straight to the output of rank {rank}" in out
        assert f"[rank {rank}] unread by rank {rank}" in out
        assert f"[rank {rank}] out of rank {rank}" not in out  # read by the test: gone
    failed = outcome(session, "test_capsys_fail")
    assert failed["outcome"] == "failed"
    assert "1 of 2 ranks failed: rank 1 failed" in failed["text"]
    assert "'hello from 1\\n' == 'hello from 0\\n'" in failed["text"]


def test_capfd_captures_each_ranks_file_descriptors(session: dict[str, Any]) -> None:
    assert outcome(session, "test_capfd_pass")["outcome"] == "passed", outcome(session, "test_capfd_pass")
    failed = outcome(session, "test_capfd_fail")
    assert failed["outcome"] == "failed" and "1 of 2 ranks failed: rank 1 failed" in failed["text"]
    assert "'shell of rank 1\\n' == 'shell of rank 0\\n'" in failed["text"]


def test_caplog_records_each_ranks_logging(session: dict[str, Any]) -> None:
    assert outcome(session, "test_caplog_pass")["outcome"] == "passed", outcome(session, "test_caplog_pass")
    failed = outcome(session, "test_caplog_fail")
    assert failed["outcome"] == "failed" and "1 of 2 ranks failed: rank 1 failed" in failed["text"]
    assert "['rank 1 lost its shard'] == []" in failed["text"]
    assert "[rank 1] rank 1 lost its shard" not in session["stdout"]  # caplog took it, as in pytest


def test_recwarn_records_each_ranks_warnings(session: dict[str, Any]) -> None:
    assert outcome(session, "test_recwarn_pass")["outcome"] == "passed", outcome(session, "test_recwarn_pass")
    failed = outcome(session, "test_recwarn_fail")
    assert failed["outcome"] == "failed" and "2 of 2 ranks failed: ranks 0, 1 failed" in failed["text"]
    assert "assert 1 == 0" in failed["text"]  # DeprecationWarning recorded too (simplefilter default)


def test_monkeypatch_is_the_ranks_own_and_undone(session: dict[str, Any]) -> None:
    assert outcome(session, "test_monkeypatch_1_pass")["outcome"] == "passed"
    assert outcome(session, "test_monkeypatch_2_undone")["outcome"] == "passed"
    failed = outcome(session, "test_monkeypatch_fail")
    assert failed["outcome"] == "failed" and "has no attribute 'no_such_attribute'" in failed["text"]


def test_tmp_path_factory_gives_ranks_one_shared_directory(session: dict[str, Any]) -> None:
    passed = outcome(session, "test_tmp_path_factory_pass")
    assert passed["outcome"] == "passed", passed
    made = list(session["basetemp"].glob("ddp-test_tmp_path_factory_pass[0-9]*/data*"))
    assert sorted(p.name for p in made) == ["data0", "data1"]  # inside the session's base temp
    failed = outcome(session, "test_tmp_path_factory_fail")
    assert "ValueError: ../outside is not a normalized and relative path" in failed["text"]


def test_request_offers_node_markers_and_params(session: dict[str, Any]) -> None:
    passed = outcome(session, "test_request_pass[3]")
    assert passed["outcome"] == "passed", passed
    failed = outcome(session, "test_request_fail")
    assert "request.config is not available inside a rank" in failed["text"]
    assert "builtin_fixtures.py" not in failed["text"]  # the user's line, not the plugin's frame


def test_other_unpicklable_fixture_is_one_line_naming_it(session: dict[str, Any]) -> None:
    text = outcome(session, "test_pytestconfig_unpicklable")["text"].strip()
    assert text.startswith("fixture 'pytestconfig' cannot be sent to the ranks: its Config value does not pickle")
    assert "return picklable data from the fixture" in text
    assert "ddp_conformance" not in text
    assert len(text.splitlines()) == 1


def test_builtin_fixtures_private_api() -> None:
    """The one private pytest API used for the built-ins: WarningsRecorder's `_ispytest` keyword."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a PytestDeprecationWarning about private use would raise here
        recorder = warnings_recorder()
    assert isinstance(recorder, pytest.WarningsRecorder)
    with recorder:
        warnings.simplefilter("default")
        warnings.warn("seen", UserWarning, stacklevel=1)
    assert [str(w.message) for w in recorder] == ["seen"]


def test_environ_fast_path() -> None:
    """The ranks compare `os.environ`'s own bytes dict after each test; if CPython drops it, this fails
    (the slow path still restores the environment, at 0.3 ms a test)."""
    from ddp_conformance.runner.rank.task_runner import PoolEnviron, _raw_environ

    assert _raw_environ() is not None
    saved = PoolEnviron()
    os.environ["DDP_CONFORMANCE_PROBE"] = "1"
    try:
        assert saved.changed()
    finally:
        saved.restore()
    assert "DDP_CONFORMANCE_PROBE" not in os.environ and not saved.changed()


def test_capture_reads_and_restores_file_descriptors(tmp_path: Path) -> None:
    """RankCapture on its own (no ranks): fd 1 goes to the capture and comes back afterwards."""
    log = tmp_path / "fd1.log"
    pid = os.fork()
    if pid == 0:  # a child, so this pytest's own capture of fd 1 stays untouched
        code = 1
        try:
            target = os.open(log, os.O_WRONLY | os.O_CREAT)
            os.dup2(target, 1)
            capture = RankCapture("fd")
            capture.start()
            os.write(1, b"captured\n")
            seen = capture.readouterr().out
            os.write(1, b"left\n")
            capture.close()
            os.write(1, b"after\n")
            code = 0 if seen == "captured\n" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert log.read_text() == "left\nafter\n"
