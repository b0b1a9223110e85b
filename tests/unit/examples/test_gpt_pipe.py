"""examples/gpt_pipe.py against examples/gpt.py, single process, no torch.distributed: the
stages of the pipelined GPT, built one by one with ``stage_id`` and chained by hand as the
pipeline engine chains them, start from the dense GPT's weights under the same seed and
give exactly its loss and gradients."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, GPTConfig, rank_indices, sample_batch
from gpt_pipe import gpt_layers, gpt_loss, gpt_param_name, pipe_gpt

from deepshard.runtime.parallel.pipe_module import PipelineModule

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=16)
SEED = 7


def batch(cfg: GPTConfig = CFG, size: int = 3):
    corpus = torch.arange(1000, dtype=torch.int64).remainder(cfg.vocab_size).numpy()
    return sample_batch(corpus, rank_indices(0, 0, 0, 1, size, 1), SEED, cfg.seq_len)


def dense_reference(cfg: GPTConfig = CFG):
    torch.manual_seed(SEED)
    return GPT(cfg)


def chain(stages: list[PipelineModule], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One forward and backward through the stages, each fed a detached copy of the
    previous stage's output, the gradient sent back by hand (as over the wire)."""
    sent, received = [], []
    for stage in stages:
        if received:
            x = x.detach().requires_grad_()
        received.append(x)
        x = stage(x)
        sent.append(x)
    loss = stages[-1].loss_fn(x, y)
    loss.backward()
    for s in range(len(stages) - 2, -1, -1):
        sent[s].backward(received[s + 1].grad)
    return loss


@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("method", ["parameters", "uniform", "type:Block"])
def test_stages_match_the_dense_gpt(num_stages, method):
    dense = dense_reference()
    x, y = batch()
    expected = dense(x, y)
    expected.backward()
    stages = [pipe_gpt(CFG, num_stages, SEED, stage_id=s, partition_method=method)
              for s in range(num_stages)]

    names = {n for s in stages for n, _ in s.named_parameters()}
    assert sorted(gpt_param_name(n, CFG) for n in names) == sorted(
        n for n, _ in dense.named_parameters())  # every parameter on exactly one stage
    dense_params = dict(dense.named_parameters())
    for stage in stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param, dense_params[gpt_param_name(name, CFG)]), name

    loss = chain(stages, x, y)
    assert torch.equal(loss, expected)
    for stage in stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param.grad, dense_params[gpt_param_name(name, CFG)].grad), name


def test_layer_list_and_loss():
    specs = gpt_layers(CFG)
    assert [s.typename.__name__ for s in specs] == ["GPTEmbedding", "Block", "Block", "Block",
                                                    "GPTHead"]
    whole = pipe_gpt(CFG, 1, SEED, stage_id=0)
    dense = dense_reference()
    x, y = batch()
    logits = whole(x)
    assert logits.shape == (3, CFG.seq_len, CFG.vocab_size)
    assert torch.equal(logits, dense(x))
    assert torch.equal(gpt_loss(logits, y), dense(x, y))


def test_rng_left_where_the_dense_build_leaves_it():
    dense_reference()
    after_dense = torch.rand(4)
    pipe_gpt(CFG, 2, SEED, stage_id=1)
    assert torch.equal(torch.rand(4), after_dense)


def test_activation_checkpointing_gives_the_same_gradients():
    x, y = batch()
    plain = [pipe_gpt(CFG, 2, SEED, stage_id=s) for s in range(2)]
    ckpt = [pipe_gpt(CFG, 2, SEED, stage_id=s, activation_checkpoint_interval=1)
            for s in range(2)]
    assert torch.equal(chain(plain, x, y), chain(ckpt, x, y))
    for a, b in zip(plain, ckpt, strict=True):
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-6), name


def test_param_name_mapping():
    assert gpt_param_name("0.pos_emb.weight", CFG) == "pos_emb.weight"
    assert gpt_param_name("1.qkv.bias", CFG) == "blocks.0.qkv.bias"
    assert gpt_param_name("4.ln_f.weight", CFG) == "ln_f.weight"
    for bad in ("5.head.weight", "head.weight"):
        with pytest.raises(ValueError):
            gpt_param_name(bad, CFG)
