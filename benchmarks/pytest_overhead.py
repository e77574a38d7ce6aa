"""What a warm distributed test costs inside pytest, next to a plain test, the pool and the all_reduce.

    python benchmarks/pytest_overhead.py [--world-size 4] [--n1 100] [--n2 400] [--repeats 3]

Per repeat, four pytest sessions in subprocesses (with --junitxml), interleaved so that load hits both
kinds: N1 and N2 trivial distributed tests (`@pytest.mark.ddp(world_size=W)`, one all_reduce of one
float and an assert on it) and N1 and N2 plain tests (one torch op and an assert). Both modules import
torch, as a distributed test module does, and start with one test left out of every figure: there,
the distributed module waits for its pool and lets the fork server's idle-time imports finish (they would
otherwise take a core from the first few hundred milliseconds of tests). Columns:

  junit ms       median JUnit time (setup + call + teardown) of the measured tests of the N2 session,
                 what pytest reports per test; read from the reports' durations (what junitxml adds
                 up) by a conftest, because the XML rounds each to 1 ms
  growth ms      what one more test adds to a session's wall: the N2 session's clock from the end of
                 its first test to the end of its last, per test (hooks, terminal and JUnit reporting
                 included). Within one session: the difference of two sessions' clocks can go
                 negative under a burst of the VM's steal time
  collect ms     what one more test adds to collection: (collect(N2) - collect(N1)) / (N2 - N1)
  pool ms        the same test sent straight to a warm RankPool (no pytest)
  empty ms       a test with an empty body sent to the same pool: the runner's own cost per test,
                 without the collective
  all_reduce ms  one all_reduce of a float inside the group, averaged over 200: the floor of any
                 distributed test
  rank cpu ms    CPU time all ranks together spend per pool-level test (/proc): with W ranks on 2
                 cores, half of it (plus the parent's share) bounds the wall time from below
  bare ms        the cheapest round trip of a runner with one process per rank, averaged over 2000:
                 W processes forked from the benchmark, in one gloo group, each woken by one byte on a
                 socketpair, one all_reduce, one byte back; no pickling, pytest, output or health check
  floor ms       plain growth + bare: what a distributed test would add to a session if the runner cost
                 nothing at all (pytest's own per-test work, then the wake-up of every rank and the
                 test's collective). No runner with one process per rank gets under it
  ddp cpu ms     CPU of the N2 session's whole process tree (pytest, fork server, ranks; /proc) per test,
  plain cpu ms   over the same span as growth
  all_reduce cpu one all_reduce's CPU summed over the ranks (every thread of each rank)
  cpu floor ms   plain cpu + all_reduce cpu: the CPU any runner must spend on a trivial test
  ddp cpu/cores  ddp cpu / the machine's cores: no schedule runs a test in less wall time than this
Ratios: ddp junit / plain junit, ddp junit / all_reduce, ddp junit / pool, ddp growth / floor. The
last row is the median of the repeats. Target: ddp junit and ddp growth <= 3 ms at world size 4 on 2 cores,
which needs ddp cpu <= 6 ms there; of those 3 ms, the floor column takes what no runner can avoid.
Figures move with load: other processes on a 2-core machine take the ranks' CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

DDP_TEST = '''
@pytest.mark.ddp(world_size={ws})
def test_ddp_{i}(ddp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == {ws}
'''
PLAIN_TEST = '''
def test_plain_{i}():
    t = torch.ones(1)
    assert t.item() == 1
'''
HEADER = "import pytest\nimport torch\nimport torch.distributed as dist\n"
SETTLE_SECONDS = 8
SETTLE = {
    "ddp": '''
@pytest.mark.ddp(world_size={ws})
def test_a_settle(ddp):
    import time
    time.sleep({settle})  # the pool is up; the fork server imports torch._dynamo & co. while idle
''',
    "plain": '''
def test_a_settle():
    pass
''',
}
# what junitxml sums into a test's time, kept at full precision; and the session's clock: collection,
# and the run from the end of the first test (left out) to the end of the last
CONFTEST = '''
import json
import os
import time

import torch  # imported before the session's clock starts, as by any distributed test module

from ddp_conformance.runner.ranks import cpu_seconds

DURATIONS = {}
CLOCK = {}
CPU = {}


def tree_cpu():
    """CPU seconds of this pytest process and all its descendants (fork server, ranks) so far."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    children.setdefault(int(stat.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += cpu_seconds(pid) or 0.0
        todo.extend(children.get(pid, []))
    return total


def pytest_sessionstart(session):
    CLOCK["start"] = time.perf_counter()


def pytest_collection_finish(session):
    CLOCK["collected"] = time.perf_counter()


def pytest_runtest_logreport(report):
    DURATIONS[report.nodeid] = DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_runtest_logfinish(nodeid):
    if "first_done" not in CLOCK:
        CPU["first_done"] = tree_cpu()
    CLOCK.setdefault("first_done", time.perf_counter())
    CLOCK["last_done"] = time.perf_counter()


