"""What the conformance suite costs as the user's epoch grows, against one plain fit of the same trainer.

    python benchmarks/epoch_sweep.py [--batches 20 --batches 200 ...] [--world-size 2] [--timeout S]
        [--model gpt [--gpt-layers 12 --gpt-width 768]] [--batch-size B] [--precision bf16-mixed]
        [--device cuda]

The trainer is a LightningModule as a user writes one, checked by its `lightning:` SPEC:
- `--model linear` (default): a 16-to-1 linear model, MSE, SGD, a `train_dataloader` over a TensorDataset
  at batch size 4, with no config file;
- `--model gpt`: a GPT (pre-norm causal transformer blocks, tied embeddings, AdamW, no dropout) on
  synthetic tokens, each sample drawn from its own seed (nothing held in memory), at sequence length 256
  and batch size 4; its defaults, 12 layers of width 768 over a 16,384-token vocabulary, are a model of
  about 100M parameters, for a GPU, where the step and not Python dominates. A few layers of width 64
  run it on a CPU.
`--precision` (bf16-mixed, 16-mixed) reaches the suite through a config file (`trainer: {precision: ...}`)
and the plain fit as its Trainer's; `--device cuda` is the suite's `--ddp-device cuda` (ranks share the
GPUs under gloo where they outnumber them) and the plain fit's accelerator, placed alike.

Its dataset holds `batches x world size x batch size` samples, so that each rank's epoch is `batches`
batches (default 20, 200, 2,000 and 20,000). Each row runs, one after the other, in a fresh directory
(`suite_cost.measure`): the default suite (`python -m pytest --pyargs ddp_conformance.suite`) and one
plain `torchrun` fit of the module for the suite's longest fit (resume_fidelity's `final_step`, n).

It prints a table: the epoch's optimizer steps E and n (from the suite's report), the suite's and the
plain fit's wall time (start-up included), their ratio, the suite's wall against the first row's (the goal
for a long epoch: <= 1.5x the 20-batch epoch's), and the verdicts, which must not change with the epoch
(a note per check says what an epoch past the one trained whole leaves unjudged); then where each row's suite
spent its time, check by check (`suite_cost.checks_table`). The first line names the machine, and the GPU
where `--device cuda`. Exit status 0 when every run gave its figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

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


GPT_MODULE = textwrap.dedent('''\
    """A user's GPT LightningModule: {layers} blocks of width {width} ({parameters:,} parameters), next-token
    cross-entropy on {samples} synthetic samples of {seq} tokens, batch size {batch}."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    VOCAB, SEQ, WIDTH, LAYERS = {vocab}, {seq}, {width}, {layers}


    class Tokens(Dataset):
        """Each sample drawn from its own seed: a long epoch holds nothing in memory."""

        def __len__(self):
            return {samples}

        def __getitem__(self, index):
            tokens = torch.randint(VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(index))
            return tokens[:-1], tokens[1:]


    class SweepGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            nn.init.normal_(self.embed.weight, std=0.02)  # as GPTs do: tied to the head, N(0, 1) logits would be huge
            self.position = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
            block = nn.TransformerEncoderLayer(WIDTH, max(1, WIDTH // 64), 4 * WIDTH, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(block, LAYERS, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

        def forward(self, tokens):
            hidden = self.blocks(self.embed(tokens) + self.position, mask=self.causal, is_causal=True)
            return self.head(self.norm(hidden))

        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

        def train_dataloader(self):
            return DataLoader(Tokens(), batch_size={batch}, shuffle=True)
    ''')
GPT_VOCAB, GPT_SEQ = 16384, 256


def gpt_parameters(layers: int, width: int) -> int:
    """SweepGPT's parameter count: per block attention (4 w^2 + 4 w), MLP (8 w^2 + 5 w) and two norms (4 w);
    the tied embedding, the positions and the last norm."""
    return layers * (12 * width * width + 13 * width) + GPT_VOCAB * width + GPT_SEQ * width + 2 * width


def module_spec(directory: Path, batches: int, args: argparse.Namespace) -> str:
    """A module file whose epoch is `batches` batches a rank, and its SPEC."""
    samples = batches * args.world_size * args.batch_size
    path = directory / f"sweep_{batches}.py"
    if args.model == "gpt":
        path.write_text(GPT_MODULE.format(
            layers=args.gpt_layers, width=args.gpt_width, parameters=gpt_parameters(args.gpt_layers, args.gpt_width),
            samples=samples, seq=GPT_SEQ, vocab=GPT_VOCAB, batch=args.batch_size))
        return f"lightning:{path}:SweepGPT"
    path.write_text(MODULE.format(samples=samples, batch=args.batch_size))
    return f"lightning:{path}:SweepModule"


def settings(directory: Path, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The suite's options and the plain fit's for the same precision and device."""
    suite: list[str] = []
    plain: list[str] = []
    if args.precision is not None:
        config = directory / "precision.yaml"
        config.write_text(yaml.safe_dump({"trainer": {"precision": args.precision}}))
        suite.append(f"--ddp-config={config}")
        plain += ["--precision", args.precision]
    if args.device is not None:
        suite += ["--ddp-device", args.device]
        plain += ["--device", args.device]
    return suite, plain


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
    parser.add_argument("--model", choices=("linear", "gpt"), default="linear", help="the module (default linear)")
    parser.add_argument("--gpt-layers", type=int, default=12, help="the GPT's blocks (default 12)")
    parser.add_argument("--gpt-width", type=int, default=768, help="the GPT's width (default 768)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"samples a batch (default {BATCH_SIZE})")
    parser.add_argument("--precision", default=None, help="the Trainer's precision (default the module's: 32-true)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the ranks train, in both runs (default: the suite's and Lightning's defaults)")
    args = parser.parse_args()
    sizes = args.batches or list(DEFAULT_BATCHES)
    if min([*sizes, args.world_size, args.batch_size, args.gpt_layers, args.gpt_width]) < 1:
        parser.error("--batches, --world-size, --batch-size, --gpt-layers, --gpt-width: expected positive numbers")
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: list[tuple[int, suite_cost.Row]] = []
    with tempfile.TemporaryDirectory(prefix="epoch-sweep-") as tmp:
        suite_options, plain_options = settings(Path(tmp), args)
        for batches in sizes:
            print(f"epoch_sweep: {batches} batches an epoch at world size {args.world_size} ...", file=sys.stderr,
                  flush=True)
            spec = module_spec(Path(tmp), batches, args)
            row = suite_cost.measure(spec, args.world_size, args.timeout, suite_options, plain_options)
            row.label = f"{batches} batches"
            rows.append((batches, row))
    print(f"machine: {machine(args.device)}; began {began}; {trainer_line(args)}; goal: suite at a long epoch "
          f"<= {GOAL:.1f}x the first row's\n")
    print("\n".join(table(rows)), end="\n\n")
    print("\n".join(suite_cost.checks_table([row for _, row in rows])))
    for batches, row in rows:
        for problem in row.problems:
            print(f"\n{batches} batches an epoch: {problem}", file=sys.stderr)
    return 1 if any(row.problems for _, row in rows) else 0


def machine(device: str | None) -> str:
    """suite_cost's machine line, and the GPU that trained where `--device cuda`."""
    line = suite_cost.machine()
    if device == "cuda":
        import torch

        line += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if torch.cuda.is_available() \
            else ", no CUDA GPU (torch.cuda.is_available() is False)"
    return line


def trainer_line(args: argparse.Namespace) -> str:
    model = (f"a GPT of {gpt_parameters(args.gpt_layers, args.gpt_width) / 1e6:.1f}M parameters ({args.gpt_layers} "
             f"x {args.gpt_width}, sequence {GPT_SEQ})" if args.model == "gpt" else "a 16-to-1 linear model")
    return (f"{model}, batch size {args.batch_size}, precision {args.precision or '32-true'}, device "
            f"{args.device or 'default'}, world size {args.world_size}")


if __name__ == "__main__":
    sys.exit(main())
