"""One rank of ``benchmarks/long_seq.py``: runs under deepshard's interpreter or DeepSpeed's.

It trains the tiny-width, many-token Llama of ``long_seq.py`` (built from a
``LlamaConfig``, seeded, no downloads) with Ulysses sequence parallelism over all ranks
(``WORLD_SIZE`` is the SP size; 1: no SP) at each of ``--lengths`` in turn, and prints one
``BENCH_RESULT {json}`` line per length. It imports torch, transformers and the library it
measures, never the other one. ``long_seq.py`` starts the ranks with
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (no launcher) and watches their RSS.

Jobs (``--jobs``, comma-separated, in order): ``search:u:START`` (the longest untiled length
within ``--budget-mib``: doubling from START, then ``--bisections`` bisection steps),
``search:t:u`` (the same tiled, from the untiled result up to ``--tiled-cap`` times it),
``time:{u,t}:LENGTH`` or ``time:{u,t}:found`` (``--steps`` timed steps at a length or at the
search's result). Without ``--budget-mib`` a search first sets the budget: rank 0's RSS
after a warm step plus ``--headroom-mib``.

Per length: a fresh model and engine (ZeRO stage 0, AdamW), one warm step at a short
length (so that gradients and the optimizer state exist), then the heap is trimmed
(``malloc_trim``) and the kernel's peak-RSS counter reset (``/proc/self/clear_refs``),
then the steps at the length. The line gives this rank's RSS before them, its peak RSS
during them (``VmHWM``, the counter ``ru_maxrss`` reads), the group's highest peak and the
step times (a barrier before and after each step). A search step whose forward already
passed the budget skips its backward.

deepshard: ``UlyssesSPAttentionHF.register_with_transformers``, ``deepshard.initialize``
with ``sequence_parallel_size`` and, tiled, the ``sequence_parallel`` section
(``tiled_mlp_compute``, ``tiled_logits_loss`` with ``tiled_logits_shards``); the untiled
loss is ``sequence_parallel_loss`` of the logits, the tiled one the model's own (``loss`` of
``model(..., shift_labels=...)``, this rank's mean). DeepSpeed 0.19.8
(``DS_ACCELERATOR=cpu``): ``deepspeed.runtime.sequence_parallel.ulysses_sp``'s
``UlyssesSPAttentionHF``, ``deepspeed.initialize(mpu=...)`` (torch's AdamW, as deepshard's)
and, tiled, its ``TiledMLP`` on every MLP (tiles of ``hidden`` tokens, its docstring's rule,
which deepshard's default shares) and ``TiledFusedLogitsLoss`` over ``lm_head`` with the
same logits tiles (this rank's mean); the untiled loss is ALST's (the token-loss sum
all-gathered over the group, divided by the group's tokens).

    python long_seq_worker.py {deepshard,deepspeed} --jobs search:u:128,search:t:u,...
                              [--steps 2] [--budget-mib 0] [--headroom-mib 96]
                              [--logits-tile 64] [--tiled-cap 4] [--bisections 1]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

RESULT_TAG = "BENCH_RESULT "
SEED = 0
WARM_TOKENS = 64
"""The warm step's sequence length per rank."""
MODEL = {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 1 << 20, "tie_word_embeddings": False}
"""Tiny width, many tokens: 4.2M parameters, 4.1M of them in the embedding and the head, so
that at long sequences the [tokens, 32000] logits dominate memory."""
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}


def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]


def rss_mib() -> float:
    """This process's resident memory now."""
    return _status_mib("VmRSS")


def peak_mib() -> float:
    """This process's peak resident memory since the last :func:`reset_peak`."""
    return _status_mib("VmHWM")


def reset_peak() -> None:
    """Return freed heap to the system and restart the peak-RSS counter from now."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def llama():
    """The benchmark's model, seeded, sdpa attention."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**MODEL)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def shard(length: int, step: int, rank: int, world: int) -> dict:
    """This rank's shard of step ``step``'s batch (one sequence of ``length`` seeded random
    tokens, the same on every rank): input ids, global position ids, the next token's
    label (``-100`` after the last), cut into ``world`` contiguous pieces."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, MODEL["vocab_size"], (1, length), generator=gen)
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    positions = torch.arange(length).unsqueeze(0)
    chunk = length // world
    part = slice(rank * chunk, (rank + 1) * chunk)
    return {"input_ids": ids[:, part].contiguous(), "position_ids": positions[:, part],
            "shift_labels": labels[:, part].contiguous()}


def logits_shards(local_tokens: int, tile: int) -> int:
    return max(1, math.ceil(local_tokens / tile))


# ---------------------------------------------------------------- the libraries

class Trainer:
    """One engine at one setting: ``forward(batch) -> loss``, ``finish(loss)`` (backward
    and optimizer step), ``close()``."""

    def __init__(self, forward: Callable, finish: Callable, close: Callable) -> None:
        self.forward, self.finish, self.close = forward, finish, close


def _config(world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": world,
            "gradient_clipping": 0.0, "optimizer": OPTIMIZER,
            "zero_optimization": {"stage": 0}}


def deepshard_register(world: int):
    """deepshard's ``UlyssesSPAttentionHF`` registered once for the process; the mpu."""
    from deepshard.sequence.hf import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(llama(), "sdpa", world, 1)


