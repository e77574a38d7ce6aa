"""Both processes: Hugging Face accelerate's process-wide state: forgotten before and after each script run, and set
aside while the trainer's code runs as in a world of one.

accelerate keeps what it learnt of the process group (`num_processes`, `process_index`, the distributed type)
in singletons whose instances share one class-level dict (`PartialState`, `AcceleratorState`,
`GradientState`, each a `_shared_state`), filled by the first `Accelerator()` of the process and kept for
every later one. A rank serves check after check, so a script rerun in a world of one
(`one_world.world_of_one`) would build its `Accelerator()` on the real world's state: shard its data for
two processes and read `accelerator.num_processes` as 2, so a loss divided by it is divided alike in the
reference the DDP run is compared with, and the bug is invisible. Inside `fresh`, those dicts are empty,
so the script's `Accelerator()` reads the world of one as a process torchrun started alone would; the real
world's state is put back after.

accelerate is not a dependency of the plugin: nothing here imports it; it acts only on the module a script
already loaded (`sys.modules`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

#: the classes of `accelerate.state` that keep their state in a shared `_shared_state` dict
SINGLETONS = ("PartialState", "AcceleratorState", "GradientState")


def _shared_dicts() -> list[dict]:
    module = sys.modules.get("accelerate.state")
    if module is None:
        return []
    found = []
    for name in SINGLETONS:
        shared = getattr(getattr(module, name, None), "_shared_state", None)
        if isinstance(shared, dict):
            found.append(shared)
    return found


def reset() -> None:
    """Forget accelerate's state, as a fresh process holds none: under torchrun every script run is a new
    process, where a rank serves run after run."""
    for state in _shared_dicts():
        state.clear()


@contextlib.contextmanager
def fresh() -> Iterator[None]:
    """accelerate's singletons empty inside (the script's `Accelerator()` sets them up anew), restored after."""
    shared = _shared_dicts()
    saved = [dict(state) for state in shared]
    for state in shared:
        state.clear()
    try:
        yield
    finally:
        for state, before in zip(shared, saved, strict=True):
            state.clear()
            state.update(before)
