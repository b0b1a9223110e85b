"""CIFAR-10 training as DeepSpeedExamples' training/cifar/cifar10_deepspeed.py does it, on
synthetic 3x8x8 images: deepspeed.initialize builds the engine, its optimizer and the
distributed dataloader; the ZeRO stage comes from --stage (default: the config's).

    deepspeed --num_gpus 2 cifar_style.py --deepspeed_config cifar_config.json --stage 2

With --out_dir, every rank saves its per-step mean losses and final weights there.
"""

import argparse
import json
import os

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from tiny_models import Net, synthetic_images


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR (synthetic)")
    parser.add_argument("-e", "--epochs", default=1, type=int,
                        help="number of total epochs (default: 1)")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=1,
                        help="output logging information at a given interval")
    parser.add_argument("--stage", default=None, type=int, choices=[0, 1, 2, 3],
                        help="ZeRO stage (default: the config's)")
    parser.add_argument("--samples", default=32, type=int, help="size of the training set")
    parser.add_argument("--seed", default=1138, type=int, help="PRNG seed")
    parser.add_argument("--out_dir", default=None, type=str,
                        help="where each rank saves its losses and final weights")
    # Include DeepSpeed configuration arguments.
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(args):
    """The config file, with --stage applied."""
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    if args.stage is not None:
        ds_config.setdefault("zero_optimization", {})["stage"] = args.stage
    return ds_config


def main(args):
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    # Let rank 0 build the data first, as the example lets it download CIFAR first.
    if dist.get_rank() != 0:
        dist.barrier()
    trainset = synthetic_images(args.samples)
    if dist.get_rank() == 0:
        dist.barrier()

    torch.manual_seed(args.seed)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    # The config is passed as a dict (with --stage applied), so not also through args.
    ds_config = get_ds_config(args)
    args.deepspeed_config = None
    model_engine, _, trainloader, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    criterion = nn.CrossEntropyLoss()

    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)

            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)

            model_engine.backward(loss)
            model_engine.step()

            # The mean loss over the ranks, for the log.
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
    args = add_argument()
    main(args)
