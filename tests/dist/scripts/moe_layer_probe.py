"""The MoE layer on real gloo ranks against one process holding every expert; prints one
RESULT line per rank.

Every rank builds the same full layer (``ep_size=1``, all experts, distinct random
weights) and its expert-parallel layer, which loads its slice of the experts by global id.
Each rank routes its own tokens (gating is per rank in DeepSpeed too), so the reference of
rank ``q`` is the full layer on rank ``q``'s tokens with the same seed. Expected: the
output, the input gradient and the gate gradient equal rank ``q``'s reference; the
gradient of global expert ``g`` on a rank is the sum, over the ranks of its expert-parallel
group, of the reference's gradient of expert ``g`` (before any data-parallel reduction).

``parity``: every ``ep_size`` dividing the world, k = 1, 2, dropping and dropless, and a
residual layer. ``edge``: experts and a rank that receive no tokens, a rank that sends
none, and bad sizes.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import deepshard
from deepshard.errors import UsageError
from deepshard.moe.layer import MoE
from deepshard.runtime.parallel import expert_groups as groups

M, E = 8, 4


def expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(M, 12), torch.nn.GELU(), torch.nn.Linear(12, M))


def layers(ep_size: int, steer: bool, **kw) -> tuple[MoE, MoE]:
    torch.manual_seed(0)
    full = MoE(M, expert(), num_experts=E, min_capacity=0, **kw)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        if steer:  # with x[..., 0] = 50 every token's top expert is expert 0 (ep rank 0)
            full.deepspeed_moe.gate.wg.weight[:, 0] = torch.tensor([0.2, -0.2, -0.2, -0.2])
    sharded = MoE(M, expert(), num_experts=E, ep_size=ep_size, min_capacity=0, **kw)
    groups.configure(sharded)
    wanted = {f"deepspeed_moe.experts.deepspeed_experts.{g}.": f"deepspeed_moe.experts."
              f"deepspeed_experts.{j}." for j, g in enumerate(groups.global_expert_ids(sharded))}
    state = {}
    for name, value in full.state_dict().items():
        for src, dst in wanted.items():
            if name.startswith(src):
                name = dst + name[len(src):]
                break
        else:
            if ".deepspeed_experts." in name:
                continue
        state[name] = value
    sharded.load_state_dict(state)
    return full, sharded


def run(layer: MoE, rank: int, steer: bool, used: bool) -> dict:
    layer.zero_grad()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 6, M, generator=gen).requires_grad_()
    w = torch.randn(2, 6, M, generator=gen)
    if steer:
        x.data[..., 0] = 50.0
    used_token = (torch.arange(12) % (rank + 2) != 0).long() * (rank != 1) if used else None
    torch.manual_seed(100 + rank)
    y, l_aux, counts = layer(x, used_token)
    ((y * w).sum() + l_aux).backward()
    return {"y": y.detach(), "l_aux": l_aux.detach(), "counts": counts, "gx": x.grad,
            "grads": {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                      for n, p in layer.named_parameters()}}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (at least 1)."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def compare(ep_size: int, rank: int, steer: bool = False, used: bool = False, **kw) -> float:
    full, sharded = layers(ep_size, steer, **kw)
    mine = run(sharded, rank, steer, used)
    ep_ranks = sharded.expert_groups.ep_ranks
    refs = {q: run(full, q, steer, used) for q in ep_ranks}
    ref = refs[rank]
    worst = max(relative(mine[key], ref[key]) for key in ("y", "l_aux", "gx"))
    assert torch.equal(mine["counts"], ref["counts"])
    ids = groups.global_expert_ids(sharded)
    for name, grad in mine["grads"].items():
        if ".deepspeed_experts." in name:
            head, tail = name.split(".deepspeed_experts.")
            j, rest = tail.split(".", 1)
            full_name = f"{head}.deepspeed_experts.{ids[int(j)]}.{rest}"
            want = sum(refs[q]["grads"][full_name] for q in ep_ranks)
        else:
            want = ref["grads"][name]
        worst = max(worst, relative(grad, want))
    return worst


def parity(rank: int, world: int) -> dict:
    diffs = {}
    for ep_size in [e for e in (1, 2, 4) if world % e == 0]:
        for k in (1, 2):
            for drop in (True, False):
                diffs[f"ep{ep_size}-k{k}-drop{drop}"] = compare(ep_size, rank, k=k,
                                                                 drop_tokens=drop)
    diffs["residual"] = compare(world, rank, k=2, use_residual=True)
    return diffs


def edge(rank: int, world: int) -> dict:
    diffs = {"all-to-expert-0": compare(world, rank, True, k=1, drop_tokens=False),
             "top2-first-expert-0": compare(world, rank, True, k=2, drop_tokens=True),
             "rank-1-sends-nothing": compare(world, rank, used=True, k=1)}
    errors = []
    for kw in ({"num_experts": 3, "ep_size": 2}, {"num_experts": 8 * world, "ep_size": 2 * world}):
        try:
            groups.configure(MoE(M, expert(), **kw))
        except UsageError as exc:
            errors.append(str(exc))
    return {"diffs": diffs, "errors": errors}


def main() -> None:
    deepshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = sys.argv[-1]
    result = parity(rank, world) if mode == "parity" else edge(rank, world)
    print("RESULT " + json.dumps({"rank": rank, **({"diffs": result} if mode == "parity"
                                                   else result)}), flush=True)


if __name__ == "__main__":
    main()
