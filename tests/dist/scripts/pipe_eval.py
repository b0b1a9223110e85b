"""``engine.eval_batch`` on a real pipeline of the example GPT, run by ds-run on gloo.

    pipe_eval.py --config <ds_config.json> --out <out_dir>

Builds the GPT as a 2-stage ``PipelineModule`` (data parallel over the remaining ranks)
four times from the same seed and trains each ``STEPS`` steps with ``train_batch`` on the
global batches ``examples/train_gpt.py`` uses:

- ``evaluated`` / ``plain`` (no dropout): with an ``eval_batch`` of the held-out batch
  (global batch number ``EVAL_STEP``) before every step and after the last, and without;
- ``evaluated_dropout`` / ``plain_dropout`` (dropout 0.1): the same pair, where a stray
  draw from the random generator or a forward in train mode would change the curve.

Then it exercises ``eval_batch``'s options on ``evaluated``. Each rank saves what it saw
to ``<out_dir>/rank<N>.pt``; the test computes the single-process reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPTConfig, rank_indices, sample_batch, stdlib_corpus  # noqa: E402
from gpt_pipe import pipe_gpt  # noqa: E402

import deepshard  # noqa: E402
from deepshard.errors import UsageError, render  # noqa: E402
from deepshard.runtime.parallel.topology import Topology  # noqa: E402

TINY = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)
STAGES, STEPS = 2, 3
EVAL_STEP = 1000  # the held-out batch: global batch number 1000 of the data order
SEED = 0


def micro_batches(corpus, engine, step: int, count: int | None = None):
    """This replica's micro-batches of global batch ``step`` (``count`` of them, default
    ``gradient_accumulation_steps``), as ``train_gpt.py`` feeds ``train_batch``."""
    count = count or engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    return iter([sample_batch(corpus, rank_indices(step, mb, engine.dp_rank,
                                                   engine.dp_world_size, micro, count),
                              SEED, TINY.seq_len) for mb in range(count)])


def build(config: str, dropout: float):
    model = pipe_gpt(dataclasses.replace(TINY, dropout=dropout), seed=SEED,
                     topology=Topology.from_config(dist.get_world_size(), STAGES))
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine


def counters(engine) -> list[int]:
    return [engine.global_steps, engine.micro_steps, engine.skipped_steps]


def train(engine, corpus, with_eval: bool) -> dict:
    """``STEPS`` training steps, with an evaluation before each and after the last."""
    losses, evals, modes, moved = [], [], [], []
    for step in range(STEPS + 1):
        if with_eval:
            before = counters(engine)
            evals.append(float(engine.eval_batch(micro_batches(corpus, engine, EVAL_STEP))))
            modes.append(engine.module.training)
            moved.append(counters(engine) != before)
        if step < STEPS:
            losses.append(float(engine.train_batch(micro_batches(corpus, engine, step))))
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "evals": evals, "modes": modes, "counters_moved": moved,
            "state": state}


def usage_error(call) -> str | None:
    """The one line of the UsageError ``call`` raises, or None."""
    try:
        call()
    except UsageError as exc:
        return render(exc)
    return None


def options(engine, corpus) -> dict:
    """``eval_batch``'s arguments, on the trained ``evaluated`` engine."""
    held_out = lambda count=None: micro_batches(corpus, engine, EVAL_STEP, count)  # noqa: E731
    found = {}
    found["per_micro_batch"] = [float(x) for x in engine.eval_batch(held_out(),
                                                                    reduce_output=None)]
    last_only = engine.eval_batch(held_out(), bcast_loss=False)
    found["no_bcast"] = None if last_only is None else float(last_only)
    loss, logits = engine.eval_batch(held_out(), return_logits=True)
    found["with_logits"] = (float(loss), logits)
    found["three_micro_batches"] = float(engine.eval_batch(held_out(3), num_micro_batches=3))
    found["outputs"] = engine.eval_batch(held_out(), compute_loss=False)
    # the module's own modes are restored: already in eval; one submodule left in eval
    engine.module.eval()
    engine.eval_batch(held_out())
    found["kept_eval"] = engine.module.training
    engine.module.train()
    frozen = next(m for m in engine.module.modules() if isinstance(m, torch.nn.LayerNorm))
    frozen.eval()
    engine.eval_batch(held_out())
    found["mixed_modes"] = (engine.module.training, frozen.training)
    frozen.train()

    def broken():  # every stage of a 2-stage pipe loads data: all raise at the same point
        raise RuntimeError("data source failed")
        yield

    try:
        engine.eval_batch(broken())
    except RuntimeError as exc:
        found["raised"] = (str(exc), engine.module.training)
    found["bad_reduce"] = usage_error(lambda: engine.eval_batch(held_out(), reduce_output="sum"))
    found["bad_count"] = usage_error(lambda: engine.eval_batch(held_out(), num_micro_batches=0))
    found["after_errors"] = engine.module.training
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config, out = args.config, args.out
    deepshard.init_distributed(verbose=False)
    corpus = stdlib_corpus()
    result = {"rank": dist.get_rank()}
    for name, dropout, with_eval in [("evaluated", 0.0, True), ("plain", 0.0, False),
                                     ("evaluated_dropout", 0.1, True),
                                     ("plain_dropout", 0.1, False)]:
        engine = build(config, dropout)
        result[name] = train(engine, corpus, with_eval)
        if name == "evaluated":
            result["options"] = options(engine, corpus)
            result.update(stage=engine.stage_id, dp_rank=engine.dp_rank,
                          dp_size=engine.dp_world_size)
        del engine
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
