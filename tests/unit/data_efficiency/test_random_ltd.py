"""Random-LTD's layer wrapper against a reference that gathers nothing: the full layer under
a mask that lets each kept token see only kept tokens at or before it, its output taken at
the kept positions and the input elsewhere. In fp64 the outputs and the gradients of the
input and of every parameter agree to 1e-10, for examples/gpt.py's Block and HF's
LlamaDecoderLayer and GPT2Block. Then whole tiny HF models, the conversions and the
state-dict keys."""

from __future__ import annotations

import copy
import functools
import sys
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepshard.data_efficiency.ltd_schedule import RandomLtdSchedule, RandomLtdSpec
from deepshard.data_efficiency.random_ltd import (
    RandomLayerTokenDrop,
    bind_random_ltd,
    convert_layers_by_id,
    convert_to_random_ltd,
    draw_kept_indices,
    find_layer_list,
    patch_layer,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
    token_drop_of,
)
from deepshard.errors import UsageError
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, Block, GPTConfig

B, S, KEPT, TOL = 3, 12, 5, 1e-10


def make_spec(kept=KEPT, seq=S, ids=(0,), total=None, mask_name=None, order="batch_seq_dim"):
    return RandomLtdSpec(total_layer_num=total or max(ids) + 1, random_ltd_layer_num=len(ids),
                         random_ltd_layer_id=tuple(ids), global_batch_size=B, min_value=kept,
                         max_value=seq, require_steps=100, model_mask_name=mask_name,
                         hidden_state_order=order)


def wrap(layer, **spec_args):
    spec = make_spec(**spec_args)
    wrapper = RandomLayerTokenDrop(layer)
    wrapper.init_config(spec, RandomLtdSchedule(spec), 0)
    return wrapper.train()


def kept_mask(index, seq=S):
    return torch.zeros(index.shape[0], seq, dtype=torch.bool).scatter(1, index, True)


def reference_mask(kept):
    """[b, 1, s, s] bool: kept rows see kept tokens at or before them; dropped rows (their
    outputs are discarded) see themselves, so that no row is empty."""
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    mask = causal & kept[:, None, :]
    return (mask | torch.eye(S, dtype=torch.bool))[:, None]


def grads(out, x, layer, g):
    params = list(layer.parameters())
    return torch.autograd.grad((out * g).sum(), [x, *params], allow_unused=True)


def check_against_reference(layer, x, run_ltd, run_full, **spec_args):
    """run_ltd(wrapper, x) and run_full(layer, x, mask) -> the layer's hidden states."""
    torch.manual_seed(7)
    wrapper = wrap(layer, **spec_args)
    x1 = x.clone().requires_grad_()
    out = run_ltd(wrapper, x1)
    kept = kept_mask(wrapper.kept_indices)
    g = torch.randn_like(out)
    got = grads(out, x1, layer, g)

    x2 = x.clone().requires_grad_()
    full = run_full(layer, x2, reference_mask(kept))
    ref = torch.where(kept[..., None], full, x2)
    want = grads(ref, x2, layer, g)

    assert out.shape == x.shape
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    assert torch.equal(out[~kept], x[~kept])  # dropped tokens pass through exactly
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    return wrapper


# ---------------------------------------------------------------- examples/gpt.py's Block

def gpt_block():
    torch.manual_seed(0)
    return Block(GPTConfig(vocab_size=100, seq_len=S, n_layer=2, n_head=2, d_model=16)).double()


def test_gpt_block_equals_masked_reference(monkeypatch):
    sdpa = F.scaled_dot_product_attention

    def full(layer, x, mask):
        def masked(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, **kw)
        monkeypatch.setattr(F, "scaled_dot_product_attention", masked)
        try:
            return layer(x)
        finally:
            monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)

    x = torch.randn(B, S, 16, dtype=torch.float64)
    check_against_reference(gpt_block(), x, lambda w, x: w(x), full)


