"""Fresh RNG seeds for a rank, as a process that torchrun starts would have.

A process started by torchrun seeds torch's default generator, Python's `random` and numpy's global
RandomState from OS entropy, so two ranks (and two runs) draw different numbers unless the trainer
seeds them. Ranks forked from one zygote would instead all inherit the zygote's RNG state, and ranks
reused test after test would inherit whatever the previous test left (often one `manual_seed` on
every rank): a trainer that builds random data without a seed would then see the same data on every
rank here and different data per rank in production. So each rank reseeds when it starts and at the
start of every test.
"""

from __future__ import annotations

import random
import sys


def fresh_seeds() -> None:
    """Reseed torch (CPU, and CUDA lazily), Python's `random` and numpy (if imported) from OS entropy."""
    import torch

    torch.seed()  # a non-deterministic seed; CUDA generators follow when CUDA is initialised
    random.seed()
    numpy = sys.modules.get("numpy")  # torch imports it when installed; never imported just for this
    if numpy is not None:
        numpy.random.seed()
