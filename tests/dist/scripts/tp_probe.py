"""Tensor-parallel layers and AutoTP on real gloo groups, against the dense modules
computed in the same process; prints one ``RESULT <json>`` line per rank.

Every rank builds the same dense module and inputs (same seeds), runs it, then runs its
tensor-parallel shard; sharded gradients are all-gathered over the group and merged
before the comparison. The result maps each check to its largest difference relative to the largest
magnitude of the reference.
Checks run over the whole world as the tensor-parallel group and, on 4 ranks, again over
two groups of 2 (ranks {0,1} and {2,3}), so group-local ranks are exercised.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import deepshard  # noqa: E402
from deepshard.runtime.parallel.autotp import apply_autotp, plan_autotp  # noqa: E402
from deepshard.runtime.parallel.tensor import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_state_dict,
    tp_layout,
    tp_rank,
    tp_world_size,
    vocab_parallel_cross_entropy,
)
from deepshard.runtime.parallel.tp_shards import ShardSpec, merge_shards, shard_tensor  # noqa: E402
from tests.tp_models import GPT, GPT2Like, GPTConfig, LlamaLike, head_gpt  # noqa: E402

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=64)


def gather(t: torch.Tensor, spec: ShardSpec | None, group) -> torch.Tensor:
    """The full tensor from every rank's shard (``spec`` None: replicated, returned)."""
    if spec is None or tp_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return merge_shards(parts, spec)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative to the reference's largest magnitude."""
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.detach(), b.detach()
    scale = float(b.double().abs().max())
    return float((a.double() - b.double()).abs().max()) / (scale if scale > 0 else 1.0)


def rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_column(group, out: dict) -> None:
    world, rank = tp_world_size(group), tp_rank(group)
    for gather_output, sections in ((False, ()), (True, ()), (False, (16, 16, 16))):
        torch.manual_seed(1)
        dense = nn.Linear(12, 48)
        layer = ColumnParallelLinear.from_dense(dense, group, gather_output=gather_output,
                                                sections=sections)
        x, g = rand(3, 5, 12, seed=2), rand(3, 5, 48, seed=3)
        xd, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yd = dense(xd)
        (yd * g).sum().backward()
        yt = layer(xt)
        spec = ShardSpec(0, sections)
        g_local = g if gather_output else shard_tensor(g.movedim(-1, 0), spec, rank,
                                                       world).movedim(0, -1)
        (yt * g_local).sum().backward()
        full_y = yt if gather_output else gather(yt.movedim(-1, 0).contiguous(), spec,
                                                 group).movedim(0, -1)
        tag = f"column gather={gather_output} sections={len(sections)}"
        out[f"{tag} out"] = err(full_y, yd)
        out[f"{tag} dx"] = err(xt.grad, xd.grad)
        out[f"{tag} dW"] = err(gather(layer.weight.grad, spec, group), dense.weight.grad)
        out[f"{tag} db"] = err(gather(layer.bias.grad, spec, group), dense.bias.grad)


def check_row(group, out: dict) -> None:
    world, rank = tp_world_size(group), tp_rank(group)
    for parallel in (True, False):
        torch.manual_seed(4)
        dense = nn.Linear(48, 12)
        layer = RowParallelLinear.from_dense(dense, group, input_is_parallel=parallel)
        x, g = rand(3, 5, 48, seed=5), rand(3, 5, 12, seed=6)
        xd = x.clone().requires_grad_()
        xt = (x.chunk(world, -1)[rank] if parallel else x).clone().requires_grad_()
        yd = dense(xd)
        (yd * g).sum().backward()
        yt = layer(xt)
        (yt * g).sum().backward()
        tag = f"row parallel_input={parallel}"
        out[f"{tag} out"] = err(yt, yd)
        out[f"{tag} dx"] = err(xt.grad, xd.grad.chunk(world, -1)[rank] if parallel
                               else xd.grad)
        out[f"{tag} dW"] = err(gather(layer.weight.grad, ShardSpec(1), group),
                               dense.weight.grad)
        out[f"{tag} db"] = err(layer.bias.grad, dense.bias.grad)


