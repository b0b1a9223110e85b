"""A tiny HF causal LM trained with Ulysses sequence parallelism (``sequence_parallel_size``
2) through ``deepshard.initialize`` and a hand loop, against the same training without
sequence parallelism on one process; reports ``RESULT <json>``.

Usage: ``hf_sequence_train.py <kind>:<zero stage> ...`` (kinds of ``tests/integrations/
tiny.py``; ``qwen2`` has one key/value head for 4 query heads here, fewer than the ranks).
Each rank's loader yields its own right-padded batches (``-100`` labels on the padding)
through ``UlyssesSPDataLoaderAdapter``; ``UlyssesSPAttentionHF.register_with_transformers``
wraps sdpa; the loss is ``sequence_parallel_loss`` of the shard's logits. With 4 ranks the
groups are 2 data-parallel replicas of 2. The reference: HF's own loss (``labels=``) of
each replica's whole batch, averaged over the replicas, stepped by torch's SGD. ``diffs``:
the largest weight difference after each step.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import transformers

import deepshard
from deepshard.runtime.zero import GatheredParameters
from deepshard.sequence.hf import UlyssesSPAttentionHF, unregister_from_transformers
from deepshard.sequence.loader import UlyssesSPDataLoaderAdapter
from deepshard.sequence.loss import sequence_parallel_loss
from tests.integrations.tiny import tiny_config

SEQ, MICRO, STEPS, LR, SP = 16, 2, 4, 0.5, 2


def build(kind: str):
    overrides = {"num_key_value_heads": 1} if kind == "qwen2" else {}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        tiny_config(kind, **overrides), attn_implementation="sdpa")


def batches(rank: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS // SP):
        ids = torch.randint(0, vocab, (MICRO, SEQ), generator=gen)
        labels = ids.clone()
        labels[0, -int(torch.randint(1, 9, (1,), generator=gen)):] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference(kind: str, world: int) -> list[dict[str, torch.Tensor]]:
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loaders = [batches(r, model.config.vocab_size) for r in range(world)]
    weights = []
    for step in range(STEPS):
        replicas = [loaders[SP * d + step % SP][step // SP] for d in range(world // SP)]
        loss = sum(model(**b).loss for b in replicas) / len(replicas)
        opt.zero_grad()
        loss.backward()
        opt.step()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return weights


def train(kind: str, stage: int, ref: list[dict[str, torch.Tensor]]) -> list[float]:
    model = build(kind)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, MICRO)
    config = {"train_micro_batch_size_per_gpu": MICRO, "sequence_parallel_size": SP,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                           config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(batches(dist.get_rank(), model.config.vocab_size),
                                        mpu.get_sequence_parallel_rank(), group, SP, "cpu")
    diffs = []
    for step, batch in zip(range(STEPS), loader, strict=True):
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        engine.backward(sequence_parallel_loss(out.logits, batch["shift_labels"], group))
        engine.step()
        named = dict(engine.module.named_parameters())
        with GatheredParameters(list(named.values())):
            diffs.append(max((p.detach() - ref[step][n]).abs().max().item()
                             for n, p in named.items()))
    engine.destroy()
    unregister_from_transformers("sdpa")
    return diffs


def main():
    deepshard.init_distributed()
    world = dist.get_world_size()
    results = {}
    for case in (a for a in sys.argv[1:] if ":" in a):  # not --local_rank
        kind, stage = case.split(":")
        results[case] = train(kind, int(stage), reference(kind, world))
    print("RESULT", json.dumps({"rank": dist.get_rank(), "diffs": results}), flush=True)


if __name__ == "__main__":
    main()
