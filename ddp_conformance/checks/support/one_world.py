"""`world_of_one`: the trainer's own code run as in a world of one process, for the single-process
reference gradient_equivalence compares DDP's gradients with.

A real run on one process reads world size 1 and rank 0, and every collective it calls has one
participant: `all_reduce` leaves the tensor as it is, `all_gather` gives a list of one, `broadcast`
and `barrier` do nothing. A reference that only says "world size 1" but lets the trainer's
collectives reach the real group computes something no run computes: a global token count
`strategy.reduce(n, "sum")` is the sum over the real ranks of the whole batch's count, twice the
single-process count at world size 2, and the reference's gradients are half of what they should be.

So inside `world_of_one`, `torch.distributed`'s collectives (the attributes every caller reaches:
the trainer's `dist.all_reduce`, Lightning's strategies' `reduce` / `all_gather` / `broadcast` /
`barrier`, `LightningModule.all_gather` through them, `torch.distributed.nn.functional`'s autograd
collectives, and the names a trainer's module imported, `from torch.distributed import all_reduce`)
are stand-ins with one participant. Callers that must reach the real group keep it: DDP
(`torch.nn.parallel`, whose reducer talks to the process group directly anyway), DDP's join
(`torch.distributed.algorithms`, whose collectives run on DDP's own group) and the harness's own
checks and runner. torch's private modules (`distributed_c10d`) keep the originals.
`self.log(..., sync_dist=True)` reduces through the strategy's `reduce`, so it is covered too (and
outside a fit the adapter keeps `self.log` silent). Not covered: functional collectives
(`torch.distributed._functional_collectives`, DTensor), which return new tensors from C++ ops.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...trainers import accelerate_state

# packages whose own bindings of torch.distributed names stay real: torch's DDP and collectives, Lightning
# (it calls them as attributes, `torch.distributed.all_reduce`, which are patched) and the harness itself
_LIBRARIES = frozenset({"torch", "lightning", "pytorch_lightning", "lightning_fabric", "ddp_conformance"})
# callers whose collectives must reach the real group even inside the world of one: DDP, and DDP's join
# (`Join.notify_join_context` all-reduces on the joinables' group, DDP's, whose reducer wants a real work handle
# from it: in a rerun that group is the rank's own group of one), and the harness
_REAL_CALLERS = ("torch.nn.parallel", "torch.distributed.algorithms", "ddp_conformance.checks",
                 "ddp_conformance.runner")


class _Done:
    """The work handle of a collective with one participant, for `async_op=True`: already complete. Its future
    holds what a real one holds, the collective's tensors (`all_reduce(t, async_op=True).get_future().value()`
    is `[t]`), which a comm hook's `fut.value()[0]` reads."""

    def __init__(self, result: list[Any] | None = None) -> None:
        self.result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Any:
        future: Any = torch.futures.Future()
        future.set_result(self.result)
        return future


def _handle(kwargs: dict[str, Any], *tensors: Any) -> _Done | None:
    """The handle for `async_op=True` (None otherwise), its future holding `tensors` (tensors or lists of them)."""
    if not kwargs.get("async_op"):
        return None
    flat = [t for item in tensors for t in (item if isinstance(item, list | tuple) else [item])]
    return _Done([t for t in flat if isinstance(t, torch.Tensor)])


def _one(items: Any, what: str) -> Any:
    """The single entry a list argument has in a world of one (a list sized for another world is the
    caller's mistake, and torch would refuse it too)."""
    if len(items) != 1:
        raise ValueError(f"{what} has {len(items)} entries, in a world of one process it must have 1")
    return items[0]


def _same(output: Any, value: Any) -> None:
    output.copy_(value.reshape(output.shape))


def _nothing(*args: Any, **kwargs: Any) -> _Done | None:
    """all_reduce, reduce, broadcast, barrier...: with one participant the tensor is already the result."""
    return _handle(kwargs, *(args[:1] or [kwargs.get("tensor", kwargs.get("tensors"))]))


def _all_gather(tensor_list: Any, tensor: Any, *args: Any, **kwargs: Any) -> _Done | None:
    _one(tensor_list, "all_gather's tensor_list").copy_(tensor)
    return _handle(kwargs, tensor_list)


def _into_tensor(output: Any, tensor: Any, *args: Any, **kwargs: Any) -> _Done | None:
    """all_gather_into_tensor / reduce_scatter_tensor / all_to_all_single: output is the input."""
    _same(output, tensor)
    return _handle(kwargs, output)


def _reduce_scatter(output: Any, input_list: Any, *args: Any, **kwargs: Any) -> _Done | None:
    output.copy_(_one(input_list, "reduce_scatter's input_list"))
    return _handle(kwargs, output)


def _all_to_all(output_list: Any, input_list: Any, *args: Any, **kwargs: Any) -> _Done | None:
    _one(output_list, "all_to_all's output_tensor_list").copy_(_one(input_list, "all_to_all's input_tensor_list"))
    return _handle(kwargs, output_list)


def _gather(tensor: Any, gather_list: Any = None, *args: Any, **kwargs: Any) -> _Done | None:
    if gather_list:
        _one(gather_list, "gather's gather_list").copy_(tensor)
    return _handle(kwargs, gather_list or [])


def _scatter(tensor: Any, scatter_list: Any = None, *args: Any, **kwargs: Any) -> _Done | None:
    if scatter_list:
        tensor.copy_(_one(scatter_list, "scatter's scatter_list"))
    return _handle(kwargs, tensor)


