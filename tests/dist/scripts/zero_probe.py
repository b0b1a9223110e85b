"""Drives a ZeRO engine on a tiny GPT and reports per-rank facts as ``RESULT <json>``.

Modes (argv[1]):
- ``train <config.json> <steps> [--init] [--odd]``: train (the model built inside
  ``deepshard.zero.Init`` with ``--init``; an odd-sized GPT with ``--odd``); report losses,
  state_bytes, the element counts of the flat groups, and the model's parameters whole
  (gathered with ``GatheredParameters``) as a checksum;
  ``--reentrant``: blocks recomputed by torch's reentrant checkpoint; ``--two-groups``:
  the MLP weights in a second optimizer param group (two flat groups per stage 3 unit);
  ``--skip``: rank 1 skips block 1 (its parameters get no gradient there);
  ``--recompute``: blocks recomputed by torch's non-reentrant checkpoint;
  ``--lora``: every block's qkv and fc become a frozen Linear plus a trainable low-rank
  update, and every other weight but the position embedding, the norms and the head is
  frozen (LoRA fine-tuning); ``--save=DIR`` / ``--load=DIR``: save a checkpoint after
  training / load one before; ``--exclude-frozen``: save without the frozen parameters;
  ``--loose``: load with ``load_module_strict=False``; ``--save16=DIR``:
  ``save_16bit_model(DIR, exclude_frozen_parameters=True)`` after training;
  ``--seed=N``: build the model from seed N (default 0); ``--watch``: report the order
  gradient groups are reduced in, the most staged at once and where gathered shards live;
- ``gathered <config.json> <dir>``: rank 1 writes a marker into a weight inside
  ``GatheredParameters(modifier_rank=1)``; report what every rank sees after the block, in
  the shard, and after a training step; then ``save_16bit_model(<dir>)``.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.checkpoint

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPT, GPTConfig, rank_indices, sample_batch, stdlib_corpus  # noqa: E402

import deepshard  # noqa: E402

TINY = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)
ODD = GPTConfig(vocab_size=251, seq_len=31, n_layer=3, n_head=3, d_model=39)


def _model(cfg: GPTConfig, under_init: bool, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    if not under_init:
        return GPT(cfg)
    if not dist.is_initialized():
        deepshard.init_distributed(verbose=False)
    with deepshard.zero.Init():
        model = GPT(cfg)
    # nothing is whole on any rank: every parameter is an empty tensor with a slice aside
    assert all(p.numel() == 0 and hasattr(p, "ds_shard") for p in model.parameters())
    return model


class LoRA(torch.nn.Module):
    """A frozen Linear plus a trainable rank-``r`` update ``x A^T B^T``."""

    def __init__(self, base: torch.nn.Linear, r: int):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(r, base.in_features) * 0.02)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, r) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _lora(model: GPT) -> None:
    for block in model.blocks:
        block.qkv, block.fc = LoRA(block.qkv, 8), LoRA(block.fc, 8)
    for name, p in model.named_parameters():
        p.requires_grad = name.endswith((".a", ".b")) or name.startswith(("pos_emb", "head")) \
            or ".ln" in name or name.startswith("ln_f")


def _checksum(engine, trainable: bool | None = None) -> float:
    """Sum of the model's parameters (only the trainable or the frozen ones if asked)."""
    params = [p for p in engine.module.parameters()
              if trainable is None or p.requires_grad == trainable]
    with deepshard.zero.GatheredParameters(params):
        return sum(float(p.detach().double().sum()) for p in params)


