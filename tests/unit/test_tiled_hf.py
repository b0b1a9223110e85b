"""ALST's switches on real transformers models (tiny Llama and Qwen2): the same loss and
gradients with each switch as without, less peak memory, offload observed through its
counters, and one-line errors where a switch cannot apply."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.sequence.alst import apply_alst
from tests.unit.test_tiled_compute import peak_bytes

transformers = pytest.importorskip("transformers")


def tiny(kind="llama", vocab=96, dtype=torch.float64, **extra):
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 **extra)
    if kind == "llama":
        config = transformers.LlamaConfig(**shape)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**shape)
        model = transformers.Qwen2ForCausalLM(config)
    return model.to(dtype)


def batch(vocab=96, seq=24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def step(model, ids, labels):
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def options(**on):
    fields = dict(tiled_mlp_compute=False, tiled_mlp_shards=None, tiled_logits_loss=False,
                  tiled_logits_shards=None, activation_checkpoint_cpu_offload=False)
    return SimpleNamespace(**{**fields, **on})


def assert_same(got, want, atol):
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=atol)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=atol, msg=name)


SWITCHES = {
    "tiled_mlp": dict(tiled_mlp_compute=True, tiled_mlp_shards=5),
    "tiled_mlp_auto": dict(tiled_mlp_compute=True),
    "tiled_logits": dict(tiled_logits_loss=True, tiled_logits_shards=7),
    "both": dict(tiled_mlp_compute=True, tiled_mlp_shards=3, tiled_logits_loss=True,
                 tiled_logits_shards=4),
}
# HF computes the loss from fp32 logits even in an fp64 model: compare at fp32 there
TOLERANCE = {"tiled_mlp": (torch.float64, 1e-12), "tiled_mlp_auto": (torch.float64, 1e-12),
             "tiled_logits": (torch.float32, 1e-5), "both": (torch.float32, 1e-5)}


@pytest.fixture(scope="module")
def reference():
    """The plain model of a kind and dtype with its loss and gradients, built once per
    module (each switch then runs on a copy)."""
    built: dict = {}

    def get(kind, dtype):
        if (kind, dtype) not in built:
            plain = tiny(kind, dtype=dtype)
            built[kind, dtype] = plain, step(plain, *batch())
        return built[kind, dtype]

    return get


# each switch alone on Llama; on Qwen2 (GQA, untied head) both together, which needs each
CASES = [("llama", switch) for switch in SWITCHES] + [("qwen2", "both")]


@pytest.mark.parametrize(("kind", "switch"), CASES)
def test_switch_keeps_loss_and_gradients(reference, kind, switch):
    dtype, atol = TOLERANCE[switch]
    plain, want = reference(kind, dtype)
    ids, labels = batch()
    model = copy.deepcopy(plain)
    applied = apply_alst(model, options(**SWITCHES[switch]))
    assert applied
    assert_same(step(model, ids, labels), want, atol=atol)


def test_fp32_tied_embeddings_and_shift_labels():
    plain = tiny(dtype=torch.float32, tie_word_embeddings=True)
    ids, labels = batch()
    want = step(plain, ids, labels)
    model = copy.deepcopy(plain)
    apply_alst(model, options(**SWITCHES["both"]))
    assert_same(step(model, ids, labels), want, atol=1e-5)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    model.zero_grad()
    out = model(input_ids=ids, shift_labels=shifted)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want[0], rtol=0, atol=1e-5)
    assert model(input_ids=ids).logits.shape == (2, 24, 96)  # no labels: HF's own forward


def test_offload_moves_each_checkpointed_input_through_the_host_hooks():
    plain = tiny()
    plain.gradient_checkpointing_enable()
    plain.train()
    ids, labels = batch()
    want = step(plain, ids, labels)
    model = copy.deepcopy(plain)
    model.gradient_checkpointing_enable()  # deepcopy drops the checkpoint functions' owner
    apply_alst(model, options(activation_checkpoint_cpu_offload=True))
    wrapped = {id(m._gradient_checkpointing_func) for m in model.model.layers}
    stats = model.model.layers[0]._gradient_checkpointing_func.stats
    assert len(wrapped) == 2 and all(
        m._gradient_checkpointing_func.stats is stats for m in model.model.layers)
    got = step(model, ids, labels)
    assert_same(got, want, atol=1e-12)
    hidden_bytes = 2 * 24 * 16 * 8
    assert stats.tensors == 2 and stats.bytes == 2 * hidden_bytes  # one input a layer
    assert stats.unpacked == stats.tensors and stats.moved_bytes == 0  # CPU: nothing to move


def test_tiling_lowers_the_peak_memory_of_a_training_step():
    plain = tiny(vocab=2000, dtype=torch.float32)
    ids, labels = batch(vocab=2000, seq=256)
    model = copy.deepcopy(plain)
    apply_alst(model, options(tiled_mlp_compute=True, tiled_mlp_shards=2,
                              tiled_logits_loss=True, tiled_logits_shards=8))
    before = peak_bytes(lambda: step(plain, ids, labels))
    after = peak_bytes(lambda: step(model, ids, labels))
    logits = 2 * 256 * 2000 * 4
    assert before > 2 * logits and after < before - logits, (before, after)


def test_switches_that_cannot_apply_are_one_line_errors():
    with pytest.raises(UsageError, match=r"sequence_parallel\.tiled_mlp_compute"):
        apply_alst(torch.nn.Linear(2, 2), options(tiled_mlp_compute=True))
    with pytest.raises(UsageError, match=r"sequence_parallel\.tiled_logits_loss"):
        apply_alst(torch.nn.Linear(2, 2), options(tiled_logits_loss=True))
    with pytest.raises(UsageError, match="gradient_checkpointing_enable"):
        apply_alst(tiny(), options(activation_checkpoint_cpu_offload=True))
