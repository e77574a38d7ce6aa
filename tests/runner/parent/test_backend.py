"""Backend and GPU decisions, made in the parent from a few facts: testable on a CPU machine."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ddp_conformance.runner.parent.backend import Hardware, Placement, choose_backend, worker_gpu_share, xdist_worker
from ddp_conformance.runner.rank.ddp_context import rank_device

GPUS4 = Hardware(cuda_devices=("0", "1", "2", "3"), nccl_available=True)
NO_GPU = Hardware(cuda_devices=(), nccl_available=None)


def test_auto_picks_nccl_only_with_a_gpu_per_rank() -> None:
    assert choose_backend("auto", 4, GPUS4).backend == "nccl"
    assert choose_backend("auto", 8, GPUS4).backend == "gloo"
    assert choose_backend("auto", 2, NO_GPU).backend == "gloo"
    assert choose_backend("auto", 2, Hardware(("0", "1"), nccl_available=False)).backend == "gloo"


def test_explicit_nccl_skips_with_what_is_missing() -> None:
    assert choose_backend("nccl", 4, NO_GPU).skip_reason == "nccl needs 4 GPUs, found 0"
    assert choose_backend("nccl", 8, GPUS4).skip_reason == "nccl needs 8 GPUs, found 4"
    no_nccl = Hardware(("0", "1"), nccl_available=False)
    assert choose_backend("nccl", 2, no_nccl).skip_reason == "nccl is not available in this torch build"
    assert choose_backend("nccl", 4, GPUS4).skip_reason is None
    assert choose_backend("gloo", 4, GPUS4).backend == "gloo"


def test_devices() -> None:
    assert rank_device("nccl", 3) == "cuda:3"
    assert rank_device("gloo", 3) == "cpu"
    assert rank_device("nccl", 3, "cuda", 4) == "cuda:3"
    assert [rank_device("gloo", r, "cuda", 1) for r in range(4)] == ["cuda:0"] * 4  # one GPU, shared
    assert [rank_device("gloo", r, "cuda", 2) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert rank_device("gloo", 3, "cpu", 4) == "cpu"


ONE_GPU = Hardware(cuda_devices=("0",), nccl_available=True)


def test_device_cuda_runs_gloo_on_shared_gpus_when_nccl_cannot() -> None:
    assert choose_backend("auto", 1, ONE_GPU, "cuda") == Placement("nccl", device="cuda")
    assert choose_backend("auto", 4, ONE_GPU, "cuda") == Placement("gloo", device="cuda")
    assert choose_backend("gloo", 1, ONE_GPU, "cuda") == Placement("gloo", device="cuda")
    assert choose_backend("nccl", 2, ONE_GPU, "cuda").skip_reason == "nccl needs 2 GPUs, found 1"
    assert choose_backend("auto", 2, NO_GPU, "cuda").skip_reason == (
        "--ddp-device cuda: no CUDA device is visible here (found 0)")


def test_device_auto_and_cpu() -> None:
    assert choose_backend("auto", 1, ONE_GPU) == Placement("nccl", device="cuda")  # auto: GPUs under nccl
    assert choose_backend("auto", 2, ONE_GPU) == Placement("gloo", device="cpu")  # and the CPU under gloo
    assert choose_backend("auto", 1, ONE_GPU, "cpu") == Placement("gloo", device="cpu")


@given(st.integers(0, 16), st.integers(1, 8))
def test_xdist_workers_get_disjoint_gpus_covering_all(gpus: int, workers: int) -> None:
    devices = tuple(str(i) for i in range(gpus))
    shares = [worker_gpu_share(devices, w, workers) for w in range(workers)]
    flat = [d for share in shares for d in share]
    assert sorted(flat, key=int) == list(devices)  # disjoint and complete
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced


def test_xdist_worker_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert xdist_worker() == (3, 4)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert xdist_worker() == (0, 1)
