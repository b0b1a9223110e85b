"""A small data-parallel training job: the README demo and the launcher's end-to-end test.

Each rank trains the same MLP on its own shard of a synthetic regression problem; gradients
are averaged by torch's DistributedDataParallel over the process group that
``deepshard.init_distributed()`` set up (gloo on CPU, nccl on GPUs). Rank 0 prints the
global mean loss of every step, so the curve is the same at any world size.

    ds-run --num_gpus 2 examples/train.py --steps 30
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import deepshard


def make_data(samples: int, features: int, seed: int = 0) -> TensorDataset:
    """y = sin(2 x·w) + noise: learnable, but not by a linear model."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    w = torch.randn(features, 1, generator=gen) / features**0.5
    y = torch.sin(2 * x @ w) + 0.05 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


def batches(loader: DataLoader, sampler: DistributedSampler, steps: int):
    """``steps`` batches, going over the data set as many epochs as that takes."""
    step, epoch = 0, 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == steps:
                return
            step += 1
            yield batch
        epoch += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch size")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    env = deepshard.init_distributed()
    torch.manual_seed(0)  # same initial weights on every rank
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else None
    model = nn.Sequential(nn.Linear(args.features, 128), nn.GELU(), nn.Linear(128, 1))
    model = DistributedDataParallel(model.to(device), device_ids=None if device is None
                                    else [device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    if args.batch_size % env.world_size:
        raise SystemExit(f"--batch_size {args.batch_size} is not divisible by the world size "
                         f"{env.world_size}")
    data = make_data(args.batch_size * 8, args.features)
    sampler = DistributedSampler(data, num_replicas=env.world_size, rank=env.rank,
                                 shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size // env.world_size, sampler=sampler)

    for step, (x, y) in enumerate(batches(loader, sampler, args.steps), start=1):
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if env.rank == 0:
            print(f"step {step:3d}  loss {mean.item() / env.world_size:.4f}", flush=True)
    if env.rank == 0:
        print(f"trained {args.steps} steps on {env.world_size} rank(s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
