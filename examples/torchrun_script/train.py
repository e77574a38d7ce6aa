"""A torchrun training script, as such scripts come: flags, a global config, a hand-written loop.

    torchrun --nproc_per_node=4 train.py --steps 100 --ckpt-dir ckpt --ckpt-every 50
    torchrun --nproc_per_node=4 train.py --steps 100 --resume ckpt/step50.pt

Nothing here knows about ddp-conformance: pytest.ini beside it names this script by its command line.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CONFIG = {"seed": 0, "batch_size": 4, "lr": 0.05, "size": 64, "dropout": 0.1}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ckpt-dir", default="ckpt")
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    return parser.parse_args()


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(CONFIG["seed"])
    x = torch.randn(CONFIG["size"], 8, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def model() -> nn.Module:
    torch.manual_seed(CONFIG["seed"])
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(CONFIG["dropout"]), nn.Linear(32, 2))


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def main() -> None:
    args = parse_args()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = DistributedDataParallel(model())
    optimizer = torch.optim.AdamW(net.parameters(), lr=CONFIG["lr"])
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=CONFIG["seed"])
    # its own generator: without one, every iter() draws a seed from the global RNG, at other points
    # in a resumed run than in an uninterrupted one
    generator = torch.Generator().manual_seed(CONFIG["seed"])
    loader = DataLoader(data, batch_size=CONFIG["batch_size"], sampler=sampler, generator=generator)
    step, start = 0, None
    if args.resume:
        start = torch.load(args.resume, weights_only=False)
        net.module.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
        step = start["step"]
        torch.set_rng_state(start["rng"][rank]["torch"])
        random.setstate(start["rng"][rank]["python"])
    while step < args.steps:
        epoch, done = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for position, (x, y) in enumerate(loader):
            if position < done:
                continue
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            step += 1
            if args.ckpt_every and step % args.ckpt_every == 0:
                save(Path(args.ckpt_dir) / f"step{step}.pt", net, optimizer, step)
            if step >= args.steps:
                break
    dist.destroy_process_group()


def save(path: Path, net: DistributedDataParallel, optimizer: torch.optim.Optimizer, step: int) -> None:
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": net.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "rng": states}
        torch.save(payload, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    dist.barrier()


if __name__ == "__main__":
    main()