class SeqFirst(nn.Module):
    """A Block taking [s, b, h] hidden states, as Megatron's layers do."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x.transpose(0, 1)).transpose(0, 1)


def test_seq_batch_dim_equals_batch_seq_dim():
    block = gpt_block()
    x = torch.randn(B, S, 16, dtype=torch.float64)
    torch.manual_seed(3)
    batch_first = wrap(block)(x)
    torch.manual_seed(3)
    seq_first = wrap(SeqFirst(block), order="seq_batch_dim")(x.transpose(0, 1))
    torch.testing.assert_close(seq_first.transpose(0, 1), batch_first, atol=0, rtol=0)


def test_eval_unbound_and_full_length_are_the_plain_layer():
    block = gpt_block()
    x = torch.randn(B, S, 16, dtype=torch.float64)
    plain = block(x)
    assert torch.equal(wrap(block).eval()(x), plain)
    assert torch.equal(RandomLayerTokenDrop(block).train()(x), plain)
    full = wrap(block, kept=S)
    assert torch.equal(full(x), plain)
    assert full.kept_indices is None


def test_draws_are_keyed_by_position_not_the_global_generator():
    block = gpt_block()
    x = torch.randn(B, S, 16, dtype=torch.float64)
    wrapper = wrap(block)
    schedule = wrapper.random_ltd_scheduler
    first = wrapper(x)
    index = wrapper.kept_indices
    torch.rand(5)  # something else draws from torch's generator: no effect
    assert torch.equal(wrapper(x), first)
    assert torch.equal(wrapper.kept_indices, index)
    assert index.shape == (B, KEPT)
    assert bool((index.diff(dim=1) > 0).all())  # sorted, distinct
    assert torch.equal(draw_kept_indices(B, S, KEPT, seed=schedule.draw_key(0)), index)
    schedule.position += 1  # the next micro-step draws afresh
    wrapper(x)
    assert not torch.equal(wrapper.kept_indices, index)
    other_rank = RandomLtdSchedule(schedule.spec, rank=1)
    assert other_rank.draw_key(0) != schedule.draw_key(0)
    assert schedule.draw_key(0) != schedule.draw_key(1)


# ---------------------------------------------------------------- output structures, arguments

class Recorder(nn.Module):
    """Token-wise layer that records what it gets and returns ``kind`` of output."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin, self.seen = kind, nn.Linear(4, 4).double(), {}

    def forward(self, x, mask=None, position_ids=None, position_embeddings=None, **kw):
        self.seen = dict(mask=mask, position_ids=position_ids,
                         position_embeddings=position_embeddings, **kw)
        y = self.lin(x)
        if self.kind == "tuple":
            return y, "extra"
        if self.kind == "namedtuple":
            return Pair(y, "extra")
        if self.kind == "mapping":
            return OrderedDict(hidden=y, extra="extra")
        return y


class Pair(NamedTuple):
    hidden: torch.Tensor
    extra: str


@pytest.mark.parametrize("kind", ["tensor", "tuple", "namedtuple", "mapping"])
def test_output_structure_is_kept(kind):
    layer = Recorder(kind)
    x = torch.randn(B, S, 4, dtype=torch.float64)
    torch.manual_seed(0)
    out = wrap(layer)(x)
    hidden = {"tensor": lambda o: o, "tuple": lambda o: o[0], "namedtuple": lambda o: o.hidden,
              "mapping": lambda o: o["hidden"]}[kind](out)
    assert type(out) is type(layer(x))
    assert hidden.shape == x.shape
    if kind != "tensor":
        assert out[1 if kind != "mapping" else "extra"] == "extra"


def test_arguments_gathered_along_the_sequence():
    layer = Recorder("tensor")
    x = torch.randn(B, S, 4, dtype=torch.float64)
    mask = torch.randn(1, 1, S, S)
    padding = torch.arange(B * S).view(B, S)
    pos = torch.arange(S)[None]
    cos = torch.randn(1, S, 6)
    wrapper = wrap(layer, mask_name="mask")
    wrapper(x, mask, position_ids=pos, position_embeddings=(cos, cos + 1), other=padding)
    idx = wrapper.kept_indices
    seen = layer.seen
    for b in range(B):
        assert torch.equal(seen["mask"][b, 0], mask[0, 0][idx[b]][:, idx[b]])
        assert torch.equal(seen["position_ids"][b], idx[b])
        assert torch.equal(seen["position_embeddings"][0][b], cos[0, idx[b]])
        assert torch.equal(seen["position_embeddings"][1][b], cos[0, idx[b]] + 1)
    assert seen["other"] is padding  # unknown arguments pass as they are
    wrapper(x, padding)  # a [b, s] padding mask: its kept columns
    assert torch.equal(layer.seen["mask"], padding.gather(1, wrapper.kept_indices))


def test_unnamed_attention_mask_is_a_usage_error():
    layer = Recorder("tensor")
    x = torch.randn(B, S, 4, dtype=torch.float64)
    with pytest.raises(UsageError, match='model_mask_name to "attention_mask"'):
        wrap(layer)(x, attention_mask=torch.ones(B, 1, S, S))


