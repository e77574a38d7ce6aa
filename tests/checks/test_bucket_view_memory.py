"""bucket_view_memory's verdicts and the saving it requires."""

from __future__ import annotations


def test_bucket_view_verdicts_and_the_saving_threshold():
    from types import SimpleNamespace

    from ddp_conformance.checks.bucket_view_memory import layout_problem, saving_problem, within_noise

    good = SimpleNamespace(is_ddp=True, wrapped_type="DistributedDataParallel", ddp_flag=True, all_views=True,
                           grad_storages=2, buckets=2, grads=6)
    assert layout_problem(good) is None
    assert "not wrapped" in layout_problem(SimpleNamespace(**{**vars(good), "is_ddp": False}))
    assert "never reaches DDP" in layout_problem(SimpleNamespace(**{**vars(good), "ddp_flag": False}))
    assert "a clone?" in layout_problem(SimpleNamespace(**{**vars(good), "all_views": False}))
    assert "a clone?" in layout_problem(SimpleNamespace(**{**vars(good), "grad_storages": 6}))
    grad_bytes = 1 << 20
    assert saving_problem(1.0 * grad_bytes, grad_bytes) is None
    assert saving_problem(0.91 * grad_bytes, grad_bytes) is None
    assert "saves less than 90%" in saving_problem(0.5 * grad_bytes, grad_bytes)
    assert "saves less than 90%" in saving_problem(0, grad_bytes)
    assert not within_noise(grad_bytes, 4096)  # CPU heap counters: KiB of noise on MiB of gradients
    assert within_noise(grad_bytes, 0.2 * grad_bytes)  # nccl at world size 1, seen: 9x the gradients
