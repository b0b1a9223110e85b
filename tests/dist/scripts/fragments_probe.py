"""DeepSpeed's ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` on a tiny MLP at ZeRO stage ``argv[1]``, against one
plain-torch process on the whole batch; then the ``safe_set_full_*`` setters (and at stage 3
the ``safe_*_local_*`` ones) change the gradient, master and optimizer state before a second
step, done the same way to the plain-torch model: reports the largest difference as
``RESULT <json>``. DeepSpeed 0.19.8 sets all of them at ZeRO 1-2 (the module weight follows
at the next step there; here at once)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import deepshard
from deepshard.runtime.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def main() -> None:
    stage = int(next(a for a in sys.argv[1:] if not a.startswith("--")))
    adamw = {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.01}}
    config = {"train_batch_size": 4, "gradient_clipping": 0, "optimizer": adamw,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepshard.initialize(model=mlp(), config=config)
    ref = mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.01)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    rank = dist.get_rank()
    mine = slice(2 * rank, 2 * rank + 2)
    engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
    F.mse_loss(ref(x), y).backward()
    diffs = [(safe_get_full_grad(p) - q.grad).abs().max()
             for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True)]
    engine.step()
    opt.step()
    for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
        diffs.append((safe_get_full_fp32_param(p) - q).abs().max())
        state = safe_get_full_optimizer_state(p, "exp_avg_sq")
        diffs.append((state - opt.state[q]["exp_avg_sq"]).abs().max())
    # the setters: same values on every rank, and on the plain-torch side
    g = torch.Generator().manual_seed(1)
    engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
    opt.zero_grad()
    F.mse_loss(ref(x), y).backward()
    for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
        shape = q.shape
        w, grad, m = (torch.randn(shape, generator=g) for _ in range(3))
        with torch.no_grad():
            q.copy_(w)
        q.grad = grad
        opt.state[q]["exp_avg"] = m.clone()
        safe_set_full_optimizer_state(p, m, "exp_avg")
        if stage == 3:  # each rank sets its own part: the part of the full value it holds
            safe_set_local_fp32_param(p, _part(safe_get_local_fp32_param(p), w, p, rank))
            safe_set_local_grad(p, _part(safe_get_local_grad(p), grad, p, rank))
        else:
            safe_set_full_fp32_param(p, w)
            safe_set_full_grad(p, grad)
        diffs.append((safe_get_full_fp32_param(p) - w).abs().max())
        diffs.append((safe_get_full_grad(p) - grad).abs().max())
    engine.step()
    opt.step()
    for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
        diffs.append((safe_get_full_fp32_param(p) - q).abs().max())
        diffs.append((safe_get_full_optimizer_state(p, "exp_avg") -
                      opt.state[q]["exp_avg"]).abs().max())
    with deepshard.zero.GatheredParameters(list(engine.module.parameters())):
        diffs.extend((p.detach() - q).abs().max()
                     for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True))
    print("RESULT " + json.dumps({"rank": rank, "max_diff": float(max(diffs))}), flush=True)


def _part(local: torch.Tensor, full: torch.Tensor, p, rank: int) -> torch.Tensor:
    """The part of ``full`` rank ``rank`` holds of ``p`` (its local part has ``local``'s
    size): rank 0 holds a prefix of the flat group, rank 1 the rest."""
    flat, n = full.reshape(-1), local.numel()
    if n == 0:
        return local
    starts = [0, p.ds_numel - n] if rank else [0]
    return flat[starts[rank]:starts[rank] + n]


if __name__ == "__main__":
    main()
