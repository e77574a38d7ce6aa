"""Runner costs, measured side by side in one run, against the runner's targets.

    python benchmarks/runner_overhead.py [--sizes 2 4 8] [--warm-tests 60]

Columns, per world size:
  bare spawn   mp.spawn + init_process_group(gloo, FileStore) + destroy: the floor of a cold start
  cold pool    a session's first pool: start the fork server (it imports torch once), fork the ranks, until every
               rank has joined the group
  rebuild      a later pool from the warm fork server (what a failed test costs the next one)
  exec pool    the same pool with each rank exec'd (DDP_CONFORMANCE_SPAWN=exec, the fallback)
  warm test    median wall time of one trivial marked test (one all_reduce) on the warm pool
  fresh test   a new group per test: spawn + init + the same test + destroy (MultiProcessTestCase style)
  all_reduce   one all_reduce of a float inside the group (the floor of any distributed test)
  first test   a fresh pool's first trivial test, whose ranks build pytest's Config as the plugin's ranks do: with
               the session's installed pytest plugins imported by the fork server (as the plugin starts it), and
               with each rank importing them itself
Then: `pytest --collect-only` of 300 plain tests with and without the plugin (the cost where unused).
Targets on a 2-core machine: warm test at ws 4 <= 5 ms; cold pool <= 1.3x bare spawn.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_conformance.runner.parent.config_recipe import installed_plugins, recipe_of
from ddp_conformance.runner.parent.fork_server import ForkServer
from ddp_conformance.runner.parent.rank_pool import RankDevices, RankPool
from ddp_conformance.runner.wire import ConfigRecipe, DdpPlan, Task

TEST_SOURCE = """
import torch
import torch.distributed as dist

def test_trivial(ddp):
    dist.all_reduce(torch.ones(1))

def test_floor(ddp):
    import time
    t = torch.ones(1)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(t)
    ddp.figures["all_reduce_s"] = (time.perf_counter() - began) / 50
"""


def _bare_worker(rank: int, world_size: int, store: str, run_test: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    if run_test:
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def bare_spawn(world_size: int, run_test: bool = False) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        mp.spawn(_bare_worker, args=(world_size, os.path.join(tmp, "store"), run_test), nprocs=world_size)
        return time.perf_counter() - began


def task(module: Path, name: str, world_size: int, recipe: ConfigRecipe | None = None) -> Task:
    return Task(nodeid=name, module_path=str(module), module_name="bench_module", qualname=name,
                funcargs=pickle.dumps({"ddp": DdpPlan(world_size, "gloo")}), sys_path=list(sys.path),
                cwd=os.getcwd(), pytest_config=recipe)


def first_test(world_size: int, module: Path, config: pytest.Config, plugins: tuple[str, ...]) -> float:
    """A fresh pool's first test, its ranks building pytest's Config from `config`'s recipe; the fork server
    imports `plugins` (and torch) before it forks them, off the clock."""
    fork_server = ForkServer(start_timeout=300, preload=plugins)
    pool = RankPool(world_size, "gloo", start_timeout=300, devices=RankDevices(rank_threads=1), fork_server=fork_server)
    try:
        pool.start()
        began = time.perf_counter()
        run = pool.run(task(module, "test_trivial", world_size, recipe_of(config)), 60)
        elapsed = time.perf_counter() - began
        assert all(r.outcome == "passed" for r in run.replies.values()), run.replies
        return elapsed
    finally:
        pool.stop()
        fork_server.close()


def measure(world_size: int, warm_tests: int, module: Path, config: pytest.Config) -> dict[str, float]:
    figures: dict[str, float] = {}
    figures["first"] = first_test(world_size, module, config, installed_plugins(config))
    figures["first_per_rank"] = first_test(world_size, module, config, ())
    figures["bare"] = statistics.median(bare_spawn(world_size) for _ in range(2))
    exec_pool = RankPool(world_size, "gloo", start_timeout=300, devices=RankDevices(rank_threads=1))
    began = time.perf_counter()
    exec_pool.start()
    figures["exec"] = time.perf_counter() - began
    exec_pool.stop()
    began = time.perf_counter()
    fork_server = ForkServer(start_timeout=300)
    pool = RankPool(world_size, "gloo", start_timeout=300, devices=RankDevices(rank_threads=1), fork_server=fork_server)
    pool.start()
    figures["cold"] = time.perf_counter() - began
    rebuilt = RankPool(world_size, "gloo", start_timeout=300, devices=RankDevices(rank_threads=1),
                       fork_server=fork_server)
    began = time.perf_counter()
    rebuilt.start()
    figures["rebuild"] = time.perf_counter() - began
    rebuilt.stop()
    try:
        trivial = task(module, "test_trivial", world_size)
        for _ in range(5):
            pool.run(trivial, 60)  # first calls import the module and warm the pipes
        times = []
        for _ in range(warm_tests):
            began = time.perf_counter()
            run = pool.run(trivial, 60)
            times.append(time.perf_counter() - began)
            assert all(r.outcome == "passed" for r in run.replies.values()), run.replies
        figures["warm"] = statistics.median(times)
        floor = pool.run(task(module, "test_floor", world_size), 60)
        figures["all_reduce"] = floor.replies[0].figures["all_reduce_s"]
    finally:
        pool.stop()
        fork_server.close()
    figures["fresh"] = statistics.median(bare_spawn(world_size, run_test=True) for _ in range(2))
    return figures


def collect_cost(tmp: Path) -> tuple[float, float]:
    (tmp / "test_plain.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(300)))

    def run(*extra: str) -> float:
        samples = []
        for _ in range(3):
            began = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            *extra, str(tmp)], check=True, capture_output=True, cwd=tmp)
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)

    return run(), run("-p", "no:ddp-conformance")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--warm-tests", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        module = tmp / "bench_module.py"
        module.write_text(TEST_SOURCE)
        config = pytest.Config.fromdictargs({}, ["-p", "no:cacheprovider", str(tmp)])  # as a session here loads it
        print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, 1 thread per rank; pytest plugins: "
              f"{', '.join(installed_plugins(config))}\n")
        header = ("ws", "bare spawn s", "cold pool s", "cold/bare", "rebuild s", "exec pool s", "warm test ms",
                  "fresh test s", "fresh/warm", "all_reduce ms", "warm/all_reduce", "first test s",
                  "first, plugins per rank s", "per rank/first")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for size in args.sizes:
            f = measure(size, args.warm_tests, module, config)
            row = (size, f"{f['bare']:.2f}", f"{f['cold']:.2f}", f"{f['cold'] / f['bare']:.2f}x",
                   f"{f['rebuild']:.2f}", f"{f['exec']:.2f}", f"{f['warm'] * 1e3:.2f}", f"{f['fresh']:.2f}",
                   f"{f['fresh'] / f['warm']:.0f}x",
                   f"{f['all_reduce'] * 1e3:.2f}", f"{f['warm'] / f['all_reduce']:.1f}x", f"{f['first']:.2f}",
                   f"{f['first_per_rank']:.2f}", f"{f['first_per_rank'] / f['first']:.2f}x")
            print("| " + " | ".join(map(str, row)) + " |", flush=True)
        with_plugin, without = collect_cost(tmp)
        print(f"\npytest --collect-only, 300 plain tests: {with_plugin:.2f} s with the plugin, "
              f"{without:.2f} s without ({with_plugin / without:.2f}x)")


if __name__ == "__main__":
    main()
