"""Drives a deepshard engine on a tiny GPT and reports per-rank facts as ``RESULT <json>``.

Modes (argv[1]):
- ``precision <config.json> <steps>``: train; report losses, skipped steps, loss scale,
  a checksum of the module's parameters, parameter dtype, state_bytes;
- ``slow-save <dir>``: save tag ``good``, then start saving tag ``bad`` with torch.save
  stalled after the first file (the test kills the process there);
- ``crash-at <step>``: run examples/train_gpt.py but exit hard at that optimizer step on
  rank 1 of the first attempt (DEEPSHARD_RESTART_COUNT unset or 0);
- ``release <config.json>``: twice, build an engine, train one step and drop it; report
  whether the engine and its model were freed (after ``gc.collect()``) and how many more
  objects of deepshard's classes are alive than before the first engine.
"""

from __future__ import annotations

import collections
import gc
import importlib
import json
import os
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPT, GPTConfig, rank_indices, sample_batch, stdlib_corpus  # noqa: E402

import deepshard  # noqa: E402
from deepshard.runtime.engine import DeepShardEngine  # noqa: E402
from deepshard.runtime.extensions import load_extensions  # noqa: E402

TINY = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)


def precision(config_path: str, steps: int) -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                           config=config_path)
    corpus = stdlib_corpus(1 << 20)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    rank, world = dist.get_rank(), engine.dp_world_size
    losses, scales = [], []
    for step in range(steps):
        for m in range(gas):
            x, y = sample_batch(corpus, rank_indices(step, m, rank, world, micro, gas), 0,
                                TINY.seq_len)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
        scales.append(engine.loss_scale)
    checksum = sum(float(p.detach().double().sum()) for p in engine.module.parameters())
    print("RESULT " + json.dumps({
        "rank": rank, "losses": losses, "scales": scales, "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps, "checksum": checksum,
        "dtype": str(next(engine.module.parameters()).dtype),
        "numel": sum(p.numel() for p in engine.module.parameters()),
        "nparams": len(list(engine.module.parameters())),
        "state_bytes": engine.state_bytes(), "lr": engine.get_lr()}), flush=True)


def slow_save(directory: str) -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = deepshard.initialize(model=model, config=config)
    x, y = sample_batch(stdlib_corpus(1 << 20), rank_indices(0, 0, 0, 1, 2, 1), 0, 32)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(directory, tag="good", client_state={"note": "good"})
    real_save = torch.save

    def stalled(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        print("STALLED", flush=True)
        time.sleep(600)

    torch.save = stalled
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(directory, tag="bad")


def _train_once(config_path: str) -> tuple[weakref.ref, weakref.ref, float]:
    torch.manual_seed(0)
    model = GPT(TINY)
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                           config=config_path)
    x, y = sample_batch(stdlib_corpus(1 << 20), rank_indices(0, 0, dist.get_rank(), 2, 2, 1),
                        0, TINY.seq_len)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return weakref.ref(engine), weakref.ref(model), float(loss)


def _deepshard_objects() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects()
                               if str(getattr(type(o), "__module__", "")).startswith("deepshard"))


def release(config_path: str) -> None:
    deepshard.init_distributed(verbose=False)
    importlib.import_module("deepshard.runtime.api")  # module-level objects (kernel registry)
    load_extensions()  # so are the features' registered Extension constants

    before = _deepshard_objects()
    rounds = []
    for _ in range(2):
        engine, model, loss = _train_once(config_path)
        left = _deepshard_objects() - before
        left.pop("_Beater", None)  # the heartbeat writer lives as long as the process
        left.pop("CommsLogger", None)  # so does deepshard.comm's logger (DeepSpeed's API)
        rounds.append({"engine_freed": engine() is None, "model_freed": model() is None,
                       "left": dict(left), "loss": loss})
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "rounds": rounds}), flush=True)


def crash_at(step: int, argv: list[str]) -> None:
    first_attempt = os.environ.get("DEEPSHARD_RESTART_COUNT", "0") == "0"
    real_step = DeepShardEngine.step

    def step_then_maybe_crash(self):
        real_step(self)
        if first_attempt and self.global_rank == 1 and self.global_steps == step:
            os._exit(17)

    DeepShardEngine.step = step_then_maybe_crash
    import train_gpt

    train_gpt.main(argv)


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    mode = argv[0]
    if mode == "precision":
        precision(argv[1], int(argv[2]))
    elif mode == "slow-save":
        slow_save(argv[1])
    elif mode == "crash-at":
        crash_at(int(argv[1]), argv[2:])
    elif mode == "release":
        release(argv[1])
    else:
        raise SystemExit(f"unknown mode {mode}")