def check_embedding_and_loss(group, out: dict) -> None:
    world, rank = tp_world_size(group), tp_rank(group)
    torch.manual_seed(7)
    dense = nn.Embedding(40, 6, padding_idx=3)
    layer = VocabParallelEmbedding.from_dense(dense, group)
    ids = torch.randint(0, 40, (4, 9), generator=torch.Generator().manual_seed(8))
    ids[0, :3] = 3
    g = rand(4, 9, 6, seed=9)
    (dense(ids) * g).sum().backward()
    yt = layer(ids)
    (yt * g).sum().backward()
    out["vocab embedding out"] = err(yt, dense(ids))
    out["vocab embedding dW"] = err(gather(layer.weight.grad, ShardSpec(0), group),
                                    dense.weight.grad)
    logits = rand(4, 7, 40, seed=10) * 3
    target = torch.randint(0, 40, (4, 7), generator=torch.Generator().manual_seed(11))
    target[1, 2:5] = -100
    target[2, 0] = 7
    for ignore in (-100, 7):
        target = target.masked_fill(target == -100, ignore)
        ld, lt = logits.clone().requires_grad_(), logits.chunk(world, -1)[rank].clone()
        lt.requires_grad_()
        dense_loss = F.cross_entropy(ld.flatten(0, 1), target.flatten(), ignore_index=ignore)
        dense_loss.backward()
        loss = vocab_parallel_cross_entropy(lt, target, group, ignore_index=ignore)
        (loss * 1.5).backward()
        out[f"cross entropy ignore={ignore} loss"] = err(loss, dense_loss)
        out[f"cross entropy ignore={ignore} dlogits"] = err(
            lt.grad, 1.5 * ld.grad.chunk(world, -1)[rank])
    allign = vocab_parallel_cross_entropy(logits.chunk(world, -1)[rank],
                                          torch.full((4, 7), -100), group)
    out["cross entropy all ignored is nan"] = 0.0 if bool(allign.isnan()) else 1.0


def compare_models(tag: str, dense: nn.Module, group, out: dict, facts: dict,
                   gather_logits: bool = True) -> None:
    """AutoTP on a deep copy of ``dense``: loss, every gradient, the gathered state dict,
    and three training steps."""
    model = copy.deepcopy(dense)
    plan = plan_autotp(model, tp_world_size(group), gather_logits=gather_logits)
    apply_autotp(model, plan, group)
    facts[f"{tag} attention"] = sorted({a.strategy for a in plan.attention})
    facts[f"{tag} layout"] = sorted(tp_layout(model)) == sorted(plan.param_layout())
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(12))
    y = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(13))

    def loss_of(m, tp: bool) -> torch.Tensor:
        if tp and not gather_logits:
            return vocab_parallel_cross_entropy(m(x), y, group)
        return m(x, y)

    dense_loss, tp_loss = loss_of(dense, False), loss_of(model, True)
    twin = copy.deepcopy(model)  # copies share the process group
    facts[f"{tag} deep copy computes the same"] = torch.equal(loss_of(twin, True), tp_loss)
    dense_loss.backward()
    tp_loss.backward()
    out[f"{tag} loss"] = err(tp_loss, dense_loss)
    layout = plan.param_layout()
    dense_params = dict(dense.named_parameters())
    worst, identical = 0.0, True
    for name, p in model.named_parameters():
        worst = max(worst, err(gather(p.grad, layout.get(name), group),
                               dense_params[name].grad))
        if name not in layout and tp_world_size(group) > 1:  # replicated: same on all ranks
            copies = [torch.empty_like(p.grad) for _ in range(tp_world_size(group))]
            dist.all_gather(copies, p.grad.contiguous(), group=group)
            identical &= all(torch.equal(c, p.grad) for c in copies)
    out[f"{tag} grads"] = worst
    facts[f"{tag} replicated grads bitwise equal across TP ranks"] = identical
    full = gather_full_state_dict(model, group)
    ref = dense.state_dict()
    facts[f"{tag} gathered state dict exact"] = (full.keys() == ref.keys() and all(
        torch.equal(full[k], ref[k]) for k in ref))
    losses = []
    for m, tp in ((dense, False), (model, True)):
        for _ in range(3):  # plain SGD by hand (torch.optim's first step costs seconds)
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
            loss = loss_of(m, tp)
            loss.backward()
        losses.append(loss)
    out[f"{tag} loss after 3 SGD steps"] = err(losses[1], losses[0])


def check_models(group, out: dict, facts: dict) -> None:
    torch.manual_seed(0)
    compare_models("gpt", GPT(TINY), group, out, facts)
    compare_models("head-gpt", head_gpt(TINY), group, out, facts)
    torch.manual_seed(0)
    compare_models("gpt sharded-logits", GPT(TINY), group, out, facts, gather_logits=False)
    compare_models("gpt2-like", GPT2Like(), group, out, facts)
    compare_models("llama-like", LlamaLike(), group, out, facts)
    compare_models("llama-like fused", LlamaLike(fused=True), group, out, facts)


def run_all(group) -> tuple[dict, dict]:
    out, facts = {}, {}
    for check in (check_column, check_row, check_embedding_and_loss):
        check(group, out)
    check_models(group, out, facts)
    return out, facts


def main() -> None:
    deepshard.init_distributed()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world, "groups": {}}
    layouts = [("world", list(range(world)))]
    if world == 4:
        layouts.append(("pairs", [[0, 1], [2, 3]]))
    for label, ranks in layouts:
        if label == "world":
            group = dist.group.WORLD
        else:
            groups = [dist.new_group(r) for r in ranks]  # every rank creates every group
            group = groups[rank // 2]
        start = time.perf_counter()
        errors, facts = run_all(group)
        result.setdefault("seconds", {})[label] = time.perf_counter() - start
        result["groups"][label] = {"size": tp_world_size(group), "tp_rank": tp_rank(group),
                                   "errors": errors, "facts": facts}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