def _all_gather_object(object_list: list[Any], obj: Any, *args: Any, **kwargs: Any) -> None:
    _one(object_list, "all_gather_object's object_list")
    object_list[0] = obj


def _gather_object(obj: Any, object_gather_list: list[Any] | None = None, *args: Any, **kwargs: Any) -> None:
    if object_gather_list is not None:
        _one(object_gather_list, "gather_object's object_gather_list")
        object_gather_list[0] = obj


def _scatter_object_list(output_list: list[Any], input_list: list[Any] | None = None, *args: Any,
                         **kwargs: Any) -> None:
    output_list[0] = _one(input_list or [None], "scatter_object_list's input list")


#: torch.distributed's collectives (name -> what it does with one participant)
COLLECTIVES: dict[str, Callable[..., Any]] = {
    "all_reduce": _nothing, "all_reduce_coalesced": _nothing, "reduce": _nothing, "broadcast": _nothing,
    "broadcast_object_list": _nothing, "barrier": _nothing, "monitored_barrier": _nothing,
    "all_gather": _all_gather, "all_gather_into_tensor": _into_tensor, "_all_gather_base": _into_tensor,
    "reduce_scatter": _reduce_scatter, "reduce_scatter_tensor": _into_tensor, "_reduce_scatter_base": _into_tensor,
    "all_to_all": _all_to_all, "all_to_all_single": _into_tensor, "gather": _gather, "scatter": _scatter,
    "all_gather_object": _all_gather_object, "gather_object": _gather_object,
    "scatter_object_list": _scatter_object_list,
}


def _for_the_trainer(original: Callable[..., Any], one: Callable[..., Any]) -> Callable[..., Any]:
    """`one` for the trainer's calls, `original` for DDP's and the harness's (`_REAL_CALLERS`)."""

    def collective(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(_REAL_CALLERS):
            return original(*args, **kwargs)
        return one(*args, **kwargs)

    collective.__name__ = collective.__qualname__ = original.__name__
    collective.__doc__ = f"{original.__name__} in a world of one process (ddp_conformance.checks.one_world)"
    return collective


def stand_ins() -> dict[str, Any]:
    """Every name of torch.distributed the world of one replaces, with its replacement."""

    replaced: dict[str, Any] = {"get_world_size": lambda group=None: 1, "get_rank": lambda group=None: 0}
    for name, one in COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is None:
            raise AssertionError(f"torch.distributed.{name} is gone: update ddp_conformance.checks.one_world")
        replaced[name] = _for_the_trainer(original, one)
    return replaced


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """The trainer's code as it runs in a world of one process: `torch.distributed.get_world_size()`
    and `get_rank()` say 1 and 0, its collectives have one participant (module docstring), as do
    the names the trainer's modules imported (`from torch.distributed import get_world_size [as ws]`),
    and WORLD_SIZE/RANK/LOCAL_RANK/LOCAL_WORLD_SIZE say so too, so a loss scaled by the world size, or by
    a count summed over ranks, is not scaled in the reference it is compared with. (A name bound elsewhere,
    in a closure or a default argument, keeps the real value: docs/checks/gradient_equivalence.md.)"""

    replaced = stand_ins()
    originals = {id(getattr(dist, name)): (getattr(dist, name), stand_in) for name, stand_in in replaced.items()}
    with contextlib.ExitStack() as stack:
        for module, name, stand_in in _imported_bindings(originals):
            stack.enter_context(mock.patch.object(module, name, stand_in))
        for name, stand_in in replaced.items():
            stack.enter_context(mock.patch.object(dist, name, stand_in))
        # LOCAL_RANK too: Lightning's strategy indexes its one device with it (`parallel_devices[local_rank]`)
        stack.enter_context(mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                                                         "LOCAL_WORLD_SIZE": "1"}))
        # accelerate's Accelerator() reads the world it was first built in from process-wide singletons
        stack.enter_context(accelerate_state.fresh())
        yield


@contextlib.contextmanager
def without_comm_hooks() -> Iterator[list[str]]:
    """DDP's `register_comm_hook` and `_register_builtin_comm_hook` as no-ops that name what they were given
    (the list yielded): the reference a run with a comm hook is compared with runs DDP's own all-reduce, so that
    it neither inherits the hook under judgement nor depends on the hook working in a world of one (a hook whose
    state is a group or an object set up for the real world)."""
    skipped: list[str] = []

    def register_comm_hook(ddp: Any, state: object, hook: Callable[..., Any]) -> None:
        skipped.append(getattr(hook, "__qualname__", None) or repr(hook))

    def register_builtin(ddp: Any, comm_hook_type: Any) -> None:
        skipped.append(str(comm_hook_type))

    with mock.patch.object(DistributedDataParallel, "register_comm_hook", register_comm_hook), \
            mock.patch.object(DistributedDataParallel, "_register_builtin_comm_hook", register_builtin):
        yield skipped


def _imported_bindings(originals: dict[int, tuple[Any, Any]]) -> list[tuple[Any, str, Any]]:
    """(module, name, stand-in) for every global of a module outside `_LIBRARIES` that is one of
    `originals` (id -> (original, stand-in)): a patch of `torch.distributed` alone misses them."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module_name.partition(".")[0] in _LIBRARIES:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            entry = originals.get(id(value))
            if entry is not None and entry[0] is value:
                found.append((module, name, entry[1]))
    return found
