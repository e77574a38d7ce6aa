"""One plain DDP fit of a trainer SPEC, as a user runs it: the baseline `suite_cost.py` measures the
conformance suite against.

    torchrun --standalone --nproc_per_node W benchmarks/plain_fit.py SPEC --steps N [--workdir DIR]
        [--precision P] [--device {cpu,cuda}]

- A `lightning:` SPEC: the module (and datamodule, and a factory's Trainer arguments) it names, under
  a plain `lightning.pytorch.Trainer(strategy="ddp", max_steps=N)` on this machine's accelerator, which
  joins torchrun's group itself. Logger, progress bar, model summary, checkpointing and validation are
  off, as in the suite's fits, so both sides run the same training and nothing else. `--precision` and
  `--device` set what the suite's config and `--ddp-device` set; ranks that outnumber the GPUs share them
  under gloo, placed as the suite places them.
- Any other SPEC (the references `torch` and `lightning`, an adapter): resolved as the suite resolves
  it, set up with the built-in run config fitted to torchrun's group (`config.reconcile`, as the
  suite does), and its `fit(N)` called once: the adapter's own loop, no observer.

Rank 0 prints one JSON line, `{"fit_seconds": ...}`: the fit alone, from the built trainer's first
call to its return, so the caller can split the wall time into start-up (interpreter, imports,
rendezvous) and steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

LIGHTNING_PREFIX = "lightning:"
# the Trainer arguments this baseline sets; a factory's own value for any of them is replaced
SET_HERE = frozenset({"accelerator", "devices", "num_nodes", "max_steps", "max_epochs", "logger",
                      "enable_progress_bar", "enable_model_summary", "enable_checkpointing", "limit_val_batches",
                      "num_sanity_val_steps", "default_root_dir"})


def lightning_fit(spec: str, steps: int, workdir: Path, precision: str | None = None,
                  device: str | None = None) -> float:
    """The named module under Lightning's own Trainer with strategy ddp; the fit's seconds."""
    import lightning.pytorch as pl  # deferred: only a lightning: SPEC needs it
    import torch

    from ddp_conformance.trainers.spec import TrainerSpec

    built = TrainerSpec.parse(spec, Path.cwd()).resolve()().build()  # type: ignore[attr-defined]
    kwargs: dict[str, Any] = {k: v for k, v in built.trainer_kwargs.items() if k not in SET_HERE}
    if precision is not None:
        kwargs["precision"] = precision
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // local_world)
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    devices = local_world
    if 0 < gpus < local_world and "strategy" not in kwargs:
        # ranks sharing a GPU, placed as the suite places them (rank i on GPU i mod n, gloo: nccl refuses two
        # ranks on one GPU); `Trainer(devices=N)` cannot say so, a strategy's own devices can
        placed = [torch.device("cuda", i % gpus) for i in range(local_world)]
        kwargs["strategy"] = pl.strategies.DDPStrategy(parallel_devices=placed, process_group_backend="gloo")
        devices = len(set(placed))
    kwargs.setdefault("strategy", "ddp")
    trainer = pl.Trainer(accelerator="gpu" if gpus else "cpu", devices=devices,
                         num_nodes=nodes, max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=str(workdir), **kwargs)
    began = time.perf_counter()
    trainer.fit(built.module, datamodule=built.datamodule)
    return time.perf_counter() - began


def adapter_fit(spec: str, steps: int, workdir: Path) -> float:
    """The adapter's own `fit(steps)` in torchrun's group; the fit's seconds."""
    import torch.distributed as dist  # deferred: torch is heavy to import

    from ddp_conformance.adapter import RankContext
    from ddp_conformance.config import RunConfig, reconcile
    from ddp_conformance.trainers.spec import TrainerSpec

    dist.init_process_group("gloo")
    try:
        ctx = RankContext.current(workdir)
        config, _ = reconcile(RunConfig(), world_size=ctx.world_size, backend=ctx.backend,
                              device_type=ctx.device_type, num_nodes=ctx.num_nodes)
        adapter = TrainerSpec.parse(spec, Path.cwd()).resolve()()
        adapter.setup(config, ctx)
        began = time.perf_counter()
        adapter.fit(steps)
        seconds = time.perf_counter() - began
        dist.barrier()  # no rank tears the group down while another is still in the fit's last collective
        return seconds
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="trainer SPEC, as --ddp-trainer takes it")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps to train")
    parser.add_argument("--workdir", type=Path, default=Path.cwd(), help="where the trainer may write (shared)")
    parser.add_argument("--precision", default=None,
                        help="a lightning: SPEC's Trainer precision (bf16-mixed...), as the suite's config sets it")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="a lightning: SPEC's accelerator, as the suite's --ddp-device (default: the GPUs if any)")
    args = parser.parse_args()
    if not args.spec.strip().startswith(LIGHTNING_PREFIX):
        if args.precision is not None or args.device is not None:
            parser.error("--precision, --device: only a lightning: SPEC takes them (an adapter's are its config's)")
        seconds = adapter_fit(args.spec, args.steps, args.workdir)
    else:
        seconds = lightning_fit(args.spec, args.steps, args.workdir, args.precision, args.device)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"fit_seconds": round(seconds, 4)}), flush=True)


if __name__ == "__main__":
    main()