def deepshard_trainer(mpu, tiled: bool, length: int, world: int, tile: int) -> Trainer:
    import deepshard
    from deepshard.sequence.loss import sequence_parallel_loss

    model = llama()
    config = _config(world)
    if tiled:
        config["sequence_parallel"] = {
            "tiled_mlp_compute": True, "tiled_logits_loss": True,
            "tiled_logits_shards": logits_shards(length // world, tile)}
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None

    def forward(batch: dict):
        if tiled:
            return engine(**batch).loss
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        return sequence_parallel_loss(out.logits, batch["shift_labels"], group)

    def finish(loss) -> None:
        engine.backward(loss)
        engine.step()

    return Trainer(forward, finish, engine.destroy)


def deepspeed_register(world: int):
    """DeepSpeed's ``UlyssesSPAttentionHF`` registered once for the process; the mpu."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(llama(), "sdpa", world, 1)


def _ds_tile_mlps(model) -> None:
    """DeepSpeed's ``TiledMLP`` on every MLP of ``model`` (its docstring's patch, per
    instance): tiles of ``hidden`` tokens."""
    import types

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, shards, params)

    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)


def _ds_tiled_loss(model, hidden, labels, tile: int):
    """DeepSpeed's ``TiledFusedLogitsLoss`` over ``lm_head``: this rank's mean token loss
    (each tile's sum over the rank's valid tokens, ``"sum"`` of the tiles: the weight
    gradients it accumulates inside its forward are then already scaled right)."""
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    valid = (labels != -100).sum().clamp(min=1)

    def loss_fn(head, x, y):
        logits = head(x).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1),
                               ignore_index=-100, reduction="sum") / valid

    shards = logits_shards(labels.numel(), tile)
    return TiledFusedLogitsLoss.apply(loss_fn, model.lm_head, hidden, labels, None, shards,
                                      [model.lm_head.weight], "sum")


def _ds_group_loss(logits, labels, group, world: int):
    """ALST's loss over a group: every rank's token-loss sum and token count, all-gathered."""
    import torch
    import torch.nn.functional as F

    flat = logits.view(-1, logits.shape[-1]).float()
    labels = labels.view(-1)
    total = F.cross_entropy(flat, labels, ignore_index=-100, reduction="sum")
    valid = (labels != -100).sum()
    if world == 1:
        return total / valid.clamp(min=1)
    sums = torch.distributed.nn.functional.all_gather(total, group=group)
    counts = [torch.zeros_like(valid) for _ in range(world)]
    torch.distributed.all_gather(counts, valid, group=group)
    return sum(sums) / sum(counts).clamp(min=1)


def deepspeed_trainer(mpu, tiled: bool, length: int, world: int, tile: int) -> Trainer:
    import deepspeed

    del length
    model = llama()
    if tiled:
        _ds_tile_mlps(model)
    config = _config(world)  # torch's AdamW, as deepshard's: no JIT-built FusedAdam
    config["optimizer"] = {**OPTIMIZER, "params": {**OPTIMIZER["params"], "torch_adam": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None

    def forward(batch: dict):
        ids, positions = batch["input_ids"], batch["position_ids"]
        if tiled:
            hidden = engine.module.model(input_ids=ids, position_ids=positions)
            return _ds_tiled_loss(engine.module, hidden.last_hidden_state,
                                  batch["shift_labels"], tile)
        out = engine(input_ids=ids, position_ids=positions)
        return _ds_group_loss(out.logits, batch["shift_labels"], group, world)

    def finish(loss) -> None:
        engine.backward(loss)
        engine.step()

    return Trainer(forward, finish, engine.destroy)


LIBS = {"deepshard": (deepshard_register, deepshard_trainer),
        "deepspeed": (deepspeed_register, deepspeed_trainer)}


# ---------------------------------------------------------------- measuring

def _group_max(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _step(trainer: Trainer, batch: dict, budget: float) -> tuple[float, float, bool]:
    """One step: (seconds, loss, over budget). Over budget already after the forward (the
    group's peak RSS), the backward is skipped."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = trainer.forward(batch)
    over = bool(budget) and _group_max(peak_mib()) > budget
    if not over:
        trainer.finish(loss)
    dist.barrier()
    return time.perf_counter() - start, float(loss.detach()), over


def measure(a: argparse.Namespace, mpu, tiled: bool, length: int, steps: int,
            budget: float) -> dict:
    """One length: build, warm, reset the peak, ``steps`` steps; the result line."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = LIBS[a.lib][1](mpu, tiled, length, world, a.logits_tile)
    _step(trainer, shard(WARM_TOKENS * world, 0, rank, world), 0.0)
    reset_peak()
    base = rss_mib()
    times, losses, over = [], [], False
    for i in range(steps):
        seconds, loss, over = _step(trainer, shard(length, i, rank, world), budget)
        times.append(seconds)
        losses.append(loss)
        if over:
            break
    peak = peak_mib()
    group_peak = _group_max(peak)
    trainer.close()
    del trainer
    return {"lib": a.lib, "tiled": tiled, "sp": world, "rank": rank, "length": length,
            "base_rss_mib": round(base, 1), "peak_rss_mib": round(peak, 1),
            "group_peak_rss_mib": round(group_peak, 1),
            "fits": not budget or group_peak <= budget, "step_s": times, "loss": losses}


def report(result: dict, job: str) -> dict:
    print(RESULT_TAG + json.dumps({**result, "job": job}), flush=True)
    return result


def search(a: argparse.Namespace, mpu, tiled: bool, start: int, cap: int) -> int:
    """The longest length up to ``cap`` that fits ``a.budget_mib``: doubling from
    ``start``, then ``a.bisections`` bisection steps between the last that fits and the
    first that does not; 0: none fits."""
    quantum = 8 * int(os.environ["WORLD_SIZE"])
    fits, length = 0, start
    while length <= cap:
        if not report(measure(a, mpu, tiled, length, 1, a.budget_mib), "search")["fits"]:
            break
        fits, length = length, 2 * length
    over = length if length <= cap else 0
    for _ in range(a.bisections if fits and over else 0):
        middle = (fits + over) // 2 // quantum * quantum
        if middle <= fits:
            break
        if report(measure(a, mpu, tiled, middle, 1, a.budget_mib), "search")["fits"]:
            fits = middle
        else:
            over = middle
    return fits


def run_jobs(a: argparse.Namespace, mpu) -> None:
    """``a.jobs``: ``search:u:START``, ``search:t:u`` (from the untiled maximum up to
    ``a.tiled_cap`` times it) and ``time:{u,t}:LENGTH|found`` in order (``found``: the
    search's result). Without ``a.budget_mib``, the budget is this rank's RSS after a warm
    step plus ``a.headroom_mib`` (rank 0's, for every rank)."""
    world = int(os.environ["WORLD_SIZE"])
    if not a.budget_mib and any(j.startswith("search") for j in a.jobs.split(",")):
        base = measure(a, mpu, False, WARM_TOKENS * world, 1, 0.0)["base_rss_mib"]
        budget = [base + a.headroom_mib]
        import torch.distributed as dist

        dist.broadcast_object_list(budget, src=0)
        a.budget_mib = round(budget[0], 1)
        print(RESULT_TAG + json.dumps({"job": "budget", "budget_mib": a.budget_mib,
                                       "base_rss_mib": base}), flush=True)
    found: dict[bool, int] = {}
    for job in a.jobs.split(","):
        what, kind, value = job.split(":")
        tiled = kind == "t"
        if what == "search":
            start = found.get(False, 0) if value == "u" else int(value)
            cap = start * a.tiled_cap if value == "u" else a.max_length
            found[tiled] = search(a, mpu, tiled, start, cap) if start else 0
            print(RESULT_TAG + json.dumps({"job": "found", "tiled": tiled, "length":
                                           found[tiled], "cap": cap}), flush=True)
            continue
        length = found.get(tiled, 0) if value == "found" else int(value)
        if length:
            report(measure(a, mpu, tiled, length, a.steps, 0.0), "time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lib", choices=tuple(LIBS))
    parser.add_argument("--jobs", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=0.0)
    parser.add_argument("--max-length", type=int, default=1 << 17)
    parser.add_argument("--logits-tile", type=int, default=64)
    parser.add_argument("--headroom-mib", type=float, default=96.0)
    parser.add_argument("--tiled-cap", type=int, default=4)
    parser.add_argument("--bisections", type=int, default=1)
    a = parser.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if a.lib == "deepspeed":
        import deepspeed
        import deepspeed.comm.torch

        # its shared-memory kernel serves only inference_all_reduce, and its JIT build takes
        # minutes on a loaded machine (with a lock that stalls the other ranks); the
        # module, not the attribute (deepspeed.comm.torch reads as torch itself)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import deepshard

        deepshard.init_distributed()
    try:
        run_jobs(a, LIBS[a.lib][0](int(os.environ["WORLD_SIZE"])))
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
