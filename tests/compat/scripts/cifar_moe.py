"""CIFAR-10 with Mixture of Experts as DeepSpeedExamples' training/cifar/cifar10_deepspeed.py
runs it with ``--moe``, on synthetic 3x8x8 images: ``deepspeed.moe.layer.MoE`` layers (one
per ``--num-experts`` entry, experts copied from one Linear) split over ``--ep-world-size``
ranks, the parameters optionally in separate expert groups
(``--moe-param-group``: ``split_params_into_different_moe_groups_for_optimizer``), and
deepspeed.initialize building the engine, its optimizer and the distributed dataloader.

    deepspeed --num_gpus 2 cifar_moe.py --deepspeed_config cifar_moe_config.json \\
        --moe --ep-world-size 2 --num-experts 2 4 --top-k 1 --min-capacity 4 --moe-param-group

With --out_dir, every rank saves its per-step mean losses and final weights there.
"""

import argparse
import json
import os

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn
from cifar_moe_model import Net
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from tiny_models import synthetic_images


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR (synthetic) with MoE")
    parser.add_argument("-e", "--epochs", default=2, type=int,
                        help="number of total epochs (default: 2)")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=1,
                        help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=None, type=int, choices=[0, 1, 2, 3],
                        help="ZeRO stage (default: the config's)")
    # For MoE (Mixture of Experts).
    parser.add_argument("--moe", default=False, action="store_true",
                        help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int,
                        help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1],
                        help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int,
                        help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the "
                             "capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values "
                             "are None, RSample, and Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using "
                             "ZeRO w. MoE")
    parser.add_argument("--samples", default=16, type=int, help="size of the training set")
    parser.add_argument("--seed", default=1138, type=int, help="PRNG seed")
    parser.add_argument("--out_dir", default=None, type=str,
                        help="where each rank saves its losses and final weights")
    # Include DeepSpeed configuration arguments.
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def create_moe_param_groups(model):
    """Create separate parameter groups for each expert."""
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    """The config file, with --stage and --dtype applied."""
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    if args.stage is not None:
        ds_config.setdefault("zero_optimization", {})["stage"] = args.stage
    ds_config["bf16"] = {"enabled": args.dtype == "bf16"}
    ds_config["fp16"] = {"enabled": args.dtype == "fp16"}
    return ds_config


def main(args):
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    trainset = synthetic_images(args.samples)

    torch.manual_seed(args.seed)
    net = Net(args, deepspeed.moe.layer.MoE)

    # Get list of parameters that require gradients.
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    # If using MoE, create separate param groups for each expert.
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)

    ds_config = get_ds_config(args)
    args.deepspeed_config = None  # the config goes in as a dict (with --stage applied)
    model_engine, _, trainloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)

            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)

            model_engine.backward(loss)
            model_engine.step()

            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= dist.get_world_size()
            losses.append(mean_loss.item())
            if local_rank == 0 and i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1:d}, {i + 1:5d}] loss: {mean_loss.item():.6f}")

    if args.out_dir:
        state = {k: v.detach().cpu().clone() for k, v in model_engine.module.state_dict().items()}
        torch.save({"losses": losses, "state": state},
                   os.path.join(args.out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    print("Finished Training")


if __name__ == "__main__":
    main(add_argument())
