"""The DDP guides' performance claims, measured side by side in one run instead of repeated.

    python benchmarks/claims.py [--megabytes 256] [--steps 8] [--repeats 1] [--batch 16] [--device cpu|cuda]

One MLP of about `--megabytes` MB of fp32 parameters (square layers of width 4096), trained with SGD
on random data by `DistributedDataParallel` in a fresh gloo group per setting (`torch.multiprocessing`
spawns the ranks; one intra-op thread per rank, as torchrun sets it). Each setting's ranks run two
warm-up steps, then `--steps` timed steps, each between barriers; a setting's step time is rank 0's
median. Its memory is the largest rank's: the heap in use right after each timed step's backward,
gradients and buckets both alive (glibc `mallinfo2`, as bucket_view_memory reads it; the CPU's
counterpart of `max_memory_allocated`), and the process's peak resident set (`ru_maxrss`, which also
holds torch's own ~0.4 GB). The settings, against the same baseline (world size 2, every option at
DDP's default, fp32):

| claim (the guides) | measured as |
| --- | --- |
| `gradient_as_bucket_view: true`: +10-20% speed, -20-30% memory | step time and peak memory, flag off and on |
| `static_graph: true`: +5-10% speed | step time, off and on |
| `bucket_cap_mb` 25 -> 50-100 for large models: +5-10% speed | step time at 25, 50 and 100 |
| `precision: bf16-mixed`: +50-100% speed | step time, fp32 and bf16 autocast |
| more GPUs, more throughput | samples per second at world size 1, 2 and 4 (batch 16 a rank) |

With `--device cuda` each rank has a GPU and the group is nccl; memory is the largest rank's
`torch.cuda.memory_allocated` right after the backward and `max_memory_allocated` over the steps, and
the base runs at world size 2 only where there are two GPUs (1 on a one-GPU machine, where the world
size row has the sizes the GPUs allow). A GPU wants a larger `--batch` to be busy.

With `--repeats R` the whole sequence runs R times, interleaved, and each setting's median is kept.
It prints the machine, then one row per claim: what the guides say and what this run measured. The
speed claims are about GPUs: on a CPU, compute and gloo's copies dominate, and the table says what
they came to here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_conformance.checks.support.memory import heap_counter

WIDTH = 4096
BATCH = 16  # samples per rank and step


@dataclass(frozen=True)
class Setting:
    world_size: int = 2
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    bucket_cap_mb: int = 25
    precision: str = "32-true"
    device: str = "cpu"
    batch: int = BATCH


def settings(device: str, batch: int) -> dict[str, Setting]:
    """Each claim's setting, against the base; on GPUs only the world sizes there are GPUs for."""
    gpus = torch.cuda.device_count() if device == "cuda" else 4
    base = Setting(world_size=min(2, gpus), device=device, batch=batch)
    return {"base": base,
            "bucket_view": replace(base, gradient_as_bucket_view=True),
            "static_graph": replace(base, static_graph=True),
            "bucket_50": replace(base, bucket_cap_mb=50),
            "bucket_100": replace(base, bucket_cap_mb=100),
            "bf16": replace(base, precision="bf16-mixed"),
            **{f"ws{n}": replace(base, world_size=n) for n in (1, 2, 4) if n <= gpus and n != base.world_size}}


def layers(megabytes: int) -> int:
    return max(1, round(megabytes * 2**20 / (WIDTH * WIDTH * 4)))


def gradient_bytes(megabytes: int) -> int:
    return layers(megabytes) * (WIDTH * WIDTH + WIDTH) * 4


