"""What the conformance suite costs as the user's epoch grows, against one plain fit of the same trainer.

    python benchmarks/epoch_sweep.py [--batches 20 --batches 200 ...] [--world-size 2] [--timeout S]

The trainer is a LightningModule as a user writes one (a 16-to-1 linear model, MSE, SGD, a
`train_dataloader` over a TensorDataset at batch size 4), checked by its `lightning:` SPEC with no config
file. Its dataset holds `batches x world size x 4` samples, so that each rank's epoch is `batches`
batches (default 20, 200, 2,000 and 20,000). Each row runs, one after the other, in a fresh directory
(`suite_cost.measure`): the default suite (`python -m pytest --pyargs ddp_conformance.suite`) and one
plain `torchrun` fit of the module for the suite's longest fit (resume_fidelity's `final_step`, n).

It prints one table: the epoch's optimizer steps E and n (from the suite's report), the suite's and the
plain fit's wall time (start-up included), their ratio, the suite's wall against the first row's (the goal
for a long epoch: <= 1.5x the 20-batch epoch's), and the verdicts, which must not change with the epoch
(a note per check says what an epoch past the one trained whole leaves unjudged). Exit status 0 when
every run gave its figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite_cost  # beside this file: its runs, rows and machine line

DEFAULT_BATCHES = (20, 200, 2000, 20000)
BATCH_SIZE = 4
GOAL = 1.5  # the suite at a long epoch against the suite at the shortest epoch of the sweep

MODULE = textwrap.dedent('''\
    """A user's LightningModule: a 16-to-1 linear model on {samples} synthetic samples, batch size {batch}."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class SweepModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            x = torch.randn({samples}, 16, generator=generator)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size={batch}, shuffle=True)
    ''')


def module_spec(directory: Path, batches: int, world_size: int) -> str:
    """A module file whose epoch is `batches` batches a rank, and its SPEC."""
    path = directory / f"sweep_{batches}.py"
    path.write_text(MODULE.format(samples=batches * world_size * BATCH_SIZE, batch=BATCH_SIZE))
    return f"lightning:{path}:SweepModule"


def epoch_steps(row: suite_cost.Row) -> int | None:
    for result in row.results:
        if result["check"] == "resume_fidelity" and "epoch_steps" in result["figures"]:
            return int(result["figures"]["epoch_steps"])
    return None


def verdicts(row: suite_cost.Row) -> str:
    """The outcome of every check, with the ones that did not pass named."""
    counts: dict[str, list[str]] = {}
    for result in row.results:
        counts.setdefault(result["outcome"], []).append(result["check"])
    passed = len(counts.pop("passed", []))
    others = "; ".join(f"{outcome}: {', '.join(sorted(checks))}" for outcome, checks in sorted(counts.items()))
    return f"{passed} passed" + (f"; {others}" if others else "")


def table(rows: list[tuple[int, suite_cost.Row]]) -> list[str]:
    out = ["| batches/epoch | E | n | suite s | plain s | suite/plain | suite / first row | verdicts |",
           "|---|---|---|---|---|---|---|---|"]
    first = rows[0][1].suite.wall if rows and rows[0][1].suite else None
    for batches, row in rows:
        suite = row.suite.wall if row.suite else None
        plain = row.plain.wall if row.plain else None
        ratio = row.ratio
        growth = suite / first if suite is not None and first else None
        out.append(f"| {batches} | {epoch_steps(row) or '-'} | {row.steps or '-'} | {suite_cost._s(suite)} "
                   f"| {suite_cost._s(plain)} | {'-' if ratio is None else f'{ratio:.2f}x'} "
                   f"| {'-' if growth is None else f'{growth:.2f}x'} | {verdicts(row)} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", action="append", type=int, default=None,
                        help="batches a rank an epoch (repeatable; default 20, 200, 2000 and 20000)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for each run (default 3600)")
    args = parser.parse_args()
    sizes = args.batches or list(DEFAULT_BATCHES)
    if min(sizes) < 1 or args.world_size < 1:
        parser.error("--batches and --world-size: expected positive numbers")
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: list[tuple[int, suite_cost.Row]] = []
    with tempfile.TemporaryDirectory(prefix="epoch-sweep-") as tmp:
        for batches in sizes:
            print(f"epoch_sweep: {batches} batches an epoch at world size {args.world_size} ...", file=sys.stderr,
                  flush=True)
            spec = module_spec(Path(tmp), batches, args.world_size)
            rows.append((batches, suite_cost.measure(spec, args.world_size, args.timeout)))
    print(f"machine: {suite_cost.machine()}; began {began}; world size {args.world_size}; goal: suite at a long "
          f"epoch <= {GOAL:.1f}x the first row's\n")
    print("\n".join(table(rows)))
    for batches, row in rows:
        for problem in row.problems:
            print(f"\n{batches} batches an epoch: {problem}", file=sys.stderr)
    return 1 if any(row.problems for _, row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
