"""The global batch of each optimizer step, from what every rank's micro-batches trained, on plain lists.

A step's global batch is the union of the samples every rank's micro-batches of that step trained. Under a
`DistributedSampler` it is one contiguous chunk of the epoch's permutation whatever the world size (rank r takes
every W-th index), so a run resumed at another world size continues the same sequence of global batches exactly
when the global batch size stays the same (per-rank batch = global / W) and the position is restored in units that
do not depend on W.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: (the optimizer step a micro-batch adds to, counted from 1; the dataset indices it trained, None if unread)
Draw = tuple[int, "list[int] | None"]


def per_step(ranks: Iterable[Iterable[Draw]], offset: int = 0) -> dict[int, list[int]]:
    """Each step's global batch, sorted (a multiset: a padded epoch repeats samples), its step moved by `offset`."""
    batches: dict[int, list[int]] = {}
    for draws in ranks:
        for step, indices in draws:
            batches.setdefault(step + offset, []).extend(indices or [])
    return {step: sorted(indices) for step, indices in sorted(batches.items())}


def unread(ranks: Iterable[Iterable[Draw]]) -> bool:
    """Whether some micro-batch's indices could not be read (the trainer's batch_indices failed on it)."""
    return any(indices is None for draws in ranks for _, indices in draws)


@dataclass(frozen=True)
class Parting:
    """The first step where a resumed run's global batch is not the uninterrupted run's."""

    step: int
    got: list[int]
    expected: list[int]
    shift: int | None = None  # the resumed step trains the uninterrupted run's step `step + shift`

    @property
    def sizes_differ(self) -> bool:
        return len(self.got) != len(self.expected)

    def unlike(self) -> int:
        """Samples of the resumed step that the uninterrupted step did not train."""
        left = list(self.expected)
        extra = 0
        for index in self.got:
            if index in left:
                left.remove(index)
            else:
                extra += 1
        return extra


def first_parting(expected: dict[int, list[int]], got: dict[int, list[int]], steps: range) -> Parting | None:
    """The first step in `steps` whose global batch differs (a step one run never trained counts, as empty)."""
    for step in steps:
        mine, theirs = got.get(step, []), expected.get(step, [])
        if mine != theirs:
            shift = next((other - step for other, batch in expected.items() if mine and batch == mine), None)
            return Parting(step, mine, theirs, shift)
    return None
