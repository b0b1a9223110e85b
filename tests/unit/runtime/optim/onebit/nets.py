"""The tiny network and training loop the 0/1 Adam and 1-bit LAMB unit tests share."""

from __future__ import annotations

import torch


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def backward(net: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    net(torch.randn(7, 5, generator=gen)).square().sum().backward()


def mask_of(net: torch.nn.Module) -> torch.Tensor:
    """A momentum mask for the last layer's weight with its second row off."""
    mask = torch.ones_like(net[2].weight)
    mask[1] = 0.0
    return mask


def run(opt, net, steps):
    for k in steps:
        backward(net, k)
        opt.step()
