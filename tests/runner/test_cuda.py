"""The runner on real GPUs: nccl at world size 1, gloo with every rank on one shared GPU (`--ddp-device
cuda`) at world sizes 2 and 4, and the fault matrix on CUDA ranks (each fault named, within the timeout
+ 10 s, no process and no GPU memory left behind, and the next test passes).

These run wherever CUDA is present (a GPU CI runner) and skip with the reason elsewhere. The nested
sessions see every GPU of the machine: this run's pytest-xdist worker variables are removed, or a
worker that got no GPU share would hand its nested session none.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from tests.helpers import is_alive

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
    pytest.mark.usefixtures("no_orphans"),
]

HEADER = """
import os, signal, subprocess, time
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

PIDS = Path(os.environ["RANK_PIDS"])


def on_gpu(ddp):
    (PIDS / f"{os.getpid()}").touch()  # the parent checks these processes hold no GPU memory afterwards
    assert ddp.device.type == "cuda"
    assert ddp.device.index == ddp.local_rank % torch.cuda.device_count()
    assert torch.cuda.current_device() == ddp.device.index
    return torch.ones(1 << 20, device=ddp.device)  # 4 MiB held on the GPU while the test runs
"""


@pytest.fixture
def gpu_pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    pids = pytester.path / "rank-pids"
    pids.mkdir()
    monkeypatch.setenv("RANK_PIDS", str(pids))
    return pytester


def run(pytester: pytest.Pytester, body: str, *args: str) -> tuple[pytest.RunResult, dict[str, float]]:
    pytester.makepyfile(HEADER + textwrap.dedent(body))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-device", "cuda",
                                           "--junitxml", "cuda.xml", *args)
    times = {case.get("name", ""): float(case.get("time", "0"))
             for case in ET.parse(Path(pytester.path, "cuda.xml")).iter("testcase")}
    return result, times


def gpu_processes() -> set[int]:
    """The pids holding a context on any GPU, as the driver reports them (no CUDA context of our own)."""
    out = subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi", "--query-compute-apps=pid",
                          "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def assert_no_rank_holds_gpu_memory(pytester: pytest.Pytester) -> None:
    ranks = {int(p.name) for p in (pytester.path / "rank-pids").iterdir()}
    assert ranks, "no rank recorded its pid: the tests did not run on the GPU"
    deadline = time.monotonic() + 5  # the last pool's ranks are being reaped as pytest exits
    while (alive := [pid for pid in ranks if is_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"rank processes still alive: {alive}"
    if shutil.which("nvidia-smi"):
        assert not ranks & gpu_processes(), "a rank still holds a GPU context"


def test_nccl_at_world_size_1_and_gloo_on_one_shared_gpu(gpu_pytester: pytest.Pytester) -> None:
    result, _ = run(
        gpu_pytester,
        """
        def ddp_grads_are_the_mean(ddp):
            torch.manual_seed(0)
            model = torch.nn.Linear(16, 4).to(ddp.device)
            local = torch.nn.Linear(16, 4).to(ddp.device)
            local.load_state_dict(model.state_dict())
            wrapped = DistributedDataParallel(model, device_ids=[ddp.device.index])
            x = torch.full((3, 16), float(ddp.rank + 1), device=ddp.device)
            wrapped(x).square().sum().backward()
            local(x).square().sum().backward()
            mean = local.weight.grad.clone()
            dist.all_reduce(mean)
            torch.testing.assert_close(model.weight.grad, mean / ddp.world_size)

        @pytest.mark.ddp(world_size=[1, 2, 4])
        def test_ranks(ddp):  # nccl with a GPU per rank (1 on a one-GPU runner), else gloo on shared GPUs
            held = on_gpu(ddp)
            assert ddp.backend == ("nccl" if torch.cuda.device_count() >= ddp.world_size else "gloo")
            dist.all_reduce(held)
            assert held[0].item() == ddp.world_size
            ddp_grads_are_the_mean(ddp)
        """,
    )
    result.assert_outcomes(passed=3)
    assert_no_rank_holds_gpu_memory(gpu_pytester)


def test_faults_on_cuda_ranks(gpu_pytester: pytest.Pytester) -> None:
    result, times = run(
        gpu_pytester,
        """
        @pytest.mark.ddp(world_size=2)
        def test_0_pool_is_up(ddp):  # the pool's start off the timed tests' clocks
            on_gpu(ddp)

        @pytest.mark.ddp(world_size=2)
        def test_raise_on_one_rank(ddp):
            held = on_gpu(ddp)
            if ddp.rank == 0:
                raise RuntimeError("rank 0 gave up")
            dist.all_reduce(held)

        @pytest.mark.ddp(world_size=2)
        def test_exit(ddp):
            held = on_gpu(ddp)
            if ddp.rank == 1:
                os._exit(7)
            dist.all_reduce(held)

        @pytest.mark.ddp(world_size=2)
        def test_sigkill_from_outside(ddp):
            held = on_gpu(ddp)
            if ddp.rank == 1:
                subprocess.run(["kill", "-9", str(os.getpid())])
            dist.all_reduce(held)

        @pytest.mark.ddp(world_size=2)
        def test_hang_in_a_cuda_collective(ddp):
            held = on_gpu(ddp)
            if ddp.rank == 1:
                time.sleep(60)
            dist.all_reduce(held)
            torch.cuda.synchronize()

        @pytest.mark.ddp(world_size=2)
        def test_zz_next_one_passes(ddp):
            held = on_gpu(ddp)
            dist.all_reduce(held)
            assert held[0].item() == 2
        """,
        "--ddp-timeout", "8",
    )
    result.assert_outcomes(passed=2, failed=4)
    result.stdout.fnmatch_lines(["*rank 0 failed: RuntimeError: rank 0 gave up*"])
    result.stdout.fnmatch_lines(["*2 of 2 ranks failed: rank 1 died (exit code 7)*"])
    result.stdout.fnmatch_lines(["*2 of 2 ranks failed: rank 1 died (killed by SIGKILL (9))*"])
    result.stdout.fnmatch_lines(["*_ test_hang_in_a_cuda_collective _*", "*rank 0 timed out after 8 s*",
                                 "*rank 1 timed out after 8 s*"])
    for name in ("test_raise_on_one_rank", "test_exit", "test_sigkill_from_outside", "test_hang_in_a_cuda_collective"):
        assert times[name] <= 8 + 10, (name, times[name])
    assert_no_rank_holds_gpu_memory(gpu_pytester)
