"""Trains a tiny MLP with each way of running backward and reports, as ``RESULT <json>``,
the largest difference of its final weights from a single-process plain-torch reference.

Usage: ``backward_styles.py <stage> [<precision>]``, started by ds-run on N ranks.

Styles (each a fresh engine from the same seed, 3 optimizer steps of a global batch of 8):
- ``engine``: ``engine.backward(loss)``, gradient_accumulation_steps 1;
- ``torch``: ``loss.backward()``;
- ``grad``: ``out.backward(dloss/dout)`` with the non-scalar gradient of the loss;
- ``twice``: two ``loss.backward()`` of half the micro-batch each (losses halved) before
  one ``step()``, at one boundary;
- ``twice_engine``: the same with ``engine.backward``;
- ``gas2``: gradient_accumulation_steps 2, ``loss.backward()`` per micro-batch;
- ``scaled``: ``engine.scale(loss).backward()`` (DeepSpeed's manual backward).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import deepshard

GLOBAL, STEPS, LR = 8, 3, 0.1


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g))
            for _ in range(STEPS)]


def reference() -> list[float]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model)


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).tolist()


def config(stage: int, gas: int, world: int, precision: str) -> dict:
    cfg = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": gas,
           "train_micro_batch_size_per_gpu": GLOBAL // (gas * world),
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(style: str, stage: int, precision: str) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = 2 if style == "gas2" else 1
    engine, *_ = deepshard.initialize(model=mlp(), config=config(stage, gas, world,
                                                                 precision))
    micro = GLOBAL // (gas * world)
    for x, y in batches():
        for a in range(gas):
            lo = (rank * gas + a) * micro
            xs, ys = x[lo:lo + micro], y[lo:lo + micro]
            run_style(engine, style, xs, ys)
            engine.step()
    with deepshard.zero.GatheredParameters(list(engine.module.parameters())):
        weights = flat(engine.module)
    engine.destroy()
    return weights


def loss_of(engine, x, y) -> torch.Tensor:
    out = engine(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def run_style(engine, style: str, x, y) -> None:
    if style == "engine":
        engine.backward(loss_of(engine, x, y))
    elif style in ("torch", "gas2"):
        loss_of(engine, x, y).backward()
    elif style == "scaled":
        engine.scale(loss_of(engine, x, y)).backward()
    elif style == "grad":
        out = engine(x)
        probe = out.detach().float().requires_grad_()
        torch.nn.functional.mse_loss(probe, y).backward()
        out.backward(probe.grad.to(out.dtype))
    elif style in ("twice", "twice_engine"):
        half = x.shape[0] // 2
        for xs, ys in ((x[:half], y[:half]), (x[half:], y[half:])):
            loss = loss_of(engine, xs, ys) / 2
            engine.backward(loss) if style == "twice_engine" else loss.backward()
    else:
        raise SystemExit(f"unknown style {style}")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    stage = int(args[0])
    precision = args[1] if len(args) > 1 else "fp32"
    deepshard.init_distributed(verbose=False)
    styles = ["engine", "torch", "grad", "twice", "twice_engine", "gas2", "scaled"]
    ref = torch.tensor(reference())
    diffs = {style: float((torch.tensor(train(style, stage, precision)) - ref).abs().max())
             for style in styles}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **diffs}), flush=True)


if __name__ == "__main__":
    main()
