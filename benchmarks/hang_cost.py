"""What a trainer that hangs costs the conformance suite, against the same trainer without the hang.

    python benchmarks/hang_cost.py [--world-size 2] [--timeout S]

Each pair is one trainer twice, healthy and with a hang, in the three shapes users bring; each run is a fresh
`python -m pytest --pyargs ddp_conformance.suite --ddp-trainer SPEC` with no other option (the default set of
checks, the default `--ddp-timeout`, so the default stall window), in a fresh directory (`suite_cost.run_suite`):
  class     the torch reference, and `fixtures/mutants/rank0_evaluates_at_epoch_end.py` (rank 0 alone gathers
            metrics at each epoch end);
  script    `fixtures/mutants/script_rank0_evaluates_at_epoch_end.py` with its validation run on every rank, and
            as it is (rank 0 alone validates, with a barrier);
  module    a LightningModule, and `fixtures/mutants/lightning_rank0_gathers_at_epoch_end.py` (the global zero alone
            gathers at each epoch end).
It prints one table: each run's wall time, its outcomes, the hanging run's against the healthy one's (the goal:
<= 2.0x), and the hang's one verdict. Exit status 0 when every run gave a report.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite_cost  # beside this file: its runs and machine line

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "fixtures" / "mutants"
GOAL = 2.0
SCRIPT, MODULE = "script_rank0_evaluates_at_epoch_end.py", "lightning_rank0_gathers_at_epoch_end.py"


def healthy_copy(mutant: str, hang: str, everywhere: str, workdir: Path) -> Path:
    """The hanging fixture with the code it runs on rank 0 alone (`hang`) run on every rank (`everywhere`): the same
    trainer, correct."""
    source = (MUTANTS / mutant).read_text()
    assert hang in source, f"{mutant} no longer holds {hang!r}"
    path = workdir / f"healthy_{mutant}"
    path.write_text(source.replace(hang, everywhere))
    return path


def pairs(workdir: Path) -> list[tuple[str, str, str]]:
    """(shape, healthy SPEC, hanging SPEC)."""
    return [
        ("class", "torch", f"{MUTANTS / 'rank0_evaluates_at_epoch_end.py'}:Trainer"),
        ("script", f"script:{healthy_copy(SCRIPT, 'if rank == 0:', 'if True:', workdir)} --steps {{steps}}",
         f"script:{MUTANTS / SCRIPT} --steps {{steps}}"),
        ("module", f"lightning:{healthy_copy(MODULE, 'if self.trainer.is_global_zero:', 'if True:', workdir)}"
                   ":GathersOnRankZero",
         f"lightning:{MUTANTS / 'lightning_rank0_gathers_at_epoch_end.py'}:GathersOnRankZero"),
    ]


def outcomes(row: suite_cost.Row) -> str:
    counted = collections.Counter(result["outcome"] for result in row.results)
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counted.items())) or "no report"


def verdict(row: suite_cost.Row) -> str:
    failed = [r for r in row.results if r["outcome"] == "failed"]
    return "; ".join(f"{r['check']}: {r['message'][:160]}" for r in failed) or "-"


def run(spec: str, world_size: int, timeout: float) -> suite_cost.Row:
    row = suite_cost.Row(spec, world_size, 0.0)
    with tempfile.TemporaryDirectory(prefix="hang-cost-") as tmp:
        suite_cost.run_suite(row, Path(tmp), timeout)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds for each run (default 1200)")
    args = parser.parse_args()
    if args.world_size < 2:
        parser.error(f"--world-size: a hang needs two ranks or more, got {args.world_size}")
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"| shape | healthy s | its outcomes | hanging s | its outcomes | hanging/healthy | goal <= {GOAL:.1f}x "
             "| the hang's verdict |", "|---|---|---|---|---|---|---|---|"]
    problems = []
    with tempfile.TemporaryDirectory(prefix="hang-cost-specs-") as tmp:
        for shape, healthy_spec, hanging_spec in pairs(Path(tmp)):
            print(f"hang_cost: {shape} ...", file=sys.stderr, flush=True)
            healthy, hanging = (run(spec, args.world_size, args.timeout) for spec in (healthy_spec, hanging_spec))
            problems += [f"{shape}: {p}" for row in (healthy, hanging) for p in row.problems]
            if healthy.suite is None or hanging.suite is None:
                continue
            ratio = hanging.suite.wall / healthy.suite.wall
            lines.append(f"| {shape} | {healthy.suite.wall:.1f} | {outcomes(healthy)} | {hanging.suite.wall:.1f} "
                         f"| {outcomes(hanging)} | {ratio:.2f}x | {'met' if ratio <= GOAL else 'MISSED'} "
                         f"| {verdict(hanging)} |")
    print(f"machine: {suite_cost.machine()}; world size {args.world_size}; began {began}\n")
    print("\n".join(lines))
    for problem in problems:
        print(f"\n{problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
