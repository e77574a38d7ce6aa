"""Where each rank of a hung fit waits, from torch's flight recorder: the collective (operation, process group,
sequence number in it, tensor shapes), the user's frame that called it, and the first collective where the
ranks' sequences part.

torch keeps, per process, a ring buffer of the collectives every process group ran (`TORCH_FR_BUFFER_SIZE`
entries, set for the ranks by the runner), each with the Python stack that called it, on gloo as on NCCL:
`torch.distributed.flight_recorder` analyses such dumps offline. A hung rank's watcher dumps its own buffer
(`dump`) into the fit's progress directory, outside the process group; the verdict reads every rank's
(`read_all`) and says where each waits (`where`) and where they parted (`first_parting`). Where torch keeps no
record (a build before the recorder covered gloo, or a buffer of 0), nothing is dumped and the verdict says
what progress alone tells.
"""

from __future__ import annotations

import json
import os
import pickle
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: entries each dump keeps per process group, the newest: the parting is near the hang
KEPT_PER_GROUP = 64
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ddp_conformance/
# the suite's own code, as against the trainers it ships (the references, the adapters that run a user's code)
_HARNESS_DIRS = tuple(os.path.join(_OWN_DIR, part) for part in ("checks", "runner", "suite"))
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


@dataclass(frozen=True)
class Collective:
    """One collective as a rank's flight recorder saw it."""

    group: str  # the process group's name, as torch names it ("default_pg", or the group's description)
    seq: int  # its sequence number in that group
    op: str  # "all_reduce", "broadcast", "barrier"...
    shapes: list[list[int]]  # its input tensors' sizes
    done: bool  # retired: the rank went past it
    ddp: bool  # launched by a backward pass: DDP's gradient all-reduce
    harness: bool  # called by ddp-conformance itself, not by the trainer
    site: str  # the innermost caller outside torch and the libraries: "train.py:88 (evaluate)"

    def words(self, micro_batch: int | None = None) -> str:
        shapes = ", ".join("x".join(map(str, shape)) or "scalar" for shape in self.shapes)
        kind = "DDP's gradient all-reduce" if self.ddp else ("the suite's own " if self.harness else "") + self.op
        of = f" of micro-batch {micro_batch}" if micro_batch is not None else ""
        called = f"backward{of} at {self.site}" if self.ddp else self.site
        return f"{kind} #{self.seq} of group {self.group} ({shapes or 'no tensor'}{'; ' + called if called else ''})"

    def same_call(self, other: Collective) -> bool:
        """The same collective on two ranks: operation, shapes and whether DDP launched it (call sites may differ
        by rank in a correct program; a backward against an explicit call does not)."""
        return (self.op, self.shapes, self.ddp) == (other.op, other.shapes, other.ddp)


#: whether this torch's flight recorder dumps every backend's record, gloo's included (2.4's dumps NCCL's alone)
TORCH_RECORDS = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")


def recorded() -> bool:
    """Whether this process's flight recorder can be dumped."""
    return TORCH_RECORDS and os.environ.get("TORCH_FR_BUFFER_SIZE", "0") not in ("", "0")


def unrecorded() -> str:
    """Why no rank's collectives are known, in the verdict's words."""
    if not TORCH_RECORDS:
        return f"none recorded: torch {torch.__version__} keeps no flight record of gloo's collectives (a newer " \
               "torch names each rank's collective and where the ranks parted)"
    return "none recorded: TORCH_FR_BUFFER_SIZE is 0, which turns torch's flight recorder off"


def dump(path: Path) -> bool:
    """This rank's recent collectives into `path` (JSON, atomic); False where torch keeps no record."""
    if not recorded():
        return False
    try:
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    except Exception:  # a private API: a torch that changed it leaves the verdict as progress alone tells it
        return False
    entries = [asdict(entry) for entry in _collectives(trace.get("entries", []))]
    if not entries:  # no record at all: a torch whose recorder skips this backend, not a rank before any collective
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, path)
    return True


def _collectives(entries: list[dict[str, Any]]) -> list[Collective]:
    kept: dict[str, list[Collective]] = {}
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        group = entry.get("process_group") or ("", "")
        name = str(group[1] if len(group) > 1 and group[1] else group[0])
        frames = [(str(f.get("filename", "")), int(f.get("line", 0)), str(f.get("name", "")))
                  for f in entry.get("frames", [])]
        kept.setdefault(name, []).append(Collective(
            group=name, seq=int(entry.get("collective_seq_id", 0)),
            op=str(entry.get("profiling_name", "")).split(":")[-1],
            shapes=[list(size) for size in entry.get("input_sizes", [])], done=bool(entry.get("retired", True)),
            ddp=any(name_ == "_engine_run_backward" for _, _, name_ in frames),
            harness=_harness(frames), site=_site(frames)))
    return [c for group in kept.values() for c in group[-KEPT_PER_GROUP:]]


