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
- ``scaled``: ``engine.scale(loss).backward()`` (DeepSpeed's manual backward);
- ``raw``: ``loss.backward()`` on the raw ``engine.module``'s output;
- ``penalty`` (stages 0-2): ``loss.backward()`` on the loss plus a gradient penalty on
  the inputs (``torch.autograd.grad``, WGAN-GP style) and a penalty on the weights: terms
  that reach the parameters other than through the engine's outputs (the reference adds
  them too). Not at stage 3: its parameters are whole only inside forward, and the
  double backward of a gradient penalty reads weights released since.
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


def reference(style: str) -> list[float]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in batches():
        opt.zero_grad()
        if style == "penalty":  # the penalties of every rank's half, averaged
            halves = (slice(0, GLOBAL // 2), slice(GLOBAL // 2, GLOBAL))
            sum(penalized(model, model, x[h], y[h]) for h in halves).div(2).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model)


def penalized(call, module, x, y) -> torch.Tensor:
    """The mse loss, a gradient penalty on the inputs and a penalty on the weights."""
    x = x.clone().requires_grad_()
    out = call(x)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    weights = sum(p.square().sum() for p in module.parameters())
    return torch.nn.functional.mse_loss(out.float(), y) + 1e-1 * grad_x.square().mean() + \
        1e-2 * weights


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).tolist()


def config(stage: int, gas: int, world: int, precision: str) -> dict:
    cfg = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": gas,
           "train_micro_batch_size_per_gpu": GLOBAL // (gas * world),
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
           "gradient_clipping": 0,  # DeepSpeed's default (1.0) would clip the penalties
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
    elif style == "raw":
        torch.nn.functional.mse_loss(engine.module(x), y).backward()
    elif style == "penalty":
        penalized(engine, engine.module, x, y).backward()
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
    styles = ["engine", "torch", "grad", "twice", "twice_engine", "gas2", "scaled", "raw",
              *(["penalty"] if stage < 3 else [])]
    diffs = {style: float((torch.tensor(train(style, stage, precision))
                           - torch.tensor(reference(style))).abs().max())
             for style in styles}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **diffs}), flush=True)


if __name__ == "__main__":
    main()
