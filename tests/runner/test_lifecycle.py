"""Process lifetime and cost: skips decided before any spawn, no rank outliving pytest (even on
SIGKILL), and a plugin that imports nothing heavy where no distributed test runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import live_ranks

pytestmark = pytest.mark.usefixtures("no_orphans")


@pytest.fixture
def session_tmpdir() -> Iterator[Path]:
    """A TMPDIR of its own for a pytest session the test runs: what the session leaves in it is
    what its pools and fork server left. Short, under /tmp: a pool's socket path must stay under the
    AF_UNIX limit, past which the pool falls back to /tmp itself."""
    path = Path(tempfile.mkdtemp(prefix="ddpt-", dir="/tmp" if os.path.isdir("/tmp") else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def leftovers(tmpdir: Path) -> list[str]:
    return sorted(entry.name.rsplit("-", 1)[0] for entry in tmpdir.iterdir())

NEVER_SPAWN = """
import ddp_conformance.runner.parent.rank_pool as rank_pool
import ddp_conformance.runner.parent.fork_server as fork_server

def _refuse(self, *args, **kwargs):
    raise AssertionError("a process was spawned although the test had to be skipped in the parent")

rank_pool.RankPool.launch = _refuse
fork_server.ForkServer.__init__ = _refuse
"""


@pytest.mark.parametrize(("args", "reason"), [
    (("--ddp-backend", "nccl"), "nccl needs 4 GPUs, found 0"),
    (("--ddp-device", "cuda"), "--ddp-device cuda: no CUDA device is visible here (found 0)"),
])
def test_gpus_asked_for_and_missing_skip_in_the_parent(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], reason: str
) -> None:
    pytester.makeconftest(NEVER_SPAWN)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ddp(world_size=4)
        def test_needs_gpus(ddp):
            raise AssertionError("must not run")
        """
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, on a GPU runner too
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*SKIPPED*{reason}*"])


def test_sigkill_of_pytest_takes_the_ranks_with_it(pytester: pytest.Pytester, session_tmpdir: Path) -> None:
    """SIGKILL leaves no process; it does leave the directories pytest never got to remove, and
    nothing else: the pool's (its socket, store and rank logs) and the fork server's."""
    marker = pytester.path / "ranks-running"
    pytester.makepyfile(
        f"""
        import time
        import pytest
        import torch.distributed as dist

        @pytest.mark.ddp(world_size=2)
        def test_long(ddp):
            dist.barrier()
            if ddp.rank == 0:
                open({str(marker)!r}, "w").close()
            time.sleep(120)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ddp-backend", "gloo", str(pytester.path)],
        cwd=pytester.path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, TMPDIR=str(session_tmpdir)),
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, "the ranks never started"
            assert proc.poll() is None, "pytest ended before the test ran"
            time.sleep(0.1)
        assert len(live_ranks(parent=proc.pid)) >= 2  # the ranks (and the fork server that forked them)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while live_ranks(parent=proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_ranks(parent=proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
    assert leftovers(session_tmpdir) == ["ddp-conformance-fork-server", "ddp-conformance-ws2"]


def _signals_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_sigterm_or_sigint_mid_test_ends_cleanly(pytester: pytest.Pytester, signum: int,
                                                 session_tmpdir: Path) -> None:
    marker = pytester.path / "ranks-running"
    pytester.makepyfile(
        f"""
        import time
        import pytest

        @pytest.mark.ddp(world_size=2)
        def test_long(ddp):
            if ddp.rank == 0:
                open({str(marker)!r}, "w").close()
            time.sleep(120)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ddp-backend", "gloo", str(pytester.path)],
        cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, TMPDIR=str(session_tmpdir)),
        # as a terminal's pytest has it: a run started in the background of a script (CI's `.ci/run &`) inherits
        # SIGINT ignored, and a Python that starts with it ignored never raises KeyboardInterrupt
        preexec_fn=_signals_as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the test never started"
            time.sleep(0.1)
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert live_ranks(parent=proc.pid) == []
    assert "KeyboardInterrupt" in out
    assert out.count("Traceback") == 0, out
    assert leftovers(session_tmpdir) == []  # the pool's and the fork server's directories went with them