def _site(frames: list[tuple[str, int, str]]) -> str:
    """The innermost frame of the user's code (outside torch, ddp-conformance and the installed libraries),
    else the innermost outside torch."""
    outside_torch = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    users = [f for f in outside_torch if not f[0].startswith(_OWN_DIR) and not f[0].startswith(_LIBRARY_DIRS)]
    chosen = (users or outside_torch or [None])[0]
    return "" if chosen is None else f"{os.path.basename(chosen[0])}:{chosen[1]} ({chosen[2]})"


def _harness(frames: list[tuple[str, int, str]]) -> bool:
    outside_torch = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    return bool(outside_torch) and outside_torch[0][0].startswith(_HARNESS_DIRS)


def record_path(directory: Path, rank: int) -> Path:
    """Where a rank of a fit dumps its collectives, beside its progress file."""
    return directory / f"rank{rank}.collectives.json"


def read_all(directory: Path, world_size: int) -> list[list[Collective] | None]:
    """Every rank's dump in `directory`, None for a rank that wrote none."""
    found: list[list[Collective] | None] = []
    for rank in range(world_size):
        try:
            raw = json.loads(record_path(directory, rank).read_text())
            found.append([Collective(**entry) for entry in raw])
        except (OSError, ValueError, TypeError):
            found.append(None)
    return found


def waiting_in(collectives: list[Collective] | None) -> Collective | None:
    """The collective a rank has not gone past, the oldest of them (an async one may follow it)."""
    pending = [c for c in collectives or [] if not c.done]
    return pending[0] if pending else None


def stuck(dumps: list[list[Collective] | None], stopped: list[bool]) -> tuple[bool, bool]:
    """(blocked, parted) of a stalled fit, from every rank's record (`read_all`; empty where this rank has none):
    blocked, every rank waits in a collective; parted, every rank waits in one or has left its fit (`stopped`),
    some rank waits, and the records part. A rank in no collective that is still in its fit may be reading its
    data: neither."""
    if not dumps:
        return False, False
    waiting = [waiting_in(c) is not None for c in dumps]
    parted = any(waiting) and all(w or out for w, out in zip(waiting, stopped, strict=True)) \
        and bool(first_parting(dumps))
    return all(waiting), parted


def where(dumps: list[list[Collective] | None], micro_batches: list[int | None]) -> str:
    """Each rank's collective, in words: "rank 0 waits in all_reduce #41 of group default_pg (7; train.py:88
    (evaluate)); rank 1 waits in DDP's gradient all-reduce #41 ... (10; backward of micro-batch 7 at ...)";
    `micro_batches`: the micro-batch each rank began last (its progress)."""
    parts = []
    for rank, collectives in enumerate(dumps):
        if collectives is None:
            continue
        pending = waiting_in(collectives)
        micro = micro_batches[rank] if rank < len(micro_batches) else None
        parts.append(f"rank {rank} " + (f"waits in {pending.words(micro)}" if pending else "is in no collective"))
    return "; ".join(parts)


def first_parting(dumps: list[list[Collective] | None]) -> str:
    """The first collective where the ranks' sequences part, with both sides; "" where they do not (or where
    fewer than two ranks left a record)."""
    known = {rank: collectives for rank, collectives in enumerate(dumps) if collectives is not None}
    if len(known) < 2:
        return ""
    groups = sorted({c.group for collectives in known.values() for c in collectives})
    found = [parting for group in groups if (parting := _parting_in(group, known))]
    return min(found)[1] if found else ""


def _parting_in(group: str, known: dict[int, list[Collective]]) -> tuple[int, str] | None:
    by_rank = {rank: {c.seq: c for c in collectives if c.group == group} for rank, collectives in known.items()}
    if not any(by_rank.values()):
        return None
    start = max(min(seqs) if seqs else 0 for seqs in by_rank.values())  # below it some rank's buffer has rolled
    end = max(max(seqs) if seqs else 0 for seqs in by_rank.values())
    for seq in range(start, end + 1):
        at = {rank: seqs.get(seq) for rank, seqs in by_rank.items()}
        ran = {rank: c for rank, c in at.items() if c is not None}
        first = next(iter(ran.values()), None)
        if first is None:
            continue
        missing = [rank for rank, c in at.items() if c is None]
        if missing:
            rank, c = next(iter(ran.items()))
            others = "; ".join(f"rank {r} {_instead(known[r])}" for r in missing)
            return seq, f"rank {rank} ran {c.words()}, which rank {', '.join(map(str, missing))} never ran ({others})"
        odd = [rank for rank, c in ran.items() if not c.same_call(first)]
        if odd:
            base = next(rank for rank, c in ran.items() if c.same_call(first))
            sides = "; ".join(f"rank {rank} {ran[rank].words()}" for rank in [base, *odd])
            return seq, f"the ranks part at #{seq} of group {group}: {sides}"
    return None


def _instead(collectives: list[Collective]) -> str:
    pending = waiting_in(collectives)
    return f"waits in {pending.words()}" if pending else "is in no collective"
