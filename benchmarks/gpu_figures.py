"""The figures a GPU runner measures: gradient and resume deltas per precision, and the saving of
`gradient_as_bucket_view` on a model of a few hundred MB, from `torch.cuda.max_memory_allocated`.

    python benchmarks/gpu_figures.py [--reports DIR ...] [--big-model-mb 256] [--world-size 1 ...]

It reads every conformance JSON report (`report.json`) under each DIR (default: none), for instance those
`tests/checks/test_cuda_suite.py` leaves under `pytest --basetemp=DIR`, and prints one row per
(world size, backend, precision, trainer): gradient_equivalence's max relative delta against its
tolerance, resume_fidelity's result (bitwise, or its largest parameter delta), and the seconds each
check took (`check_seconds`, rank 0: a warm check's time); then a row per trainer for each check of
`CHECKS_MEASURED`, whose CPU-measured tolerances a GPU run confirms or moves. Then it runs bucket_view_memory once per
`--world-size` (default 1; `--ddp-device cuda`) on both references with an MLP of about
`--big-model-mb` MB of parameters and prints the measured saving. The GPU is named in the first line.

Needs a CUDA GPU; exits 1 without one, or when a run gave no figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
INPUT_FEATURES = 32  # what the references' dataset feeds the first layer (small next to the hidden layers)


def gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_figures: no CUDA GPU (torch.cuda.is_available() is False)")
    _free, total = torch.cuda.mem_get_info()
    return f"{torch.cuda.get_device_name()} ({total / 2**30:.0f} GiB), torch {torch.__version__}"


REFERENCES = ("lightning", "torch")  # a fixture's verdicts are test_cuda_suite.py's to judge, not figures
#: checks whose tolerance or verdicts rest on CPU measurements until a GPU run gives their figures here
CHECKS_MEASURED = ("bucket_cap_mb_invariance", "static_graph", "initial_sync", "accumulation_equivalence",
                   "uneven_inputs")


def reports(folders: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for folder in folders for p in sorted(folder.rglob("report.json"))]


def precision_rows(docs: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for doc in docs:
        by = {(r["trainer"], r["check"]): r for r in doc["results"]}
        for trainer in sorted({t for t, _ in by} & set(REFERENCES)):
            grad, resume = by.get((trainer, "gradient_equivalence")), by.get((trainer, "resume_fidelity"))
            if grad is None or resume is None:
                continue
            g = grad["figures"]
            seconds = "/".join(f"{r['figures'].get('check_seconds', math.nan):.1f}" for r in (grad, resume))
            rows.append([str(doc["world_size"]), doc["backend"], str(g.get("precision", "?")), trainer,
                         f"{g.get('max_rel_delta', math.nan):.1e}", f"{g.get('rtol', math.nan):.0e}",
                         grad["outcome"], str(resume["figures"].get("summary", resume["outcome"])), seconds])
    return sorted(rows)


def check_rows(docs: list[dict[str, Any]]) -> list[list[str]]:
    """A row per (report, trainer, check) of `CHECKS_MEASURED`: its outcome, its largest relative delta where it
    measures one, and its summary or the head of its message."""
    rows = []
    for doc in docs:
        precision = {r["trainer"]: r["figures"].get("precision", "?") for r in doc["results"]
                     if r["check"] == "gradient_equivalence"}
        for r in doc["results"]:
            if r["check"] not in CHECKS_MEASURED or r["trainer"] not in REFERENCES:
                continue
            f = r["figures"]
            measured = f.get("max_rel_delta", f.get("fit_step_max_rel_delta"))
            delta = f"{measured:.1e}" if isinstance(measured, float) else "-"
            said = str(f.get("summary") or r["message"])[:90]
            rows.append([str(doc["world_size"]), doc["backend"], str(precision.get(r["trainer"], "?")), r["trainer"],
                         r["check"], r["outcome"], delta, said])
    return sorted(rows)


def big_model_config(folder: Path, megabytes: int) -> Path:
    """An MLP whose hidden layers are square: n layers of width w hold about n * w * w * 4 bytes."""
    width, layers = 4096, max(1, round(megabytes * 2**20 / (4096 * 4096 * 4)))
    config = yaml.safe_load((ROOT / "fixtures" / "configs" / "basic.yaml").read_text())
    config["model"]["hidden"] = [width] * (layers + 1)
    config["model"]["batchnorm"] = False
    path = folder / "big.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def bucket_rows(folder: Path, megabytes: int, world_sizes: list[int]) -> list[list[str]]:
    config, rows = big_model_config(folder, megabytes), []
    for world_size in world_sizes:
        report = folder / f"bucket-ws{world_size}.json"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                        "ddp_conformance.suite", "-k", "bucket_view_memory", "--ddp-trainer", "torch",
                        "--ddp-trainer", "lightning", f"--ddp-config={config}", "--ddp-device", "cuda",
                        "--ddp-world-size", str(world_size), f"--ddp-report={report}"], cwd=folder, check=False)
        if not report.exists():
            continue
        doc = json.loads(report.read_text())
        for result in doc["results"]:
            f = result["figures"]
            rows.append([str(world_size), doc["backend"], result["trainer"], str(f.get("memory_counter", "?")),
                         f"{f.get('grad_bytes', 0) / 2**20:.0f} MB", str(f.get("summary", result["outcome"])),
                         f"{f.get('check_seconds', math.nan):.1f} s"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in column) for column in zip(header, *rows, strict=False)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=False))]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=Path, action="append", default=[])
    parser.add_argument("--big-model-mb", type=int, default=256)
    parser.add_argument("--world-size", type=int, action="append", dest="world_sizes")
    args = parser.parse_args()
    print(f"GPU: {gpu_name()}; {os.cpu_count()} CPUs")
    docs = reports(args.reports)
    precision = precision_rows(docs)
    if precision:
        print(table(["ws", "backend", "precision", "trainer", "grad max rel delta", "rtol", "grad", "resume",
                     "check s grad/resume"], precision))
    if checks := check_rows(docs):
        print(table(["ws", "backend", "precision", "trainer", "check", "outcome", "max rel delta", "summary"],
                    checks))
    with tempfile.TemporaryDirectory(prefix="gpu-figures-") as folder:
        bucket = bucket_rows(Path(folder), args.big_model_mb, args.world_sizes or [1])
    if bucket:
        print(table(["ws", "backend", "trainer", "counter", "grads", "bucket_view_memory", "check time"], bucket))
    return 0 if bucket and (precision or not args.reports) else 1


if __name__ == "__main__":
    sys.exit(main())
