"""Files a checkpoint holds per rank by design, told from several ranks writing one checkpoint.

accelerate's `save_state` writes `random_states_<rank>.pkl` on every rank, and the transformers Trainer
`rng_state_<rank>.pth`, next to the model and optimizer files rank 0 alone writes: each rank saves its
own RNG state under a name of its own. That is no race. A race is several ranks writing one path (every
rank's `torch.save(state, "ckpt.pt")`), or a rank other than 0 writing what rank 0 writes.

Each rank writes into a directory of its own (resume_fidelity's `ckpt/rank<r>`), so a file's rank is
known by where it lies and its path relative to that directory is what the rank wrote. A file of rank r
is its own by design when its path carries r as a number of its own (`random_states_1.pkl`,
`rank1/state.pt`) and rank 0 wrote the same path with 0 there instead, and no file of the other
ranks has that path.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"\d+")


def rank_zero_counterparts(path: str, rank: int) -> list[str]:
    """`path` with one of its numbers equal to `rank` replaced by 0, for each such number."""
    found = []
    for match in _NUMBER.finditer(path):
        if int(match.group(0)) == rank:
            found.append(f"{path[:match.start()]}0{path[match.end():]}")
    return found


def own_by_design(path: str, rank: int, rank_zero: set[str]) -> bool:
    """Whether rank `rank`'s file `path` is a per-rank file rank 0 writes its own counterpart of."""
    return path not in rank_zero and any(other in rank_zero for other in rank_zero_counterparts(path, rank))


def shared_writes(written: list[list[str]]) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """From every rank's written files (by rank): the ranks other than 0 that wrote files that are not
    their own by design, with those files; and the per-rank files by design (rank 1's, as examples)."""
    rank_zero = set(written[0]) if written else set()
    racing, per_rank = [], []
    for rank, files in enumerate(written[1:], start=1):
        mine = [f for f in files if own_by_design(f, rank, rank_zero)]
        others = [f for f in files if f not in mine]
        if others:
            racing.append((rank, others))
        if rank == 1:
            per_rank = mine
    return racing, per_rank
