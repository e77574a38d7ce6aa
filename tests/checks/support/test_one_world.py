"""The world of one (`checks/one_world.py`): every collective the trainer itself calls has one
participant there, as in a real single-process run; outside it, and for DDP, the group is real."""

from __future__ import annotations

import pytest


@pytest.mark.ddp(world_size=2)
def test_the_trainers_collectives_have_one_participant_in_the_world_of_one(ddp):
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as autograd_collectives
    from lightning.pytorch.strategies import DDPStrategy

    from ddp_conformance.checks.support.one_world import COLLECTIVES, world_of_one

    mine = torch.tensor([float(ddp.rank + 1)])  # 1 on rank 0, 2 on rank 1: a real collective changes it
    strategy = DDPStrategy()  # Lightning's reduce / all_gather / broadcast / barrier need no fit
    with world_of_one():
        assert all("in a world of one process" in getattr(dist, name).__doc__ for name in COLLECTIVES)
        value = mine.clone()
        dist.all_reduce(value)
        dist.broadcast(value, src=0)
        dist.reduce(value, dst=0)
        assert dist.all_reduce(value, async_op=True).wait() and torch.equal(value, mine)
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        into, scattered = torch.zeros(1), torch.zeros(1)
        dist.all_gather_into_tensor(into, mine)
        dist.reduce_scatter_tensor(scattered, mine)
        assert gathered == [mine] and torch.equal(into, mine) and torch.equal(scattered, mine)
        objects = [None]
        dist.all_gather_object(objects, ddp.rank)
        dist.barrier()
        assert objects == [ddp.rank]
        assert torch.equal(strategy.reduce(mine.clone(), reduce_op="sum"), mine)
        assert torch.equal(strategy.reduce(mine.clone(), reduce_op="mean"), mine)
        assert torch.equal(strategy.all_gather(mine), mine.unsqueeze(0))
        strategy.barrier()
        assert strategy.broadcast(ddp.rank) == ddp.rank
        leaf = mine.clone().requires_grad_()  # LightningModule.all_gather(sync_grads=True)'s path
        strategy.all_gather(leaf, sync_grads=True).sum().backward()
        assert torch.equal(autograd_collectives.all_reduce(mine), mine) and torch.equal(leaf.grad, torch.ones(1))
        with pytest.raises(ValueError, match="all_gather's tensor_list has 2 entries, in a world of one process"):
            dist.all_gather([torch.zeros(1), torch.zeros(1)], mine)  # sized by a world size read before
    value = mine.clone()
    dist.all_reduce(value)
    assert value.item() == 3.0  # the real group again


def test_a_collective_imported_by_name_is_the_world_of_ones_too(monkeypatch):
    """`from torch.distributed import all_reduce` in the trainer's module: no group here, so the real one
    would raise."""
    import sys
    import types

    import torch

    from ddp_conformance.checks.support.one_world import world_of_one

    trainer_module = types.ModuleType("users_token_mean")
    exec("from torch.distributed import all_reduce as ar, broadcast", trainer_module.__dict__)
    monkeypatch.setitem(sys.modules, "users_token_mean", trainer_module)
    count = torch.tensor([5.0])
    with world_of_one():
        trainer_module.ar(count)
        trainer_module.broadcast(count, src=0)
    assert count.item() == 5.0
    assert trainer_module.ar is torch.distributed.all_reduce


@pytest.mark.ddp(world_size=2)
def test_ddp_s_join_keeps_its_real_group_in_the_world_of_one(ddp):
    """A script rerun in a world of one builds its DDP on the rank's own group of one, and DDP's join
    all-reduces on that group and hands the work handle to DDP's reducer, which takes only a real one:
    a stand-in there raised "_set_forward_pass_work_handle(): incompatible function arguments"."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddp_conformance.checks.support.one_world import world_of_one

    alone = [dist.new_group([r]) for r in range(ddp.world_size)][ddp.rank]
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 1), process_group=alone)
    with world_of_one(), model.join():
        model(torch.ones(2, 3)).sum().backward()
    assert torch.equal(model.module.weight.grad, torch.full((1, 3), 2.0))  # this rank's own gradient, unaveraged


def test_an_async_collective_s_future_holds_its_tensors_as_a_real_one_does():
    """A comm hook's `dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])`
    reads the tensor back from the future: a stand-in whose future held None raised inside the trainer's hook."""
    import torch

    from ddp_conformance.checks.support.one_world import stand_ins

    one = stand_ins()
    value, into = torch.ones(3), torch.zeros(3)
    assert one["all_reduce"](value, async_op=True).get_future().value()[0] is value
    assert one["all_reduce"](value) is None
    assert one["all_gather_into_tensor"](into, value, async_op=True).get_future().value()[0] is into
    assert one["barrier"](async_op=True).get_future().value() == []


@pytest.mark.ddp(world_size=2)
def test_ddp_registers_no_comm_hook_in_the_reference(ddp):
    """The reference for a run with a comm hook runs DDP's own all-reduce: the hook is named, not registered."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddp_conformance.checks.support.observe import comm_hook_name
    from ddp_conformance.checks.support.one_world import without_comm_hooks

    def never(state, bucket):  # a hook that cannot run: it would fail the backward below
        raise AssertionError("the hook ran")

    with without_comm_hooks() as skipped:
        model = DistributedDataParallel(torch.nn.Linear(2, 2))
        model.register_comm_hook(None, never)
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        model(torch.ones(1, 2)).sum().backward()
    assert skipped == [never.__qualname__, "BuiltinCommHookType.FP16_COMPRESS"] and comm_hook_name(model) is None
    hooked = DistributedDataParallel(torch.nn.Linear(2, 2))
    hooked.register_comm_hook(None, never)  # outside it, DDP's own method again
    assert comm_hook_name(hooked) is not None


def test_the_world_of_one_reaches_names_imported_from_torch_distributed_but_not_torch_itself(monkeypatch):
    """`from torch.distributed import get_world_size as ws` in the trainer's module reads 1 in the
    reference, as in a real single-process run; torch's own modules keep the real functions."""
    import sys
    import types

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ddp_conformance.checks.support.one_world import world_of_one

    trainer_module = types.ModuleType("users_training_script")
    exec("from torch.distributed import get_world_size as ws, get_rank", trainer_module.__dict__)
    monkeypatch.setitem(sys.modules, "users_training_script", trainer_module)
    real = c10d.get_world_size
    with world_of_one():
        assert trainer_module.ws() == 1 and trainer_module.get_rank() == 0  # no group: the real ones would raise
        assert dist.get_world_size() == 1
        assert c10d.get_world_size is real  # DDP and the collectives keep reading the real group
    assert trainer_module.ws is real and trainer_module.get_rank is c10d.get_rank
