"""``DistributedAttention`` against full attention on one process (fp64), for many head
layouts in one launch; reports ``RESULT <json>``.

Each rank holds its contiguous ``1/P`` of the sequence; the reference is plain
``scaled_dot_product_attention`` over the whole sequence with the key/value heads repeated
for grouped-query attention. Cases: even, uneven and grouped-query head counts (key/value
heads fewer than the ranks, and query heads that straddle a key/value group), causal and
key-padded masks, both batch layouts, a 3-D output, groups smaller than the world; and the
one-line error for fewer query heads than ranks. ``diffs`` holds, per case, the largest
difference of the output and of the query, key and value gradients.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepshard.errors import UsageError
from deepshard.sequence.layer import DistributedAttention, _SeqAllToAll

B, S, D = 2, 12, 4


def local_attention(q, k, v, mask=None, causal=False, flat=False):
    """[b, s, h, d] attention; grouped-query heads repeated; ``flat``: [b, s, h * d]."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                         attn_mask=mask, is_causal=causal).transpose(1, 2)
    return out.reshape(*out.shape[:2], -1) if flat else out


def seq_first(fn):
    """The same local attention for [s, b, h, d] tensors."""
    def attend(q, k, v, **kw):
        return fn(*(t.transpose(0, 1) for t in (q, k, v)), **kw).transpose(0, 1)
    return attend


def padded_mask():
    """Causal, and the last 3 keys of sample 1 are padding: [b, 1, s, s] bool."""
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, -3:] = False
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return causal[None, None] & keep[:, None, None, :]


def run_case(group, hq, hkv, batch_dim, mode):
    size, me = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(hq * 100 + hkv)
    full = [torch.randn(B, S, h, D, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv)]
    kw = {"causal": True} if mode == "causal" else {"mask": padded_mask()}
    if mode == "flat":
        kw["flat"] = True
    full = [t.requires_grad_() for t in full]
    ref = local_attention(*full, **kw)
    weight = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    ref_grads = torch.autograd.grad((ref * weight).sum(), full)
    cut = slice(me * S // size, (me + 1) * S // size)
    mine = [t.detach()[:, cut].clone().requires_grad_() for t in full]
    attn_fn = local_attention
    if batch_dim == 1:
        mine_in = [t.transpose(0, 1) for t in mine]
        attn_fn = seq_first(local_attention)
    else:
        mine_in = mine
    out = DistributedAttention(attn_fn, group)(*mine_in, batch_dim, **kw)
    if batch_dim == 1:
        out = out.transpose(0, 1)
    grads = torch.autograd.grad((out * weight[:, cut]).sum(), mine)
    diffs = [(out - ref[:, cut]).abs().max().item()]
    diffs += [(g - r[:, cut]).abs().max().item() for g, r in zip(grads, ref_grads, strict=True)]
    return diffs


def seq_all_to_all_roundtrip(group):
    """DeepSpeed's ``_SeqAllToAll`` there and back is the identity (3 heads: uneven)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    x = torch.arange(B * S * 3 * D, dtype=torch.float64).view(B, S, 3, D)
    cut = slice(me * S // size, (me + 1) * S // size)
    heads = _SeqAllToAll.apply(group, x[:, cut], 2, 1, 0)
    back = _SeqAllToAll.apply(group, heads, 1, 2, 0)
    return (back - x[:, cut]).abs().max().item(), list(heads.shape)


def main():
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(world)))]
    if world == 4:  # two groups of 2 consecutive ranks too
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append(pairs[rank // 2])
    heads = [(4, 4), (3, 3), (5, 5), (6, 3), (4, 2), (4, 1), (8, 2), (6, 2), (5, 1)]
    diffs = {}
    for gi, group in enumerate(groups):
        size = dist.get_world_size(group)
        for hq, hkv in heads:
            if hq < size:
                continue
            for batch_dim, mode in ((0, "causal"), (1, "padded"), (0, "flat")):
                name = f"P{size}g{gi}:{hq}/{hkv}:b{batch_dim}:{mode}"
                diffs[name] = run_case(group, hq, hkv, batch_dim, mode)
    try:
        run_case(groups[0], world - 1, 1, 0, "causal")
        error = None
    except UsageError as err:
        error = str(err)
    roundtrip, shape = seq_all_to_all_roundtrip(groups[0])
    print("RESULT", json.dumps({"rank": rank, "diffs": diffs, "error": error,
                                "roundtrip": roundtrip, "shape": shape}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
