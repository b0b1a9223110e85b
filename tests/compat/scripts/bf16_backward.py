"""bf16 training as DeepSpeedExamples' training/bf16_master_weight/train.py does it, on a
tiny language model with random tokens: bf16 parameters and activations, fp32 master
weights in the ZeRO optimizer, and the PyTorch-style ``loss.backward()`` followed by
``model_engine.step()`` (``--backward engine`` uses ``model_engine.backward(loss)`` instead).

    deepspeed --num_gpus 2 bf16_backward.py --deepspeed_config bf16_config.json [--stage 3]

With --out_dir, every rank saves its per-step mean losses, the fp32 master weights and the
bf16 module weights.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param
from tiny_models import TinyLM, token_batch


def get_args():
    parser = argparse.ArgumentParser(description="bf16 master weights, PyTorch-style backward")
    parser.add_argument("--hidden_dim", type=int, default=16, help="Hidden dimension size")
    parser.add_argument("--vocab_size", type=int, default=32, help="Vocabulary size")
    parser.add_argument("--batch_size", type=int, default=4, help="Batch size per GPU")
    parser.add_argument("--seq_length", type=int, default=8, help="Sequence length")
    parser.add_argument("--num_steps", type=int, default=4, help="Number of training steps")
    parser.add_argument("--deepspeed_config", type=str, required=True,
                        help="Path to DeepSpeed config")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="Local rank for distributed training")
    parser.add_argument("--stage", type=int, default=None, choices=[1, 2, 3],
                        help="ZeRO stage (default: the config's)")
    parser.add_argument("--backward", default="torch", choices=["torch", "engine"],
                        help="loss.backward() (PyTorch style) or model_engine.backward(loss)")
    parser.add_argument("--seed", type=int, default=42, help="Random seed for reproducibility")
    parser.add_argument("--out_dir", default=None, type=str,
                        help="where each rank saves its losses and final weights")
    return parser.parse_args()


def main():
    args = get_args()

    deepspeed.init_distributed()
    local_rank = args.local_rank
    if local_rank == -1:
        local_rank = int(deepspeed.comm.get_rank())
    rank = deepspeed.comm.get_rank()
    world_size = deepspeed.comm.get_world_size()
    device = get_accelerator().device_name(local_rank)

    torch.manual_seed(args.seed)
    model = TinyLM(vocab_size=args.vocab_size, hidden_dim=args.hidden_dim,
                   max_seq_len=args.seq_length)

    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    if args.stage is not None:
        ds_config["zero_optimization"]["stage"] = args.stage

    model_engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config,
    )

    model_engine.train()
    loss_fn = nn.CrossEntropyLoss()
    loss_history = []
    for step in range(args.num_steps):
        input_ids, labels = token_batch(step, rank, args.batch_size, args.seq_length,
                                        args.vocab_size)
        input_ids, labels = input_ids.to(device), labels.to(device)

        logits = model_engine(input_ids)
        loss = loss_fn(logits.view(-1, args.vocab_size), labels.view(-1))

        if args.backward == "torch":
            # Backward pass - use PyTorch-style backward
            loss.backward()
        else:
            model_engine.backward(loss)

        # Optimizer step
        model_engine.step()

        mean_loss = loss.detach().float()
        deepspeed.comm.all_reduce(mean_loss)
        loss_history.append(mean_loss.item() / world_size)
        if rank == 0:
            print(f"[Rank {local_rank}] Step {step}: loss={loss_history[-1]:.6f}")

    if args.out_dir:
        named = list(model_engine.module.named_parameters())
        masters = {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in named}
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            weights = {n: p.detach().cpu().clone() for n, p in named}
        torch.save({"losses": loss_history, "masters": masters, "weights": weights},
                   os.path.join(args.out_dir, f"rank{rank}.pt"))
    deepspeed.comm.barrier()
    model_engine.destroy()


if __name__ == "__main__":
    main()
