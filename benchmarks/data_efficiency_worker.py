"""One run of ``benchmarks/data_efficiency.py``: train the small GPT with one data-efficiency
variant and write its validation curve.

A single process (gloo, world 1, RANK/WORLD_SIZE/MASTER_* set by the parent) trains
``examples/gpt.py``'s GPT on the standard library's source through ``deepshard.initialize``
with ``training_data=`` — the loader, the sequence-length curriculum and random-LTD are the
engine's, configured only by the ``data_efficiency`` section a user would write:

* ``baseline``: full sequences in every layer;
* ``curriculum``: ``seqlen_truncate``, ``fixed_linear`` from ``--cl_min`` tokens to the
  full sequence over ``--cl_frac`` of the steps (difficulty step 8);
* ``ltd``: random-LTD in every block but the first and the last, keeping ``--ltd_min``
  tokens at first, up to the full sequence over ``--ltd_frac`` of the steps;
* ``both``: the two together.

Every ``--eval_every`` steps (and at the end) the model's loss on a fixed held-out set (the
last 10% of the corpus, full sequences, eval mode) is measured; that time is not counted.
Writes ``--out`` (JSON): per evaluation the step, training wall seconds so far, training
tokens so far (as fed to the model: after truncation) and the validation loss. Trains
``--steps`` steps; with ``--stop_at_target`` it goes on (up to ``--max_steps``) until the
validation loss is at ``--target`` and the wall time at ``--min_wall``, so that both the time
to the target and the loss at the baseline's budget are measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

from gpt import GPT, GPTConfig, stdlib_corpus  # noqa: E402

import deepshard  # noqa: E402

VARIANTS = ("baseline", "curriculum", "ltd", "both")


class Windows(torch.utils.data.Dataset):
    """``count`` windows of ``seq_len + 1`` bytes of ``corpus``, at seeded random starts."""

    def __init__(self, corpus: np.ndarray, count: int, seq_len: int, seed: int):
        rng = np.random.default_rng(seed)
        self.corpus, self.seq_len = corpus, seq_len
        self.starts = rng.integers(0, len(corpus) - seq_len - 1, size=count)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(
            self.corpus[self.starts[i]:self.starts[i] + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def config(args: argparse.Namespace, n_layer: int) -> dict:
    """The ds_config of the variant."""
    steps, seq = args.steps, args.seq_len
    efficiency: dict = {"enabled": args.variant != "baseline", "seed": args.seed}
    if args.variant in ("curriculum", "both"):
        efficiency["data_sampling"] = {"enabled": True, "curriculum_learning": {
            "enabled": True, "curriculum_metrics": {"seqlen_truncate": {
                "min_difficulty": args.cl_min, "max_difficulty": seq,
                "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": int(steps * args.cl_frac),
                                    "difficulty_step": 8}}}}}
    if args.variant in ("ltd", "both"):
        layers = list(range(1, n_layer - 1))
        efficiency["data_routing"] = {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": n_layer, "random_ltd_layer_num": len(layers),
            "random_ltd_layer_id": layers, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": args.ltd_min, "max_value": seq,
                                    "schedule_type": "fixed_linear", "schedule_config": {
                                        "require_steps": int(steps * args.ltd_frac),
                                        "seq_per_step": 16}}}}
    return {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                     "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": args.warmup}},
        "data_efficiency": efficiency,
    }


@torch.no_grad()
def validation_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean loss over the held-out windows, in chunks, in eval mode."""
    model.eval()
    losses = [float(model(xs, ys)) for xs, ys in zip(x.split(16), y.split(16), strict=True)]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--cl_min", type=int, default=32)
    parser.add_argument("--cl_frac", type=float, default=0.4)
    parser.add_argument("--ltd_min", type=int, default=64)
    parser.add_argument("--ltd_frac", type=float, default=0.6)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--val_windows", type=int, default=128)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--stop_at_target", action="store_true")
    parser.add_argument("--max_steps", type=int, default=None,
                        help="train on past --steps up to this many, until --target")
    parser.add_argument("--min_wall", type=float, default=0.0,
                        help="with --stop_at_target: train at least this many seconds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    corpus = stdlib_corpus()
    split = int(len(corpus) * 0.9)
    train = Windows(corpus[:split], 1 << 16, args.seq_len, args.seed)
    val = Windows(corpus[split:], args.val_windows, args.seq_len, args.seed + 1)
    val_x = torch.stack([val[i][0] for i in range(len(val))])
    val_y = torch.stack([val[i][1] for i in range(len(val))])

    model = GPT(GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer,
                          n_head=args.n_head, d_model=args.d_model))
    engine, _, loader, _ = deepshard.initialize(model=model,
                                                model_parameters=model.parameters(),
                                                training_data=train,
                                                config=config(args, args.n_layer))
    last = args.max_steps or args.steps
    curve, wall, tokens, step = [], 0.0, 0, 0
    batches = iter(loader)
    while step < last:
        start = time.perf_counter()
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        wall += time.perf_counter() - start
        tokens += x.numel()
        step += 1
        if step % args.eval_every == 0 or step == last:
            value = validation_loss(engine.module, val_x, val_y)
            curve.append({"step": step, "wall_s": wall, "tokens": tokens, "val_loss": value,
                          "seq": int(x.shape[1])})
            print(f"{args.variant} step {step} wall {wall:.1f}s val {value:.4f} "
                  f"seq {x.shape[1]}", flush=True)
            reached = args.target is not None and value <= args.target
            if reached and args.stop_at_target and step >= args.steps and \
                    wall >= args.min_wall:
                break
    Path(args.out).write_text(json.dumps({"variant": args.variant, "curve": curve,
                                          "settings": vars(args)}))


if __name__ == "__main__":
    main()
