"""ALST's switches through the engine: a tiny HF Llama (gradient checkpointing on) trained
3 steps on each rank's batch with the ``sequence_parallel`` switches on and off, at ZeRO
stages 0 and 3; reports ``RESULT <json>`` with, per stage, the largest difference of the
losses and of the weights after training between the two runs.

Usage: ``alst_engine.py`` on 2 ranks.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import transformers

import deepshard

STEPS = 3
SWITCHES = {"tiled_mlp_compute": True, "tiled_mlp_shards": 3, "tiled_logits_loss": True,
            "tiled_logits_shards": 5, "activation_checkpoint_cpu_offload": True}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=40,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    net = transformers.LlamaForCausalLM(config)
    net.gradient_checkpointing_enable()
    return net


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 128, (2, 20), generator=g)
    labels = ids.clone()
    labels[:, : 3 + rank] = -100
    return ids, labels


def train(stage: int, switches: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "sequence_parallel": switches}
    engine, *_ = deepshard.initialize(model=model(), config=config)
    engine.train()
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step, dist.get_rank())
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepshard.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, weights


def main() -> None:
    deepshard.init_distributed()
    torch.set_num_threads(1)
    out = {}
    for stage in (0, 3):
        plain_losses, plain = train(stage, {})
        losses, tiled = train(stage, SWITCHES)
        out[stage] = {
            "loss": max(abs(a - b) for a, b in zip(losses, plain_losses, strict=True)),
            "weights": max((tiled[n] - w).abs().max().item() for n, w in plain.items()),
            "moved": plain_losses[0] != plain_losses[-1]}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "stages": out}), flush=True)


if __name__ == "__main__":
    main()
