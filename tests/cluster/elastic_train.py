"""A deepshard job that checkpoints every step, for the elastic tests and benchmark.

    elastic_train.py WORKDIR --steps N [--delay S] [--crash-host NAME]

A linear model trained with Adam (ZeRO stage 1) on a fixed dataset by
``deepshard.initialize(training_data=...)``: train_batch_size 6 and micro batch 1, so
the accumulation steps follow the world size (3 ranks: 2, 2 ranks: 3). It resumes from
WORKDIR/ckpt when relaunched, prints ``STEP <n> world <w>`` after each step, and rank 0
prints the final parameters as ``FINAL <json>``. ``--crash-host`` makes the worker on
that host exit with code 3 at step 2 of every attempt.
"""

import argparse
import json
import os
import socket
import sys
import time

import torch

import deepshard

SAMPLES = 96


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1,
                                                                            generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


CONFIG = {
    "train_batch_size": 6, "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.05, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--crash-host", default="")
    return parser.parse_known_args()[0]


def main() -> None:
    args = parse_args()
    ckpt = os.path.join(args.workdir, "ckpt")
    config = {**CONFIG, "checkpoint": {"resume_dir": ckpt}}
    net = model()
    engine, _, loader, _ = deepshard.initialize(model=net, model_parameters=net.parameters(),
                                                training_data=data(), config=config)
    world = engine.world_size
    batches = iter(loader)
    while engine.global_steps < args.steps:
        if args.crash_host == socket.gethostname() and engine.global_steps == 2:
            sys.exit(3)
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        before = engine.global_steps
        engine.step()
        if engine.global_steps != before:
            engine.save_checkpoint(ckpt)
            if engine.global_rank == 0:
                print(f"STEP {engine.global_steps} world {world}", flush=True)
            time.sleep(args.delay)
    if engine.global_rank == 0:
        final = {k: v.tolist() for k, v in engine.module.state_dict().items()}
        print(f"FINAL {json.dumps(final)}", flush=True)


def reference(steps: int) -> dict:
    """One plain-torch process on the same global batches (the test's expectation)."""
    net, dataset = model(), data()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(steps):
        idx = order[step * 6:(step + 1) * 6]
        x, y = dataset[idx]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return {k: v.tolist() for k, v in net.state_dict().items()}


if __name__ == "__main__":
    main()