@pytest.mark.slow
def test_the_start_timeout_counts_from_the_last_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forks that wait (on a fork server still importing torch) do not eat into the ranks' time to meet."""
    from ddp_conformance.runner.parent.fork_server import ForkServer
    from ddp_conformance.runner.parent.rank_pool import RankDevices, RankPool

    fork_server = ForkServer(start_timeout=300)
    fork = fork_server.fork

    def slow_fork(*args: object, **kwargs: object) -> object:
        time.sleep(2.5)
        return fork(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fork_server, "fork", slow_fork)
    pool = RankPool(2, "gloo", start_timeout=4, devices=RankDevices(rank_threads=1), fork_server=fork_server)
    try:
        pool.start()  # 5 s of forks, then a rendezvous well within 4 s
        assert pool.ready
    finally:
        pool.stop()
        fork_server.close()


def test_a_call_runs_in_a_process_the_fork_server_forks_and_leaves_nothing(tmp_path: Path) -> None:
    """`ForkServer.call`: the str its target returns, computed in a child of rank 0's fork server (which the child
    names in DDP_CONFORMANCE_PARENT); a target that raises is an OSError with its last words; no file of
    either is left in the server's directory."""
    from ddp_conformance.runner.parent.fork_server import ForkServer

    fork_server = ForkServer(start_timeout=300)
    try:
        assert fork_server.call("posixpath:basename", "/a/trainer.py") == "trainer.py"
        assert fork_server.call("os:getenv", "DDP_CONFORMANCE_PARENT") == str(fork_server.pids[0])
        with pytest.raises(OSError, match=r"^json:loads ended with exit code 1 and no result: .*JSONDecodeError"):
            fork_server.call("json:loads", "{")
        logs = [os.listdir(server.log_dir) for server in fork_server.servers]
        assert logs == [["fork_server.log"]] * len(fork_server.servers)
    finally:
        fork_server.close()


