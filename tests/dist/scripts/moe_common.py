"""What the MoE engine scripts share: a small net with one MoE layer, its single-process
reference (every expert in one process, ep_size 1, plain torch) and the names that map one
onto the other.

The reference runs every rank's micro-batch through the whole model separately (capacity
and the load-balancing loss are per rank's tokens, as with expert parallelism) and steps
the mean of their losses: what the engine must equal at every ep_size and stage. Routing
is deterministic (no RTS, no second-expert sampling, no noisy gate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.moe.layer import MoE
from deepshard.runtime.parallel.expert_params import (
    split_params_into_different_moe_groups_for_optimizer,
)

H, E, MICRO, SEQ, LR = 8, 4, 2, 8, 0.05
EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


@dataclass(frozen=True)
class Case:
    """One configuration: expert parallelism, gating, ZeRO stage, optimizer."""

    ep: int
    k: int
    drop: bool
    stage: int
    # "sgd" (client torch SGD over split groups), "adam" (the config's Adam), or a client
    # optimizer with one group over every parameter, dense and expert ("sgd1", "adamw1":
    # DeepSpeed 0.19.8 accepts that at stage 0, asserts at stages 1-2)
    opt: str
    clip: float = 0.0
    empty: bool = False  # expert E-1 never gets a token

    @property
    def label(self) -> str:
        return (f"ep{self.ep}-k{self.k}-{'drop' if self.drop else 'dropless'}-"
                f"s{self.stage}-{self.opt}{'-clip' if self.clip else ''}"
                f"{'-empty' if self.empty else ''}")


class Net(torch.nn.Module):
    def __init__(self, ep: int, k: int, drop: bool):
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        expert = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.ReLU(),
                                     torch.nn.Linear(2 * H, H))
        self.moe = MoE(H, expert, num_experts=E, ep_size=ep, k=k, capacity_factor=1.0,
                       eval_capacity_factor=1.0, min_capacity=2, drop_tokens=drop,
                       use_rts=False, top2_2nd_expert_sampling=False)
        self.out = torch.nn.Linear(H, 1)

    def forward(self, x):
        y, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(y).pow(2).mean() + 0.1 * l_aux


def reference_state(case: Case) -> dict[str, torch.Tensor]:
    """The initial weights, every expert different (global names)."""
    torch.manual_seed(0)
    net = Net(1, case.k, case.drop)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".deepspeed_experts." in name:
                p.add_(torch.randn(p.shape) * 0.3)
        if case.empty:  # inputs are >= 0 after the relu: a negative row is never chosen
            wg = net.moe.deepspeed_moe.gate.wg.weight
            wg.copy_(wg.abs() + 0.1)
            wg[E - 1] = -1.0
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def to_local(state: dict[str, torch.Tensor], ep: int, ep_rank: int) -> dict:
    """The state dict of ep rank ``ep_rank`` (its experts renumbered from 0)."""
    local = E // ep
    out = {}
    for name, value in state.items():
        m = EXPERT.fullmatch(name)
        if m is None:
            out[name] = value
            continue
        gid = int(m.group(2))
        if gid // local == ep_rank:
            out[f"{m.group(1)}{gid % local}{m.group(3)}"] = value
    return out


def to_global(name: str, ep: int, ep_rank: int) -> str:
    m = EXPERT.fullmatch(name)
    if m is None:
        return name
    return f"{m.group(1)}{ep_rank * (E // ep) + int(m.group(2))}{m.group(3)}"


def ep_rank_of(ep: int) -> int:
    return dist.get_rank() % ep  # blocks of ep consecutive ranks (DeepSpeed's layout)


def engine_model(case: Case, state: dict[str, torch.Tensor]) -> Net:
    net = Net(case.ep, case.k, case.drop)
    net.load_state_dict(to_local(state, case.ep, ep_rank_of(case.ep)))
    return net


def config(case: Case, world: int) -> dict:
    cfg = {"train_batch_size": MICRO * world, "train_micro_batch_size_per_gpu": MICRO,
           "steps_per_print": 1000, "gradient_clipping": case.clip,
           "zero_optimization": {"stage": case.stage}}
    if case.opt == "adam":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR, "betas": [0.9, 0.99],
                                                       "eps": 1e-4, "weight_decay": 0.0}}
    return cfg


def client_optimizer(case: Case, net: torch.nn.Module):
    if case.opt == "adam":
        return None
    if case.opt == "sgd1":
        return torch.optim.SGD(net.parameters(), lr=LR)
    if case.opt == "adamw1":
        return torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-4,
                                 weight_decay=0.0)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "all"})
    return torch.optim.SGD(groups, lr=LR)


def batch(step: int, world: int) -> torch.Tensor:
    """Global batch ``step``: one micro-batch per data-parallel rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world, MICRO, SEQ, H, generator=g)


class Reference:
    """Plain torch on one process: every expert, every rank's micro-batch."""

    def __init__(self, case: Case, state: dict[str, torch.Tensor]):
        self.case = case
        self.net = Net(1, case.k, case.drop)
        self.net.load_state_dict(state)
        params = list(self.net.parameters())
        self.opt = torch.optim.SGD(params, lr=LR) if case.opt.startswith("sgd") else \
            torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.0)
        self.norm = 0.0
        self.counts = torch.zeros(E, dtype=torch.long)  # tokens routed to each expert

    def step(self, xs: torch.Tensor) -> None:
        self.opt.zero_grad()
        losses = []
        for x in xs:
            losses.append(self.net(x))
            self.counts += self.net.moe.deepspeed_moe.exp_counts.long().cpu()
        loss = sum(losses) / len(xs)
        loss.backward()
        grads = [p.grad for p in self.net.parameters()]
        self.norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])))
        if self.case.clip:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.case.clip)
        self.opt.step()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}


def max_diff(module: torch.nn.Module, ref: dict[str, torch.Tensor], ep: int) -> float:
    """Largest difference of this rank's parameters from the reference's (global names)."""
    worst = 0.0
    for name, p in module.state_dict().items():
        want = ref[to_global(name, ep, ep_rank_of(ep))]
        worst = max(worst, float((p.float() - want).abs().max()))
    return worst
