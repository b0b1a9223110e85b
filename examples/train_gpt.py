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

With ``--plot PATH``, rank 0 also writes the run's loss curve to the PNG ``PATH`` at the
end (matplotlib, imported only then; without it the script says ``pip install matplotlib``
and exits 2 before training).

With ``pipeline.stages`` > 1 in the config, the model is the same GPT as a
``PipelineModule`` (``examples/gpt_pipe.py``: the same initial weights) and each step is one
``engine.train_batch``, fed this data-parallel rank's micro-batches, the same ones the
non-pipeline path uses for it. ``pipeline.partition_method`` and
``pipeline.activation_checkpoint_interval`` go to the PipelineModule;
``tensor_parallel.autotp_size`` is applied by ``deepshard.initialize``.

    ds-run --num_gpus 4 examples/train_gpt.py --deepspeed_config examples/configs/pp2_tp2.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, GPTConfig, rank_indices, sample_batch, stdlib_corpus
from gpt_pipe import pipe_gpt
from loss_plot import require_matplotlib, write_loss_plot

import deepshard
from deepshard.config.dialect import read_config_source
from deepshard.runtime.parallel.topology import Topology


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
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="rank 0 writes the run's loss curve to this PNG (needs "
                             "matplotlib: pip install 'deepshard[plot]')")
    deepshard.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot:
        require_matplotlib()  # before any training: one line and exit 2 when missing
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=args.n_head, d_model=args.d_model, dropout=args.dropout)
    pipeline, tp_size = parallel_settings(args.deepspeed_config)
    if pipeline.get("stages", 1) > 1:
        train_pipeline(args, cfg, pipeline, tp_size)
        return
    torch.manual_seed(args.seed)
    checkpoint = deepshard.checkpointing.checkpoint if args.activation_checkpointing else None
    model = GPT(cfg, checkpoint=checkpoint)
    engine, _, _, _ = deepshard.initialize(args=args, model=model,
                                           model_parameters=model.parameters())
    if args.checkpoint_dir and engine.global_steps == 0:
        engine.load_checkpoint(args.checkpoint_dir)  # (None, None) when there is none yet
    corpus = stdlib_corpus()
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), \
        engine.gradient_accumulation_steps()
    # with tensor parallelism, the ranks of one tensor group share a data-parallel rank
    dp_rank, dp_size = getattr(engine, "dp_rank", dist.get_rank()), engine.dp_world_size
    world, losses = dist.get_world_size(), []
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
        if world > 1:  # tensor-parallel peers hold the same loss: a mean over the world
            dist.all_reduce(total)
        report(losses, step + 1, (total / (accumulation * world)).item())
        if args.checkpoint_dir and args.save_interval and (step + 1) % args.save_interval == 0:
            engine.save_checkpoint(args.checkpoint_dir)
    finish(args, losses)


def report(losses: list[tuple[int, float]], step: int, loss: float) -> None:
    """Rank 0 prints ``step <n> loss <value>`` and keeps the pair for ``--plot``."""
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss!r}", flush=True)
        losses.append((step, loss))


def finish(args: argparse.Namespace, losses: list[tuple[int, float]]) -> None:
    """Rank 0 writes the ``--plot`` PNG; every rank leaves the process group."""
    if args.plot and dist.get_rank() == 0 and losses:
        config = os.path.basename(args.deepspeed_config or "no config")
        path = write_loss_plot(args.plot, losses, f"examples/train_gpt.py: loss by step, "
                               f"{config}, {dist.get_world_size()} rank(s)")
        print(f"loss curve written to {path}", flush=True)
    dist.destroy_process_group()


def parallel_settings(config_path: str | None) -> tuple[dict, int]:
    """The config's ``pipeline`` section (``stages`` an int: 1 when absent or ``"auto"``)
    and ``tensor_parallel.autotp_size`` (1 when absent). Values are checked by
    ``deepshard.initialize``; without a config path, it reports the missing config."""
    if config_path is None:
        return {"stages": 1}, 1
    data, _ = read_config_source(config_path)
    pipeline = dict(data.get("pipeline") or {})
    if not isinstance(pipeline.get("stages"), int):
        pipeline["stages"] = 1
    tp_size = (data.get("tensor_parallel") or {}).get("autotp_size", 1)
    return pipeline, tp_size if isinstance(tp_size, int) else 1


def train_pipeline(args: argparse.Namespace, cfg: GPTConfig, pipeline: dict,
                   tp_size: int) -> None:
    """The pipeline-parallel path: one ``engine.train_batch`` per step."""
    deepshard.init_distributed(verbose=False)  # the PipelineModule reads its stage from it
    topology = Topology.from_config(dist.get_world_size(), pipeline["stages"], tp_size)
    interval = int(pipeline.get("activation_checkpoint_interval", 0))
    if args.activation_checkpointing:
        interval = interval or 1
    model = pipe_gpt(cfg, seed=args.seed, topology=topology,
                     partition_method=pipeline.get("partition_method", "parameters"),
                     activation_checkpoint_interval=interval,
                     activation_checkpoint_func=deepshard.checkpointing.checkpoint
                     if args.activation_checkpointing else None)
    engine, _, _, _ = deepshard.initialize(args=args, model=model,
                                           model_parameters=model.parameters())
    if args.checkpoint_dir and engine.global_steps == 0:
        engine.load_checkpoint(args.checkpoint_dir)
    corpus = stdlib_corpus()
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), \
        engine.gradient_accumulation_steps()
    dp_rank, dp_size, world = engine.dp_rank, engine.dp_world_size, dist.get_world_size()
    losses: list[tuple[int, float]] = []
    for step in range(engine.global_steps, args.steps):
        batches = (tuple(t.to(engine.device) for t in sample_batch(
            corpus, rank_indices(step, m, dp_rank, dp_size, micro, accumulation), args.seed,
            cfg.seq_len)) for m in range(accumulation))
        loss = engine.train_batch(data_iter=batches)
        # every rank of a pipeline returns its replica's mean: the world's mean is the step's
        total = torch.as_tensor(loss).detach().to(engine.device, torch.float64).reshape(())
        if world > 1:
            dist.all_reduce(total)
        report(losses, step + 1, (total / world).item())
        if args.checkpoint_dir and args.save_interval and (step + 1) % args.save_interval == 0:
            engine.save_checkpoint(args.checkpoint_dir)
    finish(args, losses)


if __name__ == "__main__":
    main()
