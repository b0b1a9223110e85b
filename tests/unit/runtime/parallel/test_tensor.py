"""Tensor-parallel layers in a group of one (no communication) against the dense modules,
the pure shard/merge helpers, and the layers' errors. The multi-rank comparisons are in
tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepshard.errors import UsageError
from deepshard.runtime.parallel.autotp import plan_autotp
from deepshard.runtime.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_state_dict,
    tp_layout,
    vocab_parallel_cross_entropy,
)
from deepshard.runtime.parallel.tp_shards import (
    ShardSpec,
    merge_shards,
    shard_tensor,
    tp_merge_state_dicts,
    tp_shard_state_dict,
)
from tests.tp_models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=64)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(("dim", "sections"), [(0, ()), (1, ()), (0, (8, 8, 8)),
                                               (0, (16, 4, 4))])
def test_shard_and_merge_round_trip(world, dim, sections):
    full = torch.randn(24, 12) if dim == 0 else torch.randn(12, 24)
    spec = ShardSpec(dim, sections)
    shards = [shard_tensor(full, spec, r, world) for r in range(world)]
    assert all(s.shape[dim] == 24 // world for s in shards)
    assert torch.equal(merge_shards(shards, spec), full)


def test_fused_sections_give_each_rank_whole_heads_of_q_k_and_v():
    q, k, v = (torch.full((4, 3), float(i)) + torch.arange(4.0)[:, None] for i in (0, 10, 20))
    shard = shard_tensor(torch.cat([q, k, v]), ShardSpec(0, (4, 4, 4)), 1, 2)
    assert torch.equal(shard, torch.cat([q[2:], k[2:], v[2:]]))


def test_uneven_split_names_the_tensor():
    with pytest.raises(UsageError, match=r"blocks\.0\.fc\.weight.*cannot split 10"):
        shard_tensor(torch.zeros(10, 4), ShardSpec(0), 0, 4, "blocks.0.fc.weight")


def test_state_dict_shard_and_merge_with_the_autotp_layout():
    model = GPT(TINY)
    layout = plan_autotp(model, 4).param_layout()
    full = model.state_dict()
    shards = [tp_shard_state_dict(full, layout, r, 4) for r in range(4)]
    assert shards[1]["blocks.0.fc.weight"].shape == (64, 64)
    assert shards[1]["blocks.0.fc_out.weight"].shape == (64, 64)
    assert shards[1]["ln_f.weight"] is full["ln_f.weight"]  # replicated: shared, not copied
    merged = tp_merge_state_dicts(shards, layout)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[k], full[k]) for k in full)
    with pytest.raises(UsageError, match="other keys"):
        tp_merge_state_dicts([shards[0], {}], layout)


def test_column_parallel_in_a_group_of_one_is_the_dense_layer():
    dense = nn.Linear(6, 9)
    for layer in (ColumnParallelLinear.from_dense(dense, None),
                  ColumnParallelLinear.from_dense(dense, None, sections=(3, 3, 3)),
                  ColumnParallelLinear.from_dense(dense, None, gather_output=True)):
        x = torch.randn(2, 5, 6, requires_grad=True)
        y = layer(x)
        y.sum().backward()
        assert torch.equal(y, dense(x))
        assert layer.weight.data_ptr() != dense.weight.data_ptr()  # a copy
        assert tp_layout(layer) == {"weight": layer.spec, "bias": layer.spec}


def test_row_parallel_in_a_group_of_one_is_the_dense_layer():
    dense = nn.Linear(8, 3)
    for parallel in (True, False):
        layer = RowParallelLinear.from_dense(dense, None, input_is_parallel=parallel)
        x = torch.randn(4, 8)
        assert torch.allclose(layer(x), dense(x), atol=1e-6)
        assert tp_layout(layer) == {"weight": ShardSpec(1)}  # the bias is replicated


def test_vocab_parallel_embedding_in_a_group_of_one():
    dense = nn.Embedding(12, 4, padding_idx=2)
    layer = VocabParallelEmbedding.from_dense(dense, None)
    ids = torch.tensor([[0, 2, 11], [5, 2, 7]])
    out = layer(ids)
    out.sum().backward()
    assert torch.equal(out, dense(ids))
    assert torch.equal(layer.weight.grad[2], torch.zeros(4))  # padding row gets no grad
    with pytest.raises(UsageError, match=r"token ids must lie in \[0, 12\)"):
        layer(torch.tensor([12]))
    with pytest.raises(UsageError, match="max_norm"):
        VocabParallelEmbedding.from_dense(nn.Embedding(12, 4, max_norm=1.0), None, name="emb")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_cross_entropy_in_a_group_of_one(dtype):
    logits = (torch.randn(3, 5, 11) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, 11, (3, 5))
    target[0, :2] = -100
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.float().flatten(0, 1), target.flatten())
    ref.backward()
    loss = vocab_parallel_cross_entropy(logits, target, None)
    loss.backward()
    assert loss.dtype == dtype and logits.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(loss.float(), ref, atol=tol, rtol=tol)
    assert torch.allclose(logits.grad.float(), ref_logits.grad.float(), atol=tol)
    assert torch.isnan(vocab_parallel_cross_entropy(logits, torch.full((3, 5), -100), None))


def test_vocab_parallel_cross_entropy_rejects_bad_targets():
    logits = torch.randn(2, 3, 7)
    with pytest.raises(UsageError, match="does not match"):
        vocab_parallel_cross_entropy(logits, torch.zeros(6, dtype=torch.long), None)
    with pytest.raises(UsageError, match=r"targets must lie in \[0, 7\)"):
        vocab_parallel_cross_entropy(logits, torch.full((2, 3), 7), None)


def test_layer_errors_say_what_to_change():
    with pytest.raises(UsageError, match="gather_output with fused sections"):
        ColumnParallelLinear(4, 6, sections=(2, 2, 2), gather_output=True)
    with pytest.raises(UsageError, match=r"do not add up to out_features 6"):
        ColumnParallelLinear(4, 6, sections=(2, 2))


def test_fresh_layers_draw_like_dense_ones():
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(100, 40), RowParallelLinear(100, 40)
    assert col.weight.abs().max() <= 0.1 and row.weight.abs().max() <= 0.1
    assert torch.equal(row.bias, torch.zeros(40))  # replicated: equal on every rank


def test_gather_full_state_dict_in_a_group_of_one():
    model = GPT(TINY)
    full = gather_full_state_dict(model, None)
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