def test_wrapper_reads_the_layers_attributes():
    wrapper = RandomLayerTokenDrop(Recorder("tensor"))
    assert wrapper.kind == "tensor"
    assert isinstance(wrapper.lin, nn.Linear)
    with pytest.raises(AttributeError):
        _ = wrapper.missing


# ---------------------------------------------------------------- HF decoder layers

def llama_parts(attn="sdpa"):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    config._attn_implementation = attn
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0).double()
    x = torch.randn(B, S, 32, dtype=torch.float64)
    pos = torch.arange(S)[None]
    cos, sin = LlamaRotaryEmbedding(config)(x, pos)
    return layer, x, pos, (cos, sin)


@pytest.mark.parametrize("mask_kind", ["none", "bool_causal", "additive_causal", "padded"])
def test_llama_layer_equals_masked_reference(mask_kind):
    layer, x, pos, rope = llama_parts()
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)
    valid = torch.ones(B, S, dtype=torch.bool)
    if mask_kind == "padded":
        valid[0, -6:] = False  # right padding: a causal mask's top-left corner would differ
        valid[2, -2:] = False
    allowed = causal & valid[:, None, None, :]
    mask = {"none": None, "bool_causal": allowed, "padded": allowed,
            "additive_causal": torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(
                ~allowed, torch.finfo(torch.float64).min)}[mask_kind]

    def ltd(wrapper, x):
        return wrapper(x, attention_mask=mask, position_embeddings=rope, position_ids=pos,
                       past_key_values=None, use_cache=False)

    def full(layer, x, ref):
        return layer(x, attention_mask=ref & allowed, position_embeddings=rope,
                     position_ids=pos, past_key_values=None, use_cache=False)

    check_against_reference(layer, x, ltd, full, mask_name="attention_mask")


@pytest.mark.parametrize("mask_kind", ["none", "bool_causal"])
def test_gpt2_block_equals_masked_reference(mask_kind):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=100,
                                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = GPT2Block(config, layer_idx=0).double()
    x = torch.randn(B, S, 32, dtype=torch.float64)
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)
    mask = causal if mask_kind == "bool_causal" else None

    # positional, as GPT2Model calls its blocks: (hidden, past_key_values, attention_mask, ...)
    check_against_reference(layer, x, lambda w, x: w(x, None, mask, None, use_cache=False),
                            lambda layer, x, ref: layer(x, None, ref, None, use_cache=False),
                            mask_name="attention_mask")


# ---------------------------------------------------------------- whole models

def hf_model(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=4, vocab_size=100,
                                         n_positions=64, resid_pdrop=0.0, attn_pdrop=0.0,
                                         embd_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))


IDS = (1, 2)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_hf_model_trains_and_full_length_is_unchanged(kind, padded):
    model = hf_model(kind)
    plain = copy.deepcopy(model).train()
    convert_layers_by_id(model, IDS)
    spec = make_spec(kept=6, seq=16, ids=IDS, total=4, mask_name="attention_mask")
    schedule = RandomLtdSchedule(spec)
    bound = bind_random_ltd(model, schedule)
    assert [w.layer_id for w in bound] == [0, 1]
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    attention = torch.ones(2, 16, dtype=torch.long)
    if padded:
        attention[1, :3] = 0  # left padding
    inputs = dict(input_ids=ids, labels=ids, attention_mask=attention if padded else None)

    loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert all(w.kept_indices.shape == (2, 6) for w in bound)

    schedule.set_current_seq(16)  # kept == seq: the plain model
    assert torch.equal(model(**inputs).loss, plain(**inputs).loss)


def test_deepshard_gpt_trains():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layer=3, n_head=2, d_model=16))
    convert_layers_by_id(model, [0, 2])
    bind_random_ltd(model, RandomLtdSchedule(make_spec(kept=4, seq=16, ids=(0, 2))))
    idx = torch.randint(0, 100, (2, 16))
    loss = model.train()(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.blocks[1].qkv.weight.grad is not None


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_positions(reentrant):
    """Each layer draws its own positions, so a checkpointed recomputation (RNG restored)
    draws the ones of the first forward."""
    idx = torch.randint(0, 100, (2, 16))
    results = []
    for ckpt in (None, functools.partial(checkpoint, use_reentrant=reentrant)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layer=3, n_head=2, d_model=16),
                    checkpoint=ckpt).double()
        convert_layers_by_id(model, [0, 2])
        bind_random_ltd(model, RandomLtdSchedule(make_spec(kept=4, seq=16, ids=(0, 2))))
        torch.manual_seed(5)
        loss = model.train()(idx, idx)
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    (loss, grads), (ck_loss, ck_grads) = results
    assert torch.equal(loss, ck_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ck_grads, strict=True))


