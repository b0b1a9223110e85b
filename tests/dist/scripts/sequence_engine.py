"""Ulysses sequence parallelism through the engine: ``sequence_parallel_size`` 2 on 4 gloo
ranks (2 data-parallel replicas of 2 sequence ranks each), ZeRO stages 0-3, against plain
torch on one process; reports ``RESULT <json>``.

The model is a one-layer causal transformer with grouped-query attention (4 query heads,
2 key/value heads) whose attention is ``DistributedAttention``, position embeddings from
the global ``position_ids``. Each rank's loader yields its own batches (right-padded,
labels -100 on the padding, different lengths of padding per sample) through
``UlyssesSPDataLoaderAdapter``, so step ``t`` of replica ``d`` trains on the batch of its
rank ``t % 2``; the loss is ``sequence_parallel_loss`` (the mean over the replica's valid
tokens). The reference steps torch's SGD on the mean over the 2 replicas of each
replica's mean loss over the whole sequence (SGD: linear in the gradient, where Adam would
blow rounding noise in zero gradients up to the learning rate). ``diffs``: per stage,
the largest weight difference after each step.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import deepshard
from deepshard.runtime.zero import GatheredParameters
from deepshard.sequence.layer import DistributedAttention
from deepshard.sequence.loader import UlyssesSPDataLoaderAdapter
from deepshard.sequence.loss import sequence_parallel_loss

VOCAB, DIM, HEADS, KV, HEAD_DIM, SEQ, MICRO, STEPS, LR = 32, 16, 4, 2, 4, 12, 2, 4, 0.5


def local_attention(q, k, v):
    k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         is_causal=True)
    return out.transpose(1, 2)


class Tiny(nn.Module):
    def __init__(self, sp_group=None):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.kv = nn.Linear(DIM, 2 * KV * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.attn = local_attention if sp_group is None else DistributedAttention(
            local_attention, sp_group)

    def forward(self, input_ids, position_ids):
        x = self.emb(input_ids) + self.pos(position_ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM)
        k, v = self.kv(x).view(b, s, 2, KV, HEAD_DIM).unbind(2)
        a = self.attn(q, k, v, 0) if self.attn is not local_attention else self.attn(q, k, v)
        return self.head(x + self.o(a.reshape(b, s, -1)))


def batches(rank: int) -> list[dict]:
    """Rank ``rank``'s loader: ``STEPS // 2`` batches, right-padded with labels -100."""
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(STEPS // 2):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        labels = ids.clone()
        for i in range(MICRO):
            pad = int(torch.randint(0, 6, (1,), generator=gen))
            if pad:
                labels[i, -pad:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference_loss(model, batch):
    logits = model(batch["input_ids"], torch.arange(SEQ).expand(MICRO, SEQ))
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def reference(world: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loaders = [batches(r) for r in range(world)]
    weights = []
    for step in range(STEPS):
        replica_batches = [loaders[2 * d + step % 2][step // 2] for d in range(world // 2)]
        loss = sum(reference_loss(model, b) for b in replica_batches) / len(replica_batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights


def train(stage: int, ref: list[list[torch.Tensor]]) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "sequence_parallel_size": 2,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    torch.manual_seed(0)
    probe = Tiny()  # the same initial weights as the reference's
    engine, _, _, _ = deepshard.initialize(model=probe, model_parameters=probe.parameters(),
                                           config=config)
    group = engine.get_sequence_parallel_group()
    engine.module.attn = DistributedAttention(local_attention, group)
    sp_rank = dist.get_rank(group)
    loader = UlyssesSPDataLoaderAdapter(batches(dist.get_rank()), sp_rank, group, 2, "cpu")
    diffs = []
    for step, batch in zip(range(STEPS), loader, strict=True):
        logits = engine(batch["input_ids"], batch["position_ids"])
        loss = sequence_parallel_loss(logits, batch["shift_labels"], group)
        engine.backward(loss)
        engine.step()
        with GatheredParameters(list(engine.module.parameters())):
            diffs.append(max((p.detach() - r).abs().max().item() for p, r in
                             zip(engine.module.parameters(), ref[step], strict=True)))
    samples = next(iter(engine.deepspeed_io(list(range(8)), batch_size=8))).tolist()
    out = {"diffs": diffs, "train_batch_size": engine.train_batch_size(),
           "dp_world_size": engine.dp_world_size, "len": len(loader), "samples": samples}
    engine.destroy()
    return out


def main():
    deepshard.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = reference(world)
    stages = {str(stage): train(stage, ref) for stage in range(4)}
    print("RESULT", json.dumps({"rank": rank, "stages": stages}), flush=True)


if __name__ == "__main__":
    main()
