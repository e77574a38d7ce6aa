"""Fresh RNG seeds for a rank, as a process that torchrun starts would have.

A process started by torchrun seeds torch's default generator, Python's `random` and numpy's global
RandomState from OS entropy, so two ranks (and two runs) draw different numbers unless the trainer
seeds them. Ranks forked from one zygote would instead all inherit the zygote's RNG state, and ranks
reused test after test would inherit whatever the previous test left (often one `manual_seed` on
every rank): a trainer that builds random data without a seed would then see the same data on every
rank here and different data per rank in production. So each rank reseeds when it starts and at the
start of every test.

This runs on every rank before every test, on the critical path of the cheapest distributed test,
so it takes the cheap road to the same result: 38 us where `torch.seed(); random.seed();
numpy.random.seed()` took 627 us (`python -m timeit -s "from ddp_conformance.runner.seeds import
fresh_seeds" "fresh_seeds()"`, 2-core CI VM). `torch.seed()` records three stack traces a call for
accelerator generators a CPU-only build cannot have; `numpy.random.seed()` hashes its entropy in
Python under `np.errstate`. At world size 4 the ranks' CPU per warm trivial test fell from 8.6 to
3.2 ms with this (`benchmarks/pytest_overhead.py`, rank cpu column). numpy takes a 32-bit seed: its
array form (128 bits) ran a rank's numpy reseed through four ufuncs, and the whole reseed cost
238-397 us of a rank's CPU per test in a 400-test world-size-4 session against 104-255 us with the
integer (thread CPU around the call in each rank; two sessions before, four after). Two of four ranks share a
numpy stream in one test with odds of 6 in 2**32.
"""

from __future__ import annotations

import os
import random
import sys


def fresh_seeds() -> None:
    """Reseed torch (CPU, and accelerators lazily), Python's `random` and numpy (if imported) from
    OS entropy, drawn in one call."""
    import torch

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
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator is not None and accelerator.current_accelerator() is None
