"""Soak: many warm tests in one pool must keep every rank's memory flat.

    python benchmarks/soak.py [--tests 500] [--world-size 4]

Each test allocates and frees tensors, all_reduces, and fails every tenth time (a failing test's frame
holds its tensors until the reply is sent). Prints each rank's RSS every 100 tests and the growth
from test 50 (after warm-up) to the end.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

from ddp_conformance.runner.parent.rank_pool import RankDevices, RankPool
from ddp_conformance.runner.wire import DdpPlan, Task

TEST_SOURCE = """
import torch
import torch.distributed as dist

def test_work(ddp, n):
    x = torch.randn(256, 1024)
    dist.all_reduce(x)
    y = (x @ x.T).sum()
    assert n % 10 != 9 or y < float("-inf"), "a failing test, every tenth"
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=500)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        module = Path(tmp, "soak_module.py")
        module.write_text(TEST_SOURCE)
        pool = RankPool(args.world_size, "gloo", start_timeout=300, devices=RankDevices(rank_threads=1))
        pool.start()
        samples: dict[int, list[float]] = {}
        failed = 0
        began = time.perf_counter()
        try:
            for n in range(1, args.tests + 1):
                task = Task(nodeid=f"soak[{n}]", module_path=str(module), module_name="soak_module",
                            qualname="test_work", funcargs=pickle.dumps({"ddp": DdpPlan(args.world_size, "gloo"),
                                                                          "n": n}),
                            sys_path=list(sys.path), cwd=os.getcwd())
                run = pool.run(task, 60)
                assert not run.poisoned, f"test {n} poisoned the pool: {run.ends}"
                failed += any(r.outcome == "failed" for r in run.replies.values())
                if n == 50 or n % 100 == 0:
                    samples[n] = [rss_mb(proc.popen.pid) for proc in pool.ranks]
        finally:
            pool.stop()
        elapsed = time.perf_counter() - began
    print(f"{args.tests} warm tests at world size {args.world_size} in {elapsed:.1f} s "
          f"({elapsed / args.tests * 1e3:.1f} ms each), {failed} of them failing on purpose\n")
    print("| after test | " + " | ".join(f"rank {r} RSS MB" for r in range(args.world_size)) + " |")
    print("|---" * (args.world_size + 1) + "|")
    for n, values in samples.items():
        print(f"| {n} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    growth = [end - start for start, end in zip(samples[50], samples[max(samples)], strict=True)]
    per_rank = ", ".join(f"rank {r} {g:+.1f} MB" for r, g in enumerate(growth))
    print(f"\ngrowth from test 50 to {max(samples)}: {per_rank}")


if __name__ == "__main__":
    main()