def pytest_sessionfinish(session):
    cpu = tree_cpu() - CPU["first_done"]  # the ranks still live: pools stop at pytest_unconfigure
    with open(os.environ["BENCH_DURATIONS"], "w") as handle:
        json.dump({"durations": list(DURATIONS.values()), "collect": CLOCK["collected"] - CLOCK["start"],
                   "run": CLOCK["last_done"] - CLOCK["first_done"], "tests": len(DURATIONS),
                   "cpu": cpu}, handle)
'''
POOL_SOURCE = '''
import time
import torch
import torch.distributed as dist

def test_trivial(ddp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ddp.world_size

def test_empty(ddp):
    pass

def test_floor(ddp):
    t = torch.ones(1)
    dist.barrier()
    began, cpu = time.perf_counter(), time.process_time()  # process_time: every thread of the rank
    for _ in range(200):
        dist.all_reduce(t)
    ddp.figures["all_reduce_s"] = (time.perf_counter() - began) / 200
    ddp.figures["all_reduce_cpu_s"] = (time.process_time() - cpu) / 200
'''


def write_module(directory: Path, kind: str, template: str, count: int, world_size: int) -> Path:
    path = directory / f"test_{kind}_{count}.py"
    body = "".join(template.format(i=i, ws=world_size) for i in range(count))
    path.write_text(HEADER + SETTLE[kind].format(ws=world_size, settle=SETTLE_SECONDS) + body)
    return path


def run_session(module: Path, junit: Path) -> dict[str, float]:
    """The session's collection and run seconds; fails loudly unless every test passed."""
    env = dict(os.environ, BENCH_DURATIONS=str(junit.with_suffix(".json")))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           module.name], cwd=module.parent, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark session failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    clock = json.loads(junit.with_suffix(".json").read_text())
    return {"collect": clock["collect"], "run": clock["run"], "tests": clock["tests"], "cpu": clock["cpu"]}


def junit_median(junit: Path) -> float:
    """Median JUnit time of the measured tests, checked against the XML (which rounds each to 1 ms)."""
    times = json.loads(junit.with_suffix(".json").read_text())["durations"]
    rounded = [float(case.get("time", "0")) for case in ET.parse(junit).iter("testcase")]
    assert len(rounded) == len(times) and abs(sum(rounded) - sum(times)) < 1e-3 * len(times) + 0.01
    return statistics.median(times[1:])


def pool_figures(directory: Path, world_size: int, warm_tests: int) -> dict[str, float]:
    """Seconds on a warm pool: the trivial test's median ("pool"), an empty test's ("empty"), one
    all_reduce's, and the CPU all ranks spend per trivial test ("rank_cpu": on 2 cores, half of it is
    a floor under any per-test wall time)."""
    from ddp_conformance.runner.parent.fork_server import ForkServer
    from ddp_conformance.runner.parent.rank_pool import RankDevices, RankPool
    from ddp_conformance.runner.ranks import cpu_seconds
    from ddp_conformance.runner.wire import DdpPlan, Task

    module = directory / "pool_module.py"
    module.write_text(POOL_SOURCE)

    def task(name: str) -> Task:
        return Task(nodeid=name, module_path=str(module), module_name="pool_module", qualname=name,
                    funcargs=pickle.dumps({"ddp": DdpPlan(world_size, "gloo")}), sys_path=list(sys.path),
                    cwd=os.getcwd())

    fork_server = ForkServer(start_timeout=300)
    pool = RankPool(world_size, "gloo", start_timeout=300, devices=RankDevices(rank_threads=1), fork_server=fork_server)
    figures: dict[str, float] = {}
    try:
        pool.start()
        time.sleep(SETTLE_SECONDS)  # as in the pytest sessions: the fork server's idle-time imports finish first
        pids = [proc.popen.pid for proc in pool.ranks]
        for name, key in (("test_trivial", "pool"), ("test_empty", "empty")):
            test = task(name)
            for _ in range(10):
                pool.run(test, 60)
            times = []
            cpu_before = sum(cpu_seconds(pid) or 0.0 for pid in pids)
            for _ in range(warm_tests):
                began = time.perf_counter()
                run = pool.run(test, 60)
                times.append(time.perf_counter() - began)
                assert all(reply.outcome == "passed" for reply in run.replies.values()), run.replies
            figures[key] = statistics.median(times)
            if key == "pool":
                figures["rank_cpu"] = (sum(cpu_seconds(pid) or 0.0 for pid in pids) - cpu_before) / warm_tests
        floor = pool.run(task("test_floor"), 60).replies
        figures["all_reduce"] = floor[0].figures["all_reduce_s"]
        figures["all_reduce_cpu"] = sum(reply.figures["all_reduce_cpu_s"] for reply in floor.values())
    finally:
        pool.stop()
        fork_server.close()
    return figures


def bare_round_trip(directory: Path, world_size: int, iterations: int) -> float:
    """Mean seconds of the cheapest round trip a runner with one process per rank can make: W
    processes forked from this one (torch imported), in one gloo group, each woken by one byte on a
    socketpair, doing one all_reduce and answering one byte. No pickling, pytest, output or health
    check: what is left of any distributed test once the runner costs nothing."""
    import socket

    import torch
    import torch.distributed as dist

    from ddp_conformance.runner.parent.rank_pool import loopback_interface

    interface = os.environ.get("GLOO_SOCKET_IFNAME") or loopback_interface() or "lo"  # as the pools choose it
    store = str(directory / f"bare-store-{time.monotonic_ns()}")  # a FileStore file serves one group
    channels: list[socket.socket] = []
    pids: list[int] = []
    times: list[float] = []
    try:
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:  # the rank: serve until the channel closes, never return
                code = 1
                try:
                    ours.close()
                    os.environ["GLOO_SOCKET_IFNAME"] = interface
                    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank,
                                            world_size=world_size)
                    tensor = torch.ones(1)
                    theirs.sendall(b"r")
                    while theirs.recv(1) == b"g":
                        dist.all_reduce(tensor)
                        theirs.sendall(b"d")
                    code = 0
                finally:
                    os._exit(code)
            theirs.close()
            channels.append(ours)
            pids.append(pid)
        for channel in channels:
            channel.settimeout(300)
            assert channel.recv(1) == b"r", "a bare rank did not join its group"
        for _ in range(iterations):
            began = time.perf_counter()
            for channel in channels:
                channel.sendall(b"g")
            for channel in channels:
                channel.recv(1)
            times.append(time.perf_counter() - began)
    finally:
        for channel in channels:
            channel.close()  # the ranks read EOF and exit
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                if not _exited_within(pid, 30):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store)
    return statistics.mean(times[iterations // 10:])  # the first tenth warms the group up


def _exited_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
        time.sleep(0.01)
    return False


def one_repeat(directory: Path, args: argparse.Namespace) -> dict[str, float]:
    (directory / "conftest.py").write_text(CONFTEST)
    clocks: dict[tuple[str, int], dict[str, float]] = {}
    figures: dict[str, float] = {}
    for n in (args.n1, args.n2):
        for kind, template in (("ddp", DDP_TEST), ("plain", PLAIN_TEST)):
            module = write_module(directory, kind, template, n, args.world_size)
            junit = directory / f"{kind}_{n}.xml"
            clocks[(kind, n)] = run_session(module, junit)
            if n == args.n2:
                figures[f"{kind}_junit"] = junit_median(junit)
    for kind in ("ddp", "plain"):
        session = clocks[(kind, args.n2)]
        figures[f"{kind}_growth"] = session["run"] / (session["tests"] - 1)  # the tests after the left-out one
        figures[f"{kind}_cpu"] = session["cpu"] / (session["tests"] - 1)
        grown = session["collect"] - clocks[(kind, args.n1)]["collect"]
        figures[f"{kind}_collect"] = grown / (args.n2 - args.n1)
    figures.update(pool_figures(directory, args.world_size, args.warm_tests))
    figures["bare"] = bare_round_trip(directory, args.world_size, args.bare_trips)
    return figures


COLUMNS = ("run", "ddp junit ms", "plain junit ms", "ddp growth ms", "plain growth ms", "ddp collect ms",
           "plain collect ms", "pool ms", "empty ms", "all_reduce ms", "bare ms", "rank cpu ms", "floor ms",
           "ddp cpu ms", "plain cpu ms", "all_reduce cpu ms", "cpu floor ms", "ddp/plain", "ddp/all_reduce", "ddp/pool",
           "growth/floor", "ddp cpu/cores")


def row(label: str, f: dict[str, float]) -> str:
    ms = ("ddp_junit", "plain_junit", "ddp_growth", "plain_growth", "ddp_collect", "plain_collect", "pool",
          "empty", "all_reduce", "bare", "rank_cpu")
    floor = f["plain_growth"] + f["bare"]
    cpu_floor = f["plain_cpu"] + f["all_reduce_cpu"]
    cores = os.cpu_count() or 1
    cells = (label, *(f"{f[key] * 1e3:.2f}" for key in ms), f"{floor * 1e3:.2f}",
             *(f"{f[key] * 1e3:.2f}" for key in ("ddp_cpu", "plain_cpu", "all_reduce_cpu")), f"{cpu_floor * 1e3:.2f}",
             f"{f['ddp_junit'] / f['plain_junit']:.1f}x", f"{f['ddp_junit'] / f['all_reduce']:.1f}x",
             f"{f['ddp_junit'] / f['pool']:.2f}x", f"{f['ddp_growth'] / floor:.2f}x",
             f"{f['ddp_cpu'] / cores * 1e3:.2f}")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--n1", type=int, default=100)
    parser.add_argument("--n2", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-tests", type=int, default=200)
    parser.add_argument("--bare-trips", type=int, default=2000)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, world size {args.world_size}, "
          f"N1={args.n1} N2={args.n2}, load average {os.getloadavg()[0]:.2f} at start\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    results = []
    with tempfile.TemporaryDirectory(prefix="ddp-pytest-overhead-") as tmp:
        for repeat in range(args.repeats):
            results.append(one_repeat(Path(tmp), args))
            print(row(str(repeat + 1), results[-1]), flush=True)
    median = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print(row("median", median))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
