"""What the conformance suite costs against its budget, measured on the real command.

    python benchmarks/suite_cost.py [--world-size 4] [--trainer torch --trainer lightning]

Runs `python -m pytest --pyargs ddp_conformance.suite` once (both references by default, world size
4, a fresh pytest process: cold rank pool included) and prints, per trainer and check:
  check s     wall time of the check on rank 0 (from its figures)
  trainer s   the part of it spent inside the trainer: building it, fit/resume, wrap, train_step
  steps       the training steps (micro-batches) the check observed
  ratio       check s / trainer s: what checking costs on top of running those steps (target <= 3x);
              "-" for sampler_disjointness, which trains nothing (it reads two epochs of the loaders,
              whose cost is shown as trainer s)
and the session's total wall time (target <= 60 s on the 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_TOTAL_S = 60.0
TARGET_RATIO = 3.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--trainer", action="append", default=None, help="SPEC (repeatable; default both references)")
    args = parser.parse_args()
    trainers = args.trainer or ["torch", "lightning"]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "ddp_conformance.suite",
                   "--ddp-world-size", str(args.world_size), "--ddp-report", str(report)]
        for spec in trainers:
            command += ["--ddp-trainer", spec]
        began = time.perf_counter()
        proc = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
        total = time.perf_counter() - began
        if not report.is_file():
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            return 1
        doc = json.loads(report.read_text())

    print(f"suite on {', '.join(trainers)} at world size {doc['world_size']} ({doc['backend']}), one pytest process")
    header = f"{'trainer':<12} {'check':<22} {'outcome':<8} {'check s':>8} {'trainer s':>9} {'steps':>6} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    summed = 0.0
    for r in doc["results"]:
        f = r["figures"]
        check_s, trainer_s = float(f.get("check_seconds", 0.0)), float(f.get("trainer_seconds", 0.0))
        steps = int(f.get("observed_steps", 0))
        summed += check_s
        if steps and trainer_s > 0:
            ratio = check_s / trainer_s
            worst = max(worst, ratio)
            shown = f"{ratio:>5.2f}x"
        else:
            shown = f"{'-':>6}"
        name = r["trainer"].rpartition("/")[2]
        print(f"{name:<12} {r['check']:<22} {r['outcome']:<8} {check_s:>8.2f} {trainer_s:>9.2f} {steps:>6} {shown}")
    print("-" * len(header))
    print(f"checks (rank 0, summed): {summed:.1f} s; pytest session wall time: {total:.1f} s "
          f"(target <= {TARGET_TOTAL_S:.0f} s: {'met' if total <= TARGET_TOTAL_S else 'MISSED'}); "
          f"worst ratio {worst:.2f}x (target <= {TARGET_RATIO:.0f}x: {'met' if worst <= TARGET_RATIO else 'MISSED'})")
    return 0 if proc.returncode == 0 else proc.returncode


if __name__ == "__main__":
    sys.exit(main())