# ---------------------------------------------------------------- conversion and state dicts

def test_convert_by_class_state_dict_keys():
    transformers = pytest.importorskip("transformers")
    model = hf_model("gpt2")
    plain_keys = list(model.state_dict())
    called = []

    class Engine:
        module = model

        def random_ltd_initialize(self):
            called.append(True)

    convert_to_random_ltd(Engine(), transformers.models.gpt2.modeling_gpt2.GPT2Block)
    assert called == [True]
    drops = [token_drop_of(m) for m in model.transformer.h]
    assert all(d is not None for d in drops)
    assert list(model.state_dict()) == plain_keys  # converted in place: the model's own keys
    convert_to_random_ltd(model, transformers.models.gpt2.modeling_gpt2.GPT2Block)  # idempotent
    assert [token_drop_of(m) for m in model.transformer.h] == drops


def test_wrapper_state_dict_keys():
    """DeepSpeed's wrapper module, built by hand, has its extra key component; removing it
    gives the plain keys."""
    model = hf_model("gpt2")
    plain_keys = list(model.state_dict())
    model.transformer.h[0] = RandomLayerTokenDrop(model.transformer.h[0])
    keys = list(model.state_dict())
    assert "transformer.h.0.random_ltd_layer.attn.c_attn.weight" in keys
    assert list(remove_random_ltd_state_dict(model.state_dict())) == plain_keys

    class Engine:
        module = model

    unconverted = hf_model("gpt2")
    unconverted.load_state_dict(save_without_random_ltd(Engine()))


def test_convert_by_id_state_dict_keys():
    model = hf_model("llama")
    plain_keys = list(model.state_dict())
    convert_layers_by_id(model, IDS)
    assert list(model.state_dict()) == plain_keys
    assert token_drop_of(model.model.layers[1]) is not None
    assert token_drop_of(model.model.layers[0]) is None


def test_find_layer_list():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layer=3, n_head=2, d_model=16))
    assert find_layer_list(gpt) is gpt.blocks
    assert find_layer_list(hf_model("gpt2")).__class__.__name__ == "ModuleList"

    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.dec = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    with pytest.raises(UsageError, match="TwoStacks has several layer lists"):
        find_layer_list(TwoStacks())
    with pytest.raises(UsageError, match=r"Linear has no nn\.ModuleList"):
        find_layer_list(nn.Linear(2, 2))
    with pytest.raises(UsageError, match="does not exist"):
        convert_layers_by_id(gpt, [5])


def test_bind_errors_and_unbinding():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layer=3, n_head=2, d_model=16))
    convert_layers_by_id(gpt, [0, 1])
    with pytest.raises(UsageError, match=r"no converted layer \[2\]") as info:
        bind_random_ltd(gpt, RandomLtdSchedule(make_spec(ids=(1, 2), total=3)))
    assert "\n" not in str(info.value)
    bound = bind_random_ltd(gpt, RandomLtdSchedule(make_spec(ids=(1,), total=3)))
    assert bound == [token_drop_of(gpt.blocks[1])]
    assert token_drop_of(gpt.blocks[0]).scheduler is None


@pytest.mark.parametrize("kind", ["gpt_block", "llama"])
def test_patched_in_place_equals_the_wrapper(kind):
    """A layer patched in place (what initialize and the converters do) computes what
    DeepSpeed's wrapper module computes: same positions, outputs and gradients."""
    if kind == "gpt_block":
        layer, kwargs = gpt_block(), {}
        x = torch.randn(B, S, 16, dtype=torch.float64)
    else:
        layer, x, pos, rope = llama_parts()
        kwargs = {"position_embeddings": rope, "position_ids": pos}
    patched = copy.deepcopy(layer)
    spec = make_spec()
    token_drop = patch_layer(patched)
    token_drop.bind(spec, RandomLtdSchedule(spec), 0)
    results = []
    for module in (wrap(layer), patched.train()):
        xs = x.clone().requires_grad_()
        torch.manual_seed(7)
        out = module(xs, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        results.append((out, torch.autograd.grad(out.square().sum(), [xs, *module.parameters()])))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    assert list(patched.state_dict()) == list(layer.state_dict())