def test_plugin_imports_no_torch_without_distributed_tests(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import sys

        def pytest_sessionfinish(session):
            heavy = sorted(m for m in ("torch", "lightning") if m in sys.modules)
            print("HEAVY MODULES:", heavy or "none")
        """
    )
    pytester.makepyfile("def test_plain():\n    assert True\n")
    for args in (["--collect-only"], []):
        result = pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", *args)
        assert result.ret == 0
        result.stdout.fnmatch_lines(["*HEAVY MODULES: none*"])
    listed = pytester.runpytest_subprocess("--trace-config", "--collect-only", "-q")
    listed.stdout.fnmatch_lines(["*ddp_conformance*"])  # the plugin was loaded, not absent


FORK_SERVER_TASKS = """
import torch

def test_nothing(ddp):
    pass

def test_optimizer(ddp):
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)  # imports torch._dynamo
"""


def test_the_fork_server_preloads_dynamo_once_ranks_need_it_and_never_holds_up_a_stop(tmp_path) -> None:
    """torch._dynamo costs ~2.4 s of CPU: the fork server imports it only after a rank has, and the pool
    learns that its ranks ended from their pidfds, not from the fork server busy importing."""
    import pickle

    from ddp_conformance.runner.parent.fork_server import ForkServer
    from ddp_conformance.runner.parent.rank_pool import RankDevices, RankPool
    from ddp_conformance.runner.ranks import cpu_seconds
    from ddp_conformance.runner.wire import WARMUP, DdpPlan, Task

    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("needs Linux /proc to read the fork server's CPU time")
    (tmp_path / "fork_server_tasks.py").write_text(FORK_SERVER_TASKS)

    def run(pool: RankPool, name: str) -> list[bool]:
        task = Task(nodeid=name, module_path=str(tmp_path / "fork_server_tasks.py"), module_name="fork_server_tasks",
                    qualname=name, funcargs=pickle.dumps({"ddp": DdpPlan(pool.world_size, "gloo")}),
                    sys_path=list(sys.path), cwd=str(tmp_path))
        replies = pool.run(task, 120).replies
        assert [reply.outcome for reply in replies.values()] == ["passed"] * pool.world_size, replies
        return [reply.warm for reply in replies.values()]

    fork_server = ForkServer(start_timeout=300)
    pools: list[RankPool] = []

    def fork_server_cpu() -> float:
        return sum(cpu_seconds(pid) or 0.0 for pid in fork_server.pids)

    def start(world_size: int) -> RankPool:
        pools.append(RankPool(world_size, "gloo", start_timeout=300, devices=RankDevices(rank_threads=1),
                              fork_server=fork_server))
        pools[-1].start()
        return pools[-1]

    try:
        first = start(2)
        assert run(first, "test_nothing") == [False, False]
        cpu = fork_server_cpu()
        time.sleep(2)  # idle: an eager fork_server would import WARMUP now
        assert fork_server_cpu() - cpu < 0.3, "the idle fork_server imported what no rank asked for"
        assert run(first, "test_optimizer") == [True, True] and fork_server.warming
        cpu, deadline = fork_server_cpu(), time.monotonic() + 60
        while fork_server_cpu() - cpu < 0.2:  # the fork server is importing WARMUP now
            assert fork_server.alive and time.monotonic() < deadline, "the fork server never began to import WARMUP"
            time.sleep(0.05)
        began = time.monotonic()
        first.stop()
        assert time.monotonic() - began < 1.0, "the stop waited for the busy fork server to reap its ranks"
        deadline = time.monotonic() + 120
        while not run(start(1), "test_nothing")[0]:  # a pool forked once the import is done has it
            assert time.monotonic() < deadline, f"the fork server never preloaded {WARMUP}"
            pools.pop().stop()
            time.sleep(0.2)
    finally:
        for pool in pools:
            pool.stop()
        fork_server.close()


def installed_plugin(pytester: pytest.Pytester, name: str) -> None:
    """A pytest plugin as pip installs one (a distribution with a pytest11 entry point), on the session's path:
    its module records which process imported it."""
    module = f"{name}_plugin"
    pytester.makepyfile(**{module: "import os\nIMPORTED_BY = os.getpid()\n\ndef pytest_report_header():\n"
                                    f"    return '{name} loaded'\n"})
    info = pytester.path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[pytest11]\n{name} = {module}\n")


def test_a_module_the_marker_preloads_is_in_the_ranks_before_their_first_test(pytester: pytest.Pytester) -> None:
    """`preload` reaches the fork server, which imports it before it forks the session's first ranks (the
    conformance suite preloads torch._dynamo: ~2.4 s of CPU, else paid by every rank). So do the installed
    pytest plugins the session loaded, which every rank's Config loads again, and not one it blocked."""
    installed_plugin(pytester, "probe")
    installed_plugin(pytester, "blocked")
    pytester.makepyfile(
        """
        import os
        import sys
        import pytest

        def test_nothing_imports_it_by_itself():  # in pytest, which imports what the ranks' fork_server does but torch
            assert "colorsys" not in sys.modules

        @pytest.mark.ddp(world_size=2, preload="colorsys")
        def test_the_ranks_start_with_it(ddp):
            assert "colorsys" in sys.modules
            assert sys.modules["probe_plugin"].IMPORTED_BY == os.getppid() != os.getpid()  # by the fork server
            assert "blocked_plugin" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:blocked")
    result.stdout.fnmatch_lines(["probe loaded"])
    result.assert_outcomes(passed=2)


# a plugin whose terminal summary is slow in an xdist worker (hypothesis' took ~5 s here): xdist
# sends a worker SIGINT 5 s after it starts taking the workers down, which it does once each has
# said it finished; pools still open then were interrupted mid-stop and left their directories
SLOW_WORKER_SUMMARY = """
import os
import time

def pytest_terminal_summary():
    if os.environ.get("PYTEST_XDIST_WORKER"):
        time.sleep(7)
"""


@pytest.mark.slow  # a 7 s terminal summary in each of two xdist workers, on purpose
def test_xdist_workers_leave_nothing_behind(pytester: pytest.Pytester, session_tmpdir: Path) -> None:
    pytest.importorskip("xdist", reason="this test runs pytest-xdist's workers")
    pytester.makeconftest(SLOW_WORKER_SUMMARY)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ddp(world_size=2)
        def test_a(ddp):
            assert ddp.world_size == 2

        @pytest.mark.ddp(world_size=2)
        def test_b(ddp):
            assert ddp.world_size == 2
        """
    )
    env = dict(os.environ, TMPDIR=str(session_tmpdir))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ddp-backend", "gloo", "-n", "2",
         f"--basetemp={pytester.path / 'basetemp'}", str(pytester.path)],
        cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout
    assert "2 passed" in proc.stdout
    assert leftovers(session_tmpdir) == []  # no ddp-conformance-ws2-*, no ddp-conformance-fork-server-*
    # and no rank outlived its worker: the module's no_orphans fixture
