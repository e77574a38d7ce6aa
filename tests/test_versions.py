"""What the plugin uses only on some releases, and the private APIs it reads, held to the releases installed.

pyproject admits torch 2.4 to 2.15 and Lightning 2.5 to 2.6 (.ci/run tests both ends). Where the code
asks whether a feature is there (`getattr`, a signature) it takes another road when it is not; these
tests pin each such question to the release that brought the feature, so a release that drops,
renames or backports one fails here by name instead of quietly sending the code down the other road.
The private APIs are asserted by use (a call that must answer as the code expects it to).

The private APIs, and the test that fails when one changes:
- torch: `ProcessGroup._get_sequence_number_for_group`, `distributed_c10d._get_default_store`,
  `DistributedDataParallel._get_ddp_logging_data`, `Tensor._base`/`_is_view`, `_C._current_graph_task_id`
  (observe.py's `recomputing`): here, and
  tests/checks/support/test_memory.py (`_base`/`_is_view` meaning), tests/trainers/test_references.py (the
  logging data's keys);
- pytest: `_pytest.assertion.pytest_runtest_protocol` (tests/runner/rank/test_assertion_explanations.py),
  WarningsRecorder's `_ispytest` (tests/runner/rank/test_builtin_fixtures.py), `TerminalReporter._tw`
  (tests/runner/test_launchers.py: one report under torchrun), `_pytest._code`, `_pytest._io`,
  `rewrite_asserts` and `Item._fixtureinfo` (imported or read unguarded: every ddp test);
- CPython: `os.environ._data` (tests/runner/rank/test_builtin_fixtures.py::test_environ_fast_path).
Lightning: none.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

import pytest
import torch
from packaging.version import Version
from torch.nn.parallel import DistributedDataParallel


def release(distribution: str) -> Version:
    """The installed release, without a local label (torch's `+cpu`, `+cu121`)."""
    return Version(Version(version(distribution)).base_version)


def _fit_takes_weights_only() -> bool:
    from ddp_conformance.trainers.lightning_ref import FIT_TAKES_WEIGHTS_ONLY

    return FIT_TAKES_WEIGHTS_ONLY


#: (where the code asks, the distribution, the release that brought it, the question as the code asks it)
FEATURES = [
    ("runner/rank/seeds.py: torch.accelerator (seeds only the CPU generator where there is no accelerator)",
     "torch", "2.6", lambda: getattr(torch, "accelerator", None) is not None),
    ("fixtures/mutants/lightning_running_norm_no_buffer_sync.py and checks/support/observe.py: "
     "DDP's forward_sync_buffers",
     "torch", "2.13", lambda: "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters),
    ("fixtures/mutants/muon_not_checkpointed.py: torch.optim.Muon (else SGD with momentum)",
     "torch", "2.9", lambda: getattr(torch.optim, "Muon", None) is not None),
    ("trainers/lightning_ref.py: Trainer.fit(weights_only=...)", "lightning", "2.6", _fit_takes_weights_only),
]


@pytest.mark.parametrize(("where", "distribution", "since", "present"), FEATURES, ids=[f[0].split(":")[0]
                                                                                     for f in FEATURES])
def test_a_feature_asked_for_is_there_exactly_from_its_release(where: str, distribution: str, since: str,
                                                               present: object) -> None:
    installed = release(distribution)
    expected = installed >= Version(since)
    assert present() is expected, (f"{where}: expected {'present' if expected else 'absent'} on {distribution} "
                                   f"{installed} (it came in {since}); update the guard and this table")


def test_ddp_reports_the_settings_the_checks_read() -> None:
    """checks/support/observe.py reads these attributes off the DDP the fit built, where a missing one reads as
    None; torch 2.13 renamed `broadcast_buffers` to `forward_sync_buffers` and kept the old name as a
    property, so the old name must still answer on every release."""
    from ddp_conformance.checks.support.observe import DDP_SETTINGS

    source = inspect.getsource(DistributedDataParallel)
    read = [name for name in DDP_SETTINGS if f"self.{name} =" in source or f"def {name}(" in source]
    expected = set(DDP_SETTINGS) - ({"forward_sync_buffers"} if release("torch") < Version("2.13") else set())
    assert set(read) == expected, f"DDP on torch {release('torch')} sets {read} of {DDP_SETTINGS}"


@pytest.mark.ddp(world_size=2)
def test_the_private_torch_apis_the_harness_reads_answer(ddp) -> None:
    """runner/rank/task_runner.py's health check reads the collective sequence number (a failure there is suppressed:
    the pool would lose its out-of-step test), launched.py the default store, checks/support/memory.py DDP's
    logging data (gradient_as_bucket_view; observe.py the communication hook) and a gradient's view base."""
    import torch.distributed as dist

    world = dist.group.WORLD
    before = world._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(1))
    assert isinstance(before, int) and world._get_sequence_number_for_group() == before + 1
    store = dist.distributed_c10d._get_default_store()
    store.set(f"versions/{ddp.rank}", b"1")
    store.wait([f"versions/{rank}" for rank in range(ddp.world_size)])

    from ddp_conformance.checks.support.memory import shares_its_base

    model = DistributedDataParallel(torch.nn.Linear(4, 4), gradient_as_bucket_view=True)
    model(torch.ones(2, 4)).sum().backward()
    assert hasattr(model, "_get_ddp_logging_data")  # memory.py takes a model without it for no DDP at all
    assert model._get_ddp_logging_data()["gradient_as_bucket_view"] == 1
    assert all(shares_its_base(p.grad) for p in model.parameters())

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from ddp_conformance.checks.support.observe import comm_hook_name

    hooked = DistributedDataParallel(torch.nn.Linear(4, 4))
    assert comm_hook_name(hooked) is None  # bucket_cap_mb_invariance then compares no caps
    hooked.register_comm_hook(None, fp16_compress_hook)
    built_in = DistributedDataParallel(torch.nn.Linear(4, 4))
    built_in._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert comm_hook_name(hooked) == "fp16_compress_hook"
    assert comm_hook_name(built_in) == "BuiltinCommHookType.FP16_COMPRESS"

    from torch.utils.checkpoint import checkpoint

    from ddp_conformance.checks.support.observe import recomputing

    seen: list[bool] = []
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_pre_hook(lambda *_: seen.append(recomputing()))
    for reentrant in (True, False):  # the forward, then its recomputation inside the backward
        checkpoint(layer, torch.ones(2, 4, requires_grad=True), use_reentrant=reentrant).sum().backward()
    assert seen == [False, True, False, True]
