"""DeepSpeed's ``safe_get_full_grad`` / ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` on a tiny MLP at ZeRO stage ``argv[1]``, against one
plain-torch process on the whole batch: reports the largest difference as
``RESULT <json>``."""

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
    print("RESULT " + json.dumps({"rank": rank, "max_diff": float(max(diffs))}), flush=True)


if __name__ == "__main__":
    main()