def model(megabytes: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers(megabytes)):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def rank_main(rank: int, setting: Setting, megabytes: int, steps: int, folder: str) -> None:
    """One rank of one setting: its step times and peak resident set, written to `folder`."""
    torch.set_num_threads(1)
    cuda = setting.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(folder, "store"), setting.world_size)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=setting.world_size)
    torch.manual_seed(0)
    wrapped = DistributedDataParallel(model(megabytes).to(device), device_ids=[rank] if cuda else None,
                                      gradient_as_bucket_view=setting.gradient_as_bucket_view,
                                      static_graph=setting.static_graph, bucket_cap_mb=setting.bucket_cap_mb)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-4)
    x, y = torch.randn(setting.batch, WIDTH, device=device), torch.randn(setting.batch, WIDTH, device=device)
    heap = (lambda: torch.cuda.memory_allocated(device)) if cuda else heap_counter()
    times, held = [], []
    for step in range(2 + steps):
        if step == 2 and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        began = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setting.precision == "bf16-mixed"):
            loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        held.append(heap() if heap else 0)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - began)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"step_s": statistics.median(times), "peak": peak,
                                                            "heap": max(held[2:])}))
    dist.destroy_process_group()


def measure(setting: Setting, megabytes: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="claims-") as folder:
        mp.spawn(rank_main, args=(setting, megabytes, steps, folder), nprocs=setting.world_size, join=True)
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(setting.world_size)]
    return {"step_s": ranks[0]["step_s"], "peak": max(r["peak"] for r in ranks), "heap": max(r["heap"] for r in ranks)}


def pct(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.0f}%"


def speed(name: str, figures: dict[str, dict[str, float]]) -> str:
    """Throughput change against the base: + is faster."""
    return pct(figures["base"]["step_s"], figures[name]["step_s"])


def rows(figures: dict[str, dict[str, float]], megabytes: int, base_setting: Setting) -> list[list[str]]:
    base, on = figures["base"], figures["bucket_view"]
    mb = 2**20
    sizes = {base_setting.world_size: "base", **{int(k[2:]): k for k in figures if k.startswith("ws")}}
    throughput = ", ".join(f"ws {n}: {n * base_setting.batch / figures[sizes[n]]['step_s']:.1f}" for n in sorted(sizes))
    cuda = base_setting.device == "cuda"
    held, peak = ("allocated after the backward", "peak allocated") if cuda else ("heap at the step", "peak RSS")
    return [
        ["gradient_as_bucket_view: true", "+10-20% speed, -20-30% memory",
         f"speed {speed('bucket_view', figures)}; {held} {pct(on['heap'], base['heap'])} "
         f"({base['heap'] / mb:.0f} -> {on['heap'] / mb:.0f} MB a rank), {peak} {pct(on['peak'], base['peak'])} "
         f"({base['peak'] / mb:.0f} -> {on['peak'] / mb:.0f} MB); "
         f"{gradient_bytes(megabytes) / mb:.0f} MB of gradients"],
        ["static_graph: true", "+5-10% speed", f"speed {speed('static_graph', figures)}"],
        ["bucket_cap_mb 25 -> 50 / 100", "+5-10% speed for large models",
         f"speed {speed('bucket_50', figures)} / {speed('bucket_100', figures)}"],
        ["precision: bf16-mixed", "+50-100% speed",
         f"speed {speed('bf16', figures)} ({'CUDA' if cuda else 'CPU'} autocast)"],
        ["world size 1 -> 2 -> 4", "throughput grows with the GPUs", f"samples/s {throughput}"],
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per rank and step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here")
    chosen = settings(args.device, args.batch)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in chosen}
    for _ in range(args.repeats):
        for name, setting in chosen.items():
            runs[name].append(measure(setting, args.megabytes, args.steps))
            print(f"{name}: {runs[name][-1]} {asdict(setting)}", file=sys.stderr)
    figures = {name: {key: statistics.median(r[key] for r in results) for key in ("step_s", "peak", "heap")}
               for name, results in runs.items()}
    base_runs = ", ".join(str(round(r["step_s"] * 1000)) for r in runs["base"])
    base = chosen["base"]
    where = (f"nccl on {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if base.device == "cuda"
             else "gloo on CPU, one thread a rank")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}, torch "
          f"{torch.__version__}, {where}; base: world size {base.world_size}, batch {base.batch} a rank, fp32, "
          f"{figures['base']['step_s'] * 1000:.0f} ms a step (runs: {base_runs} ms, their spread is this "
          f"machine's noise); median of {args.repeats} run(s), {args.steps} steps each")
    table = [["claim", "the guides say", "measured here"], *rows(figures, args.megabytes, base)]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
