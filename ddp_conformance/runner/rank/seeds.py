"""Fresh RNG seeds for a rank, as a process that torchrun starts would have.

A process started by torchrun seeds torch's default generator, Python's `random` and numpy's global
RandomState from OS entropy, so two ranks (and two runs) draw different numbers unless the trainer
seeds them. Ranks forked from one fork server would instead all inherit the fork server's RNG state, and ranks
reused test after test would inherit whatever the previous test left (often one `manual_seed` on
every rank): a trainer that builds random data without a seed would then see the same data on every
rank here and different data per rank in production. So each rank reseeds when it starts and at the
start of every test.

This runs on every rank before every test, on the critical path of the cheapest distributed test,
so it takes the cheap road to the same result as `torch.seed(); random.seed(); numpy.random.seed()`,
from one `os.urandom` call: `torch.seed()` records three stack traces a call for accelerator
generators a CPU-only build cannot have, so a CPU-only torch gets its one generator seeded directly;
`numpy.random.seed()` hashes its entropy in Python under `np.errstate`, and its array form (128 bits)
runs four ufuncs, so numpy gets the legacy 32-bit integer seed. Two of four ranks then share a numpy
stream in one test with odds of 6 in 2**32. The costs are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
import random
import sys


def fresh_seeds() -> None:
    """Reseed torch (CPU, and accelerators lazily), Python's `random` and numpy (if imported) from
    OS entropy, drawn in one call."""
    import torch  # deferred: the parent imports this module (SPEC checks) without needing torch

    entropy = os.urandom(28)
    if _cpu_only_torch():  # all torch.seed() does on a CPU-only build (64 bits), less its stack traces
        torch.default_generator.manual_seed(int.from_bytes(entropy[:8], "little"))
    else:
        torch.seed()  # a non-deterministic seed; accelerator generators follow when initialised
    random.seed(int.from_bytes(entropy[8:24], "little"))
    numpy = sys.modules.get("numpy")  # torch imports it when installed; never imported just for this
    if numpy is not None:  # the legacy seed's 32 bits: the array form costs a rank 4x more
        numpy.random.seed(int.from_bytes(entropy[24:], "little"))


def _cpu_only_torch() -> bool:
    """Whether this torch has no accelerator (CUDA/ROCm, MPS, XPU, MTIA built in, or a custom device
    registered so far): then the CPU generator is the only one `torch.seed()` seeds. Asking
    initialises no device, and is asked every time (0.3 us): a test may register a custom device.
    Before torch 2.6 (no `torch.accelerator`) nothing can tell without initialising CUDA, which a
    forked rank must not do, so the answer is no and `torch.seed()` seeds every generator itself."""
    import torch  # deferred: as in fresh_seeds

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator is not None and accelerator.current_accelerator() is None
