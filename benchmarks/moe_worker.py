"""One rank of ``benchmarks/moe.py``: train the MoE GPT with deepshard or DeepSpeed.

Started by the parent with RANK/WORLD_SIZE/MASTER_* in the environment, by deepshard's
Python or DeepSpeed's (``--impl deepspeed`` imports only DeepSpeed). The model, the data
and the training loop are the same for both; only ``MoE``, the optimizer-group helper and
``initialize`` come from the implementation under test. Writes ``<out>/rank<N>.json``:
every step's wall time (barriers before and after), this rank's peak RSS, the bytes its
all-to-alls sent to other ranks in the timed steps (``torch.distributed.all_to_all_single``
is wrapped: both implementations call it), the routed token count and the losses.

Model: a GPT (vocabulary 512, width 256, 4 heads, 4 blocks, sequence 128) whose blocks 1
and 3 have an MoE feed-forward layer of 8 experts (top-2, each a 256 -> 1024 -> 256 GELU
MLP), the others a dense MLP of the same shape; micro-batch 4 per rank, AdamW at ZeRO
stage 2, loss = cross-entropy + 0.01 * the load-balancing losses.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, BLOCKS, SEQ = 512, 256, 4, 4, 128
EXPERTS, TOP_K, HIDDEN = 8, 2, 1024
MICRO_BATCH = 4
AUX = 0.01
CAPACITY_FACTOR, MIN_CAPACITY = 1.0, 4
"""Both MoE layers' defaults (named for the driver's theory of the exchanged bytes)."""


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))


class Block(nn.Module):
    def __init__(self, ffn: nn.Module, moe: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.ffn, self.moe = ffn, moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, WIDTH))
        if self.moe:
            out, l_aux, _ = self.ffn(self.ln2(x))
            return x + out, l_aux
        return x + self.ffn(self.ln2(x)), x.new_zeros(())


class GPT(nn.Module):
    def __init__(self, moe_class, ep_size: int, drop_tokens: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = nn.ModuleList(
            Block(moe_class(WIDTH, mlp(), num_experts=EXPERTS, ep_size=ep_size, k=TOP_K,
                            drop_tokens=drop_tokens), True) if i % 2 else Block(mlp(), False)
            for i in range(BLOCKS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + AUX * aux


class A2ACounter:
    """Wraps ``torch.distributed.all_to_all_single``: bytes sent to other ranks."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.inner = dist.all_to_all_single
        dist.all_to_all_single = self  # type: ignore[assignment]

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None,
                 group=None, async_op=False):
        size = dist.get_world_size(group)
        me = dist.get_rank(group)
        row = input[0].numel() * input.element_size() if input.dim() and len(input) else 0
        if input_split_sizes:
            sent = (sum(input_split_sizes) - input_split_sizes[me]) * row
        else:
            sent = input.numel() * input.element_size() * (size - 1) // size
        self.bytes += sent
        self.calls += 1
        return self.inner(output, input, output_split_sizes, input_split_sizes, group=group,
                          async_op=async_op)


def build(impl: str, ep_size: int, drop_tokens: bool):
    """(engine, the MoE layers) for this rank."""
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}}
    if impl == "deepspeed":
        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        # its CPU shared-memory op serves inference_all_reduce only, never training's
        # collectives; JIT-building it takes minutes under a lock shared by every job
        # (deepspeed.comm.torch is torch itself there: comm/__init__ re-exports it)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")
        initialize = deepspeed.initialize
    else:
        import deepshard
        from deepshard.moe.layer import MoE
        from deepshard.runtime.parallel.expert_groups import configure
        from deepshard.runtime.parallel.expert_params import (
            split_params_into_different_moe_groups_for_optimizer,
        )
        deepshard.init_distributed()
        initialize = deepshard.initialize
    torch.manual_seed(0)
    model = GPT(MoE, ep_size, drop_tokens)
    if impl == "deepshard":
        configure(model)  # idempotent: the engine finds the groups when it configures them
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "lr": 3e-4, "name": "all"})
    optimizer = torch.optim.AdamW(groups, lr=3e-4)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config)
    return engine, [b.ffn for b in model.blocks if b.moe]


def sent_rows(layers: list) -> int | None:
    """Token rows this rank's forward sent to other ranks (deepshard's layer counts them;
    DeepSpeed's always sends its whole padded ``[E, C, M]`` buffer): None for DeepSpeed."""
    counts = [getattr(layer.deepspeed_moe, "sent_rows", None) for layer in layers]
    return None if None in counts else sum(counts)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("deepshard", "deepspeed"), required=True)
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--dropless", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    counter = A2ACounter()
    engine, layers = build(args.impl, args.ep, not args.dropless)
    rank = dist.get_rank()
    steps = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            counter.bytes = counter.calls = 0
        x, y = batch(step, rank)
        dist.barrier()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        steps.append({"s": time.perf_counter() - start, "loss": loss.item(),
                      "routed": sum(int(layer.deepspeed_moe.exp_counts.sum()) for layer in layers),
                      "sent_rows": sent_rows(layers)})
    result = {"rank": rank, "impl": args.impl, "ep": args.ep, "steps": steps,
              "timed_from": args.warmup, "a2a_bytes": counter.bytes, "a2a_calls": counter.calls,
              "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "tokens_per_step": MICRO_BATCH * SEQ * dist.get_world_size(),
              "tokens_per_rank": MICRO_BATCH * SEQ, "width": WIDTH, "experts": EXPERTS,
              "k": TOP_K, "moe_layers": len(layers), "hidden": HIDDEN, "seq": SEQ,
              "micro_batch": MICRO_BATCH, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
