"""DeepSpeedExamples' AutoTP example, distilled: the script builds its own tensor- and
data-parallel groups, passes them as ``mpu=`` together with ``tensor_parallel.autotp_size``,
broadcasts each step's batch over its tensor-parallel group, and trains a tiny GPT with
``engine(input_ids, labels)`` / ``engine.backward`` / ``engine.step``. Reports ``RESULT
<json>`` with its losses and those of one plain-torch process on the whole global batch.

Usage: ``autotp_mpu.py <tp_size> [--strided]``; ``--strided`` builds tensor-parallel groups
of every other rank, which AutoTP's layout does not have (a one-line error).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from gpt import GPT, GPTConfig

import deepshard

TINY = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32)
STEPS, MICRO, LR = 3, 2, 1e-2


@dataclass
class ModelParallelUnit:
    """The example's minimal MPU."""

    tp_group: object
    dp_group: object
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_model_parallel_rank(self):
        return self.tp_rank


def groups(rank: int, world: int, tp: int, strided: bool):
    dp = world // tp
    if strided:  # tensor-parallel groups {0, 2}, {1, 3}
        tp_sets = [list(range(i, world, dp)) for i in range(dp)]
    else:
        tp_sets = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    dp_sets = [[s[i] for s in tp_sets] for i in range(tp)]
    made_tp = [dist.new_group(s) for s in tp_sets]
    made_dp = [dist.new_group(s) for s in dp_sets]
    ti = next(i for i, s in enumerate(tp_sets) if rank in s)
    di = next(i for i, s in enumerate(dp_sets) if rank in s)
    return ModelParallelUnit(made_tp[ti], made_dp[di], tp, dp, tp_sets[ti].index(rank), ti)


def batches(global_batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, TINY.vocab_size, (global_batch, TINY.seq_len + 1), generator=g)
            for _ in range(STEPS)]


def reference(global_batch: int) -> list[float]:
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens in batches(global_batch):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    tp, strided = int(args[0]), "--strided" in args
    deepshard.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    mpu = groups(rank, world, tp, strided)
    torch.manual_seed(0)
    model = GPT(TINY)
    config = {"train_batch_size": MICRO * mpu.dp_size, "train_micro_batch_size_per_gpu": MICRO,
              "tensor_parallel": {"autotp_size": tp}, "zero_optimization": {"stage": 1}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepshard.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    src = dist.get_process_group_ranks(mpu.tp_group)[0]
    losses = []
    for tokens in batches(MICRO * mpu.dp_size):
        mine = tokens[mpu.dp_rank * MICRO:(mpu.dp_rank + 1) * MICRO].clone()
        if mpu.tp_rank != 0:
            mine.zero_()  # the example's non-source ranks start from empty tensors
        dist.broadcast(mine, src=src, group=mpu.tp_group)
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mpu.dp_group)
        losses.append(mean.item() / mpu.dp_size)
    print("RESULT " + json.dumps({"rank": rank, "losses": losses,
                                  "reference": reference(MICRO * mpu.dp_size)}), flush=True)


if __name__ == "__main__":
    main()
