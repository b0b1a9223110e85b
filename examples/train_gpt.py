"""Train a small GPT on the Python standard library's source, byte by byte, with deepshard.

A DeepSpeed training script in every respect but the import: the engine comes from
``deepshard.initialize`` and the config from ``--deepspeed_config``. Rank 0 prints
``step <n> loss <value>``, the mean loss over the step's global batch. The data order
depends only on ``--seed`` and the global sample index, so any parallel layout sees the
same global batches and the loss curves of different layouts can be compared.

    ds-run --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/stage0.json

With ``--checkpoint_dir``, a checkpoint is saved every ``--save_interval`` steps and
training resumes from the newest complete one (after a restart by ``ds-run
--max_restarts``, or when run again).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig, rank_indices, sample_batch, stdlib_corpus

import deepshard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")
    parser.add_argument("--n_layer", type=int, default=GPTConfig.n_layer)
    parser.add_argument("--d_model", type=int, default=GPTConfig.d_model)
    parser.add_argument("--n_head", type=int, default=GPTConfig.n_head)
    parser.add_argument("--vocab_size", type=int, default=GPTConfig.vocab_size)
    parser.add_argument("--seq_len", type=int, default=GPTConfig.seq_len)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: keep)")
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--save_interval", type=int, default=0)
    parser.add_argument("--activation_checkpointing", action="store_true",
                        help="recompute each block in backward instead of storing it")
    deepshard.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=args.n_head, d_model=args.d_model, dropout=args.dropout)
    checkpoint = deepshard.checkpointing.checkpoint if args.activation_checkpointing else None
    model = GPT(cfg, checkpoint=checkpoint)
    engine, _, _, _ = deepshard.initialize(args=args, model=model,
                                           model_parameters=model.parameters())
    if args.checkpoint_dir and engine.global_steps == 0:
        engine.load_checkpoint(args.checkpoint_dir)  # (None, None) when there is none yet
    corpus = stdlib_corpus()
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), \
        engine.gradient_accumulation_steps()
    dp_rank, dp_size = dist.get_rank(), engine.dp_world_size
    for step in range(engine.global_steps, args.steps):
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        for micro_step in range(accumulation):
            idx = rank_indices(step, micro_step, dp_rank, dp_size, micro, accumulation)
            x, y = (t.to(engine.device) for t in sample_batch(corpus, idx, args.seed,
                                                              cfg.seq_len))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        if dp_size > 1:
            dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {(total / (accumulation * dp_size)).item()!r}",
                  flush=True)
        if args.checkpoint_dir and args.save_interval and (step + 1) % args.save_interval == 0:
            engine.save_checkpoint(args.checkpoint_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
