"""1-bit Adam through the engine (``deepshard.initialize`` with ``OneBitAdam`` in the
config) against the same optimizer class driven by hand, on N gloo ranks; reports
``RESULT <json>``.

Usage: ``onebit_engine.py <checkpoint dir> <mode>``:
- ``train``: 6 steps, freeze_step 2. The reference: plain torch autograd on this rank's
  half of the batch; the gradients all-reduced (averaged) by hand in the warm-up, left
  local in the compressed phase, then ``OneBitAdam.step()``. Reports the largest weight
  difference per step, the bytes of ``all_reduce`` per step (the dense reduction must stop
  once compression starts) and the optimizer's own bytes; saves checkpoints after steps 1
  (warm-up) and 4 (compressing) and checks that a fresh engine loading either continues
  exactly (across freeze_step from the first; error buffers restored from the second).
- ``zero1``: the same config at ZeRO stage 1 against a plain-torch simulation of its 1-bit
  exchange (:mod:`deepshard.runtime.zero.onebit`) over every rank's gradients, and the
  same exact continuation from a checkpoint (local momenta and errors restored);
- ``resume``: loads the ``train`` checkpoint at whatever world size this run has and trains 2 steps
  (another world size: the error buffers start from zero, with one log line).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import deepshard

GLOBAL, STEPS, FREEZE, LR, SAVE_AT = 8, 6, 2, 1e-2, 4
CONFIG = {"train_batch_size": GLOBAL, "steps_per_print": 1000, "gradient_clipping": 0.0,
          "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": FREEZE,
                                                         "weight_decay": 0.01}}}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of global batch ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)
    world, rank = dist.get_world_size(), dist.get_rank()
    part = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    return x[part], y[part]


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class AllReduceBytes:
    """Counts the bytes torch.distributed.all_reduce is given (the engine's dense
    gradient reduction, and the norm's scalar)."""

    def __init__(self):
        self.bytes, self._real = 0, dist.all_reduce
        dist.all_reduce = self

    def __call__(self, tensor, *args, **kwargs):
        self.bytes += tensor.numel() * tensor.element_size()
        return self._real(tensor, *args, **kwargs)


def engine_step(engine, step: int) -> None:
    x, y = batch(step)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()


def reference_step(model, opt, step: int) -> None:
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if not opt.communicates_next_step():  # the warm-up: data-parallel average
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    opt.step()


def train(ckpt: str) -> dict:
    from deepshard.runtime.optim.onebit.adam import OneBitAdam

    counter = AllReduceBytes()
    engine, *_ = deepshard.initialize(model=mlp(), config=CONFIG)
    ref = mlp()
    ref_opt = OneBitAdam(ref.parameters(), lr=LR, freeze_step=FREEZE, weight_decay=0.01)
    diffs, dense, own = [], [], []
    for step in range(STEPS):
        before = counter.bytes
        engine_step(engine, step)
        dense.append(counter.bytes - before)
        own.append(engine.optimizer.last_bytes_sent)
        reference_step(ref, ref_opt, step)
        diffs.append(float((flat(engine.module) - flat(ref)).abs().max()))
        if step + 1 in (1, SAVE_AT):  # in the warm-up, and once compressing
            engine.save_checkpoint(ckpt, tag=f"at{step + 1}")
    final = flat(engine.module)
    resumed = {}
    for at in (1, SAVE_AT):  # from the warm-up the run crosses freeze_step
        again, *_ = deepshard.initialize(model=mlp(), config=CONFIG)
        again.load_checkpoint(ckpt, tag=f"at{at}")
        for step in range(at, STEPS):
            engine_step(again, step)
        resumed[at] = float((flat(again.module) - final).abs().max())
    return {"diffs": diffs, "dense_bytes": dense, "optimizer_bytes": own,
            "numel": final.numel(), "resumed_diff": max(resumed.values())}


def zero1_reference(order: list[int]) -> list[torch.Tensor]:
    """ZeRO stage 1's 1-bit Adam (``deepshard.runtime.zero.onebit``) on every rank's
    gradients at once, in plain torch: the weights after each step, flattened in ``order``
    (the flat group's: the chunks each rank owns are its slices of that buffer)."""
    from deepshard.runtime.optim.onebit.compressed import compress_rows, decompress_rows

    model, world = mlp(), dist.get_world_size()
    params = [list(model.parameters())[i] for i in order]
    n = sum(p.numel() for p in params)
    shard = -(-n // world)
    m, v = torch.zeros(n), torch.zeros(n)
    local = errors = None
    out = []
    for step in range(STEPS):
        grads = torch.stack([rank_grad(model, params, step, r, world)
                             for r in range(world)])
        if step < FREEZE:  # Adam, no bias correction, on the average
            g = grads.mean(0)
            m.mul_(0.9).add_(g, alpha=1 - 0.9)  # the optimizer's very operations:
            v.mul_(0.999).addcmul_(g, g, value=1 - 0.999)  # a flipped sign bit shows
        else:
            if local is None:
                local, errors = m.repeat(world, 1), torch.zeros(world, n)
            local.mul_(0.9).add_(grads, alpha=1 - 0.9)
            rows = torch.zeros(world, world * shard)
            rows[:, :n] = local + errors
            sent = []
            for r in range(world):  # each rank compresses its chunks, one per owner
                x = torch.zeros(world, -(-shard // 8) * 8)
                x[:, :shard] = rows[r].view(world, shard)
                sent.append(decompress_rows(compress_rows(x)[0])[:, :shard])
                errors[r] = (x[:, :shard] - sent[-1]).reshape(-1)[:n]
            m = torch.stack(sent).mean(0).reshape(-1)[:n].clone()
        flat_p = torch.cat([p.detach().reshape(-1) for p in params])
        update = m / (v.sqrt() + 1e-8)
        update += 0.01 * flat_p
        flat_p.add_(update, alpha=-LR)
        torch.nn.utils.vector_to_parameters(flat_p, params)
        out.append(flat_p.clone())
    return out


def rank_grad(model, params, step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)
    part = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
    return torch.cat([p.grad.reshape(-1) for p in params])


def zero1(ckpt: str) -> dict:
    cfg = {**CONFIG, "zero_optimization": {"stage": 1}}
    engine, *_ = deepshard.initialize(model=mlp(), config=cfg)
    (group,) = engine.strategy.groups
    order = list(group.flat.params)
    ref, diffs = zero1_reference(order), []
    params = list(engine.module.parameters())
    for step in range(STEPS):
        engine_step(engine, step)
        got = torch.cat([params[i].detach().reshape(-1) for i in order])
        diffs.append(float((got - ref[step]).abs().max()))
        if step + 1 == SAVE_AT:
            engine.save_checkpoint(ckpt, tag="z1")
    again, *_ = deepshard.initialize(model=mlp(), config=cfg)
    again.load_checkpoint(ckpt, tag="z1")
    for step in range(SAVE_AT, STEPS):
        engine_step(again, step)
    return {"diffs": diffs, "resumed_diff": float((flat(again.module) - flat(engine.module))
                                                  .abs().max()),
            "held": engine.state_bytes()["optimizer"], "padded": group.spec.padded,
            "shard": group.spec.shard}


def resume(ckpt: str) -> dict:
    engine, *_ = deepshard.initialize(model=mlp(), config=CONFIG)
    engine.load_checkpoint(ckpt, tag="at4")
    for step in range(SAVE_AT, STEPS):
        engine_step(engine, step)
    return {"steps": engine.global_steps, "finite": bool(flat(engine.module).isfinite().all())}


if __name__ == "__main__":
    deepshard.init_distributed(verbose=False)
    where, mode = sys.argv[-2:]  # after the --local_rank=N ds-run passes first
    out = {"train": train, "zero1": zero1, "resume": resume}[mode](where)
    print("RESULT", json.dumps({"rank": dist.get_rank(), **out}), flush=True)
