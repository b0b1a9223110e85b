"""AutoTP planning (pure) on examples/gpt.py and on GPT-2-, LLaMA- and Phi-3-like naming;
the attention trial; applying a plan in a group of one. Multi-rank exactness is in
tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepshard.errors import UsageError
from deepshard.runtime.parallel.autotp import apply_autotp, plan_autotp
from deepshard.runtime.parallel.autotp_trial import trial_head_sharding
from deepshard.runtime.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from deepshard.runtime.parallel.tp_shards import ShardSpec
from tests.tp_models import GPT, Block, GPT2Like, GPTConfig, HeadBlock, LlamaLike, head_gpt

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=64)


def kinds(plan) -> dict[str, str]:
    return {name: kind for name, kind in plan.kinds().items()}


def test_plan_for_the_example_gpt():
    plan = plan_autotp(GPT(TINY), 2)
    assert kinds(plan) == {
        "tok_emb": "vocab", "pos_emb": "replicate",
        **{f"blocks.{i}.{n}": k for i in range(2) for n, k in
           (("qkv", "column"), ("proj", "row"), ("fc", "column"), ("fc_out", "row"))},
        "head": "column"}
    assert plan.entry("head").gather_output  # the model's own F.cross_entropy sees all logits
    # Block reshapes with its input's full width, so attention cannot run on 1/T of the
    # heads: q/k/v are gathered and the output projection reads the replicated result
    assert [a.strategy for a in plan.attention] == ["gather", "gather"]
    assert "does not follow n_head" in plan.attention[0].reason
    assert plan.entry("blocks.0.qkv").gather_output and not plan.entry("blocks.0.qkv").sections
    assert not plan.entry("blocks.0.proj").input_is_parallel
    assert not plan.entry("blocks.0.fc").gather_output
    assert plan.entry("blocks.0.fc_out").input_is_parallel
    assert plan.param_layout() == {
        "tok_emb.weight": ShardSpec(0), "head.weight": ShardSpec(0),
        **{f"blocks.{i}.{n}": s for i in range(2) for n, s in (
            ("qkv.weight", ShardSpec(0)), ("qkv.bias", ShardSpec(0)),
            ("proj.weight", ShardSpec(1)), ("fc.weight", ShardSpec(0)),
            ("fc.bias", ShardSpec(0)), ("fc_out.weight", ShardSpec(1)))}}
    text = plan.describe()
    assert text.splitlines()[0] == "AutoTP plan, tensor-parallel size 2"
    assert "blocks.1.fc_out" in text and "attention blocks.0: gather" in text


def test_planning_changes_nothing():
    model = GPT(TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan_autotp(model, 4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(b.n_head == 4 for b in model.blocks)
    assert all(type(m) in (nn.Linear, nn.Embedding) for m in model.modules()
               if isinstance(m, (nn.Linear, nn.Embedding)))


def test_a_block_following_n_head_is_split_by_heads():
    plan = plan_autotp(head_gpt(TINY), 2)
    assert [a.strategy for a in plan.attention] == ["heads", "heads"]
    assert [(h.attribute, h.heads, h.local_heads) for h in plan.attention[0].heads] == [
        ("n_head", 4, 2)]
    qkv = plan.entry("blocks.0.qkv")
    assert qkv.sections == (64, 64, 64) and not qkv.gather_output
    assert plan.entry("blocks.0.proj").input_is_parallel
    assert plan.param_layout()["blocks.0.qkv.bias"] == ShardSpec(0, (64, 64, 64))


def test_gpt2_naming_with_a_tied_head():
    plan = plan_autotp(GPT2Like(), 2)
    block = {n.removeprefix("transformer.h.0."): k for n, k in kinds(plan).items()
             if n.startswith("transformer.h.0.")}
    assert block == {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column",
                     "mlp.c_proj": "row"}
    assert kinds(plan)["transformer.wte"] == "vocab"
    assert kinds(plan)["transformer.wpe"] == "replicate"
    assert kinds(plan)["lm_head"] == "column"
    assert plan.entry("transformer.h.0.attn.c_attn").sections == (64, 64, 64)
    assert plan.ties == (("transformer.wte", "lm_head"),)
    attn = plan.attention[0]
    assert attn.module == "transformer.h.0.attn" and attn.strategy == "heads"
    assert attn.heads[0].attribute == "num_heads" and "keeps every shape" in attn.reason


@pytest.mark.parametrize("fused", [False, True])
def test_llama_naming_with_grouped_query_attention(fused):
    plan = plan_autotp(LlamaLike(fused=fused), 2)
    layer = {n.removeprefix("model.layers.1."): k for n, k in kinds(plan).items()
             if n.startswith("model.layers.1.")}
    if fused:
        assert layer == {"self_attn.qkv_proj": "column", "self_attn.o_proj": "row",
                         "mlp.gate_up_proj": "column", "mlp.down_proj": "row"}
        assert plan.entry("model.layers.1.self_attn.qkv_proj").sections == (64, 32, 32)
        assert plan.entry("model.layers.1.mlp.gate_up_proj").sections == (96, 96)
    else:
        assert layer == {f"self_attn.{p}_proj": k for p, k in
                         (("q", "column"), ("k", "column"), ("v", "column"), ("o", "row"))} | {
            "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}
    assert kinds(plan)["model.embed_tokens"] == "vocab" and kinds(plan)["lm_head"] == "column"
    attn = plan.attention[1]
    assert attn.strategy == "heads"
    assert [(h.attribute, h.heads, h.local_heads) for h in attn.heads] == [
        ("num_heads", 8, 4), ("num_key_value_heads", 4, 2)]
    # its forward takes the attention bias too, so it could not be tried
    assert "needs more than one input" in attn.reason


def test_heads_that_do_not_divide_are_an_error():
    with pytest.raises(UsageError) as info:
        plan_autotp(GPT(GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=3,
                                  d_model=48)), 2)
    text = str(info.value)
    assert text.startswith("blocks.0: n_head=3 attention heads do not divide by the "
                           "tensor-parallel size 2")
    assert "HINT: choose a tensor-parallel size that divides 3" in text
    with pytest.raises(UsageError, match="num_key_value_heads=2 attention heads"):
        plan_autotp(LlamaLike(heads=8, kv_heads=2), 4)


def test_an_uneven_layer_is_an_error_naming_it():
    with pytest.raises(UsageError) as info:
        plan_autotp(LlamaLike(ffn=90), 4)
    text = str(info.value)
    assert "model.layers.0.mlp.gate_proj (Linear 64 -> 90, column-parallel)" in text
    assert "cannot split 90 along dim 0 evenly over 4" in text


def test_a_vocabulary_that_does_not_divide_stays_replicated():
    plan = plan_autotp(GPT(GPTConfig(vocab_size=255, seq_len=16, n_layer=1, n_head=4,
                                     d_model=64)), 2)
    assert plan.entry("tok_emb").kind == "replicate" and "255" in plan.entry("tok_emb").reason
    assert plan.entry("head").kind == "replicate"
    assert plan.entry("blocks.0.fc").kind == "column"


def test_sharded_logits_when_the_loss_is_routed():
    head = plan_autotp(GPT(TINY), 2, gather_logits=False).entry("head")
    assert head.kind == "column" and not head.gather_output
    assert "vocab_parallel_cross_entropy" in head.reason


def test_a_tie_split_two_ways_replicates_both():
    model = GPT2Like()
    model.transformer.wte.max_norm = 1.0  # cannot be vocabulary-parallel
    plan = plan_autotp(model, 2)
    assert plan.entry("lm_head").kind == "replicate"
    assert "tied to transformer.wte" in plan.entry("lm_head").reason
    assert plan.ties == ()


class UnknownNames(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.ff_a, self.ff_b, self.mix = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.mix(x + self.ff_b(F.relu(self.ff_a(x))))


def test_unknown_names_fall_back_to_shapes():
    model = nn.Sequential(UnknownNames(), UnknownNames())
    plan = plan_autotp(model, 2)
    assert kinds(plan) == {"0.ff_a": "column", "0.ff_b": "row", "0.mix": "replicate",
                           "1.ff_a": "column", "1.ff_b": "row", "1.mix": "replicate"}
    assert "by shape: expands 32 -> 128" in plan.entry("0.ff_a").reason


def test_layers_outside_blocks_and_lone_projections_stay_replicated():
    model = nn.ModuleDict({"proj_in": nn.Linear(8, 8), "blocks": nn.ModuleList(
        [nn.ModuleDict({"fc": nn.Linear(8, 32)})])})
    plan = plan_autotp(model, 2)
    assert plan.entry("proj_in").reason == "outside the transformer blocks"
    assert plan.entry("blocks.0.fc").kind == "replicate"
    assert "no row-parallel layer reads its output" in plan.entry("blocks.0.fc").reason


def test_tp_size_must_be_positive():
    with pytest.raises(UsageError, match=r"tensor_parallel\.autotp_size"):
        plan_autotp(GPT(TINY), 0)


class RegroupingBlock(Block):
    """Runs with fewer heads but silently regroups the head dimension (head_dim from the
    full input width): what a shape-only run must still catch."""

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, -1, d // self.n_head).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return x + self.proj(att.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize(("block", "verdict"), [(Block, "incompatible"),
                                                (HeadBlock, "compatible"),
                                                (RegroupingBlock, "incompatible")])
def test_the_attention_trial(block, verdict):
    module = block(TINY)
    local = {"qkv.weight": (96, 64), "qkv.bias": (96,), "proj.weight": (64, 32),
             "fc.weight": (128, 64), "fc.bias": (128,), "fc_out.weight": (64, 128)}
    result = trial_head_sharding(module, local, {"n_head": 2}, 64, 2)
    assert result.verdict == verdict, result.detail
    assert module.n_head == 4 and module.qkv.weight.shape == (192, 64)


@pytest.mark.parametrize("make", [lambda: GPT(TINY), lambda: head_gpt(TINY), GPT2Like,
                                  LlamaLike, lambda: LlamaLike(fused=True)])
def test_apply_in_a_group_of_one_keeps_the_function(make):
    dense = make()
    model = apply_autotp(copy.deepcopy(dense), plan_autotp(dense, 1), None)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    assert torch.allclose(model(x, y), dense(x, y), atol=1e-6)
    layers = [type(m) for m in model.modules()]
    assert ColumnParallelLinear in layers and RowParallelLinear in layers
    assert VocabParallelEmbedding in layers


def test_apply_keeps_ties_and_refuses_a_mismatched_plan():
    model = GPT2Like()
    plan = plan_autotp(model, 1)
    apply_autotp(model, plan, None)
    assert model.lm_head.weight is model.transformer.wte.weight
    with pytest.raises(UsageError, match="apply it once"):
        apply_autotp(model, plan, None)
    with pytest.raises(UsageError, match="plan is for 2 tensor-parallel ranks but the group "
                                         "has 1"):
        apply_autotp(GPT(TINY), plan_autotp(GPT(TINY), 2), None)


def test_moe_layers_are_left_whole():
    from deepshard.moe.layer import MoE

    class MoEBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = nn.Linear(8, 32), nn.Linear(32, 8)
            # by shape alone, each expert's 8 -> 16 -> 8 would be a column/row pair
            expert = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            self.moe = MoE(8, expert, num_experts=4, ep_size=2, k=2, use_residual=True)

    model = nn.Sequential(MoEBlock())
    plan = plan_autotp(model, 2)
    split = {n: k for n, k in kinds(plan).items() if k != "replicate"}
    assert split == {"0.fc": "column", "0.proj": "row"}
    inside = [e for e in plan.entries if e.name.startswith("0.moe.")]
    names = {e.name for e in inside}
    assert {"0.moe.deepspeed_moe.gate.wg", "0.moe.mlp.0", "0.moe.coefficient",
            "0.moe.deepspeed_moe.experts.deepspeed_experts.1.2"} <= names
    assert all("inside an MoE layer" in e.reason for e in inside)