def train(config_path: str, steps: int, under_init: bool, odd: bool,
          flags: set[str]) -> None:
    cfg = ODD if odd else TINY
    options = dict(f[2:].split("=", 1) for f in flags if "=" in f)
    model = _model(cfg, under_init, int(options.get("seed", 0)))
    if "--lora" in flags:
        _lora(model)
    if "--reentrant" in flags or "--recompute" in flags:
        model.checkpoint = functools.partial(torch.utils.checkpoint.checkpoint,
                                             use_reentrant="--reentrant" in flags)
    params = [p for p in model.parameters() if p.requires_grad]
    if "--two-groups" in flags:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [{"params": [p for n, p in named if ".fc" not in n]},
                  {"params": [p for n, p in named if ".fc" in n], "weight_decay": 0.05}]
    if not dist.is_initialized():
        deepshard.init_distributed(verbose=False)
    if "--skip" in flags and dist.get_rank() == 1:
        model.blocks[1].forward = lambda x: x
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=params,
                                           config=config_path)
    if "load" in options:
        engine.load_checkpoint(options["load"], load_module_strict="--loose" not in flags)
    corpus = stdlib_corpus(1 << 20)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    rank, world = dist.get_rank(), engine.dp_world_size
    watch = _watch(engine) if "--watch" in flags else None
    losses = []
    for step in range(steps):
        for m in range(gas):
            x, y = sample_batch(corpus, rank_indices(step, m, rank, world, micro, gas), 0,
                                cfg.seq_len)
            loss = engine(x, y)
            if watch is not None:
                watch["launched"].clear()
                watch["lodged"] = _lodged(engine)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    if "save" in options:
        engine.save_checkpoint(options["save"],
                               exclude_frozen_parameters="--exclude-frozen" in flags)
    if "save16" in options:
        engine.save_16bit_model(options["save16"], exclude_frozen_parameters=True)
    zero = engine.strategy if engine.strategy.stage else None
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    print("RESULT " + json.dumps({
        "rank": rank, "world": world, "losses": losses, "checksum": _checksum(engine),
        "checksum_trainable": _checksum(engine, True),
        "checksum_frozen": _checksum(engine, False),
        "state_bytes": engine.state_bytes(),
        "numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                     for p in engine.module.parameters()),
        "groups": [[g.spec.numel, g.partitioned, g.dtype.itemsize] for g in zero.groups]
        if zero else [],
        "frozen_groups": [[g.spec.numel, g.partitioned, g.dtype.itemsize]
                          for g in zero.frozen_groups] if zero else [],
        "param_bytes_now": sum(p.numel() * p.element_size()
                               for p in engine.module.parameters()),
        "frozen": len(frozen), "frozen_whole": sum(p.numel() > 0 for p in frozen),
        "secondary_gathers": sum(g.secondary_gathers for g in zero.groups) if zero else 0,
        "quantized_gathers": sum(g.quantized_gathers for g in zero.groups) if zero else 0,
        "hpz_ranks": [list(g.hpz.ranks) for g in zero.groups if g.hpz][:1] if zero else [],
        "watch": watch}), flush=True)


def _watch(engine) -> dict:
    """Record, per backward, the order gradient groups are launched in (their parameter
    names) and the most reductions staged at once."""
    grads = engine.strategy.grads
    seen: dict = {"launched": [], "max_staged": 0, "lodged": None}
    launch = grads._launch

    def watched(gi: int) -> None:
        launch(gi)
        seen["launched"].append(list(grads.groups[gi].names))
        seen["max_staged"] = max(seen["max_staged"], len(grads._works))

    grads._launch = watched
    return seen


def _lodged(engine) -> list[int]:
    """Gathered partitioned groups, and how many of them hold their shard inside the
    gathered buffer (sharing its storage) rather than beside it."""
    gathered = [g for g in engine.strategy.groups if g.partitioned and g.full is not None]
    inside = [g for g in gathered if g.shard.untyped_storage().data_ptr()
              == g.full.untyped_storage().data_ptr()]
    return [len(gathered), len(inside)]


def gathered(config_path: str, directory: str) -> None:
    model = _model(TINY, False)
    engine, _, _, _ = deepshard.initialize(model=model, config=config_path)
    rank = dist.get_rank()
    weight = engine.module.blocks[0].fc.weight
    empty_before = weight.numel() == 0
    with deepshard.zero.GatheredParameters([weight], modifier_rank=1):
        whole_inside = list(weight.shape)
        if rank == 1:
            with torch.no_grad():
                weight.fill_(0.125)
    empty_after = weight.numel() == 0
    with deepshard.zero.GatheredParameters([weight]):
        seen = float(weight.detach().double().mean())
    x, y = sample_batch(stdlib_corpus(1 << 20), rank_indices(0, 0, rank, 2, 2, 1), 0, 32)
    engine.backward(engine(x, y))
    engine.step()
    with deepshard.zero.GatheredParameters([weight]):
        moved = float((weight.detach().double() - 0.125).abs().max())
    saved = engine.save_16bit_model(directory)
    print("RESULT " + json.dumps({
        "rank": rank, "empty_before": empty_before, "whole_inside": whole_inside,
        "empty_after": empty_after, "seen": seen, "moved": moved, "saved": saved}),
        flush=True)


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    flags = {a for a in argv if a.startswith("--")}
    argv = [a for a in argv if not a.startswith("--")]
    if argv[0] == "train":
        train(argv[1], int(argv[2]), "--init" in flags, "--odd" in flags, flags)
    elif argv[0] == "gathered":
        gathered(argv[1], argv[2])
    else:
        raise SystemExit(f"unknown mode {argv[0]}")
