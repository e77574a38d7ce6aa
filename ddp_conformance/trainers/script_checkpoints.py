"""Both processes: where a `script:` fit put its checkpoint, and the directory a resume of it starts in.

Every rank's fit writes into a `{checkpoint_dir}` of its own (`ckpt/rank<r>`), so what a rank wrote is
known by where it lies. Tools that checkpoint per rank by design (accelerate's `save_state` writes
`random_states_<rank>.pkl` on every rank, the transformers Trainer `rng_state_<rank>.pth`, next to rank
0's model and optimizer) need every rank's files at the resume: the resume's fresh copy holds rank 0's
directory with every other rank's files merged in where rank 0 has none of that name.

A fit asked for a checkpoint at step k records, per rank: its directory, k, and its top-level entries as
they stood when step k + 1 began (`EntryWatch`). A fit that goes on past k (the fit to n that writes
resume_fidelity's checkpoint on the way, as the user runs it, so that a schedule set by the total steps
is the user's) may save again later; the resume's copy then holds only the entries there were at k, so
`{checkpoint_latest}` is the latest checkpoint *at k*, and an entry rewritten after k (one name saved at
every interval) is named: the checkpoint at k is gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

_NUMBER = re.compile(r"(\d+)(?!.*\d)")


@dataclass(frozen=True)
class FitCheckpoint:
    """What one rank's fit recorded about the checkpoint it was asked for."""

    directory: Path
    step: int
    rank: int
    entries: dict[str, int] = field(default_factory=dict)  # top-level name -> newest mtime under it, at step k


SIDECAR = ".ddp-checkpoint.json"  # beside the fit's directory (`ckpt/rank0.ddp-checkpoint.json`), not in it


def _sidecar(directory: Path) -> Path:
    return directory.with_name(directory.name + SIDECAR)


def newest_mtime(path: Path) -> int:
    """The newest modification time of `path` or any file under it (ns); 0 if it is gone."""
    try:
        stamps = [path.lstat().st_mtime_ns]
    except OSError:
        return 0
    if path.is_dir() and not path.is_symlink():
        for root, _dirs, names in os.walk(path):
            stamps.extend(Path(root, name).lstat().st_mtime_ns for name in names)
    return max(stamps)


def entries_of(directory: Path) -> dict[str, int]:
    """The top-level entries of a fit's directory (links to the SPEC's base aside) and their newest mtimes."""
    if not directory.is_dir():
        return {}
    return {entry.name: newest_mtime(entry) for entry in directory.iterdir() if not entry.is_symlink()}


class EntryWatch:
    """Lists a fit's directory once, as optimizer step `step + 1` begins (or as the script ends, if
    sooner): the checkpoint written after step k is there, a later save is not yet."""

    def __init__(self, directory: Path, step: int) -> None:
        self.directory, self.step = directory, step
        self.entries: dict[str, int] | None = None

    def at_step(self, taken: int) -> None:
        if self.entries is None and taken >= self.step:
            self.entries = entries_of(self.directory)

    def finish(self) -> dict[str, int]:
        if self.entries is None:
            self.entries = entries_of(self.directory)
        return self.entries

    def rewritten(self) -> list[str]:
        """Entries there at step k that the script changed afterwards (the checkpoint at k overwritten)."""
        at_k = self.finish()
        return sorted(name for name, stamp in at_k.items() if newest_mtime(self.directory / name) != stamp)


def remember(record: FitCheckpoint) -> None:
    """Record this rank's fit beside its directory, where every rank's resume finds it: each rank's
    directory is a sibling of the others' (`ckpt/rank<r>`), in the directory all ranks share."""
    _sidecar(record.directory).write_text(json.dumps(
        {"directory": str(record.directory), "step": record.step, "rank": record.rank, "entries": record.entries}))


def _read(path: Path) -> FitCheckpoint | None:
    try:
        data = json.loads(path.read_text())
        return FitCheckpoint(Path(data["directory"]), int(data["step"]), int(data["rank"]), dict(data["entries"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fit_of(checkpoint: Path) -> FitCheckpoint | None:
    """The recorded fit whose directory holds `checkpoint` (the path itself or one above it)."""
    for candidate in (Path(checkpoint), *Path(checkpoint).parents):
        found = _read(_sidecar(candidate)) if candidate.name else None
        if found is not None and found.directory.resolve() == candidate.resolve():
            return found
    return None


def other_ranks(fit: FitCheckpoint) -> list[FitCheckpoint]:
    """The fits the other ranks recorded beside `fit` (directories with the same parent), by rank."""
    found = [_read(path) for path in fit.directory.parent.glob("*" + SIDECAR)]
    return sorted((record for record in found if record is not None and record.rank != fit.rank
                   and record.step == fit.step), key=lambda record: record.rank)


def copy_for_resume(fit: FitCheckpoint, into: Path) -> list[str]:
    """Fill `into` with rank 0's entries at step k, then every other rank's files that rank 0's copy
    lacks (their per-rank RNG files); returns those merged files' relative paths."""
    _copy_entries(fit.directory, fit.entries, into)
    merged: list[str] = []
    for other in other_ranks(fit):
        staged = into.parent / f"{into.name}.rank-merge"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        _copy_entries(other.directory, other.entries, staged)
        for path in sorted(p for p in staged.rglob("*") if p.is_file()):
            target = into / path.relative_to(staged)
            if not os.path.lexists(target):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), target)
                merged.append(str(target.relative_to(into)))
        shutil.rmtree(staged, ignore_errors=True)
    return merged


def _copy_entries(source: Path, entries: dict[str, int], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for name in entries or [entry.name for entry in source.iterdir() if not entry.is_symlink()]:
        entry = source / name
        if entry.is_dir():
            shutil.copytree(entry, into / name, dirs_exist_ok=True, symlinks=True)
        elif entry.exists():
            shutil.copy2(entry, into / name)


def latest(directory: Path) -> Path | None:
    """The latest checkpoint directly under `directory`: of the entries whose names end in a number
    (`checkpoint-12`, `step_8`), the highest; else the newest by modification time."""
    entries = [entry for entry in directory.iterdir() if not entry.is_symlink()] if directory.is_dir() else []
    numbered = [(int(match.group(1)), entry) for entry in entries if (match := _NUMBER.search(entry.name))]
    if numbered:
        return max(numbered, key=lambda pair: pair[0])[1]
    return max(entries, key=newest_mtime, default=None)
