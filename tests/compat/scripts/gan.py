"""A GAN trained as DeepSpeedExamples' training/gan/gan_deepspeed_train.py does it: two
engines (discriminator and generator) over torch Adam optimizers, the raw modules called
directly, two backwards into the discriminator's engine before its step, and the
generator's loss taken through the raw discriminator. Tiny MLPs on synthetic data.

    deepspeed --num_gpus 2 gan.py --deepspeed_config gan_config.json [--zero 2]

With --out_dir, every rank saves its per-step mean losses and both networks' weights.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from tiny_models import Discriminator, Generator, synthetic_real_samples
from torch.utils.data import DataLoader, DistributedSampler


def get_argument_parser():
    parser = argparse.ArgumentParser(description="tiny GAN")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=1, help="number of epochs to train for")
    parser.add_argument("--samples", type=int, default=32, help="size of the real data set")
    parser.add_argument("--nz", type=int, default=4, help="size of the latent z vector")
    parser.add_argument("--lr", type=float, default=0.0002, help="learning rate")
    parser.add_argument("--beta1", type=float, default=0.5, help="beta1 for adam")
    parser.add_argument("--manualSeed", type=int, default=999, help="manual seed")
    parser.add_argument("--zero", type=int, default=None, choices=[0, 1, 2],
                        help="ZeRO stage (default: the config's)")
    parser.add_argument("--out_dir", default=None, type=str,
                        help="where each rank saves its losses and final weights")
    return parser


def train(args):
    deepspeed.init_distributed()
    rank = dist.get_rank()
    device = torch.device(get_accelerator().device_name(args.local_rank))
    torch.manual_seed(args.manualSeed)
    nz = args.nz

    netG = Generator(nz=nz).to(device)
    netD = Discriminator().to(device)

    criterion = nn.BCELoss()
    real_label = 1
    fake_label = 0

    # setup optimizer
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))

    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    if args.zero is not None:
        ds_config["zero_optimization"] = {"stage": args.zero}
    model_engineD, optimizerD, _, _ = deepspeed.initialize(
        model=netD, model_parameters=netD.parameters(), optimizer=optimizerD, config=ds_config)
    model_engineG, optimizerG, _, _ = deepspeed.initialize(
        model=netG, model_parameters=netG.parameters(), optimizer=optimizerG, config=ds_config)

    # Each rank its own share of the data and its own noise.
    dataset = synthetic_real_samples(args.samples)
    batch_size = model_engineD.train_micro_batch_size_per_gpu()
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=rank)
    dataloader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    noise_gen = torch.Generator().manual_seed(args.manualSeed + 1 + rank)

    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            # train with real
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)

            # train with fake
            noise = torch.randn(batch_size, nz, generator=noise_gen).to(device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            errD = errD_real + errD_fake
            model_engineD.step()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            model_engineG.step()

            mean = torch.stack([errD.detach(), errG.detach()])
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
            losses.append(mean.tolist())
            if rank == 0:
                print(f"[{epoch}/{args.epochs}][{i}/{len(dataloader)}] "
                      f"Loss_D: {mean[0]:.6f} Loss_G: {mean[1]:.6f}")

    if args.out_dir:
        state = {f"{name}.{k}": v.detach().cpu().clone()
                 for name, net in (("netD", netD), ("netG", netG))
                 for k, v in net.state_dict().items()}
        torch.save({"losses": losses, "state": state},
                   os.path.join(args.out_dir, f"rank{rank}.pt"))
    dist.barrier()


def main():
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    train(args)


if __name__ == "__main__":
    main()
